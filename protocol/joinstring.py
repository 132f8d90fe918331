"""The join string: one line that carries everything a volunteer needs, nothing secret.

`bagel-worker join <join-string>` must be enough. The string holds the
run id, the coordinator's Ed25519 public key (which authenticates the coordinator's DHT
record, see `bagel.protocol.discovery`), one or more initial DHT peers and, when the
coordinator serves TLS, the sha256 fingerprint of its certificate. It is a
versioned prefix plus unpadded base64url of a compact JSON object, so it survives shells,
chat apps and copy-paste without quoting:

    bagel1:eyJ2IjoxLCJyIjoiZGlnaXRzLTJ4MiIsImsiOiIuLi4iLCJwIjpbIi9pcDQvLi4uIl19

JSON fields: `v` (1), `r` run id, `k` base64url public key (32 bytes), `p` list of
multiaddrs (each must name its peer with `/p2p/`, as hivemind's initial_peers need), and
optionally `t`, the base64url sha256 (32 bytes) of the coordinator's TLS certificate. With
`t` the worker pins that certificate and accepts only a DHT record naming the same one
(a plaintext record is refused: no downgrade). Without it (a plaintext coordinator, or a
join string made before the certificate existed) the worker pins the fingerprint of the
signed DHT record, which the coordinator key authenticates just as well.
The parser refuses anything malformed with a `JoinStringError` that says what is wrong.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass

PREFIX = "bagel1:"
VERSION = 1
MAX_JOIN_STRING_CHARS = 4096
MAX_INITIAL_PEERS = 16
MAX_MADDR_CHARS = 256
RUN_ID_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")  # same rule as coordinator.spec
_FINGERPRINT_RE = re.compile(r"[0-9a-f]{64}")
_MADDR_RE = re.compile(r"/[\x21-\x7e]+/p2p/[1-9A-HJ-NP-Za-km-z]{32,128}")


class JoinStringError(ValueError):
    """The join string is malformed; the message says what is wrong."""


def _b64encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64decode(text: str, what: str) -> bytes:
    if not re.fullmatch(r"[A-Za-z0-9_-]*", text):
        raise JoinStringError(f"{what}: not base64url")
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise JoinStringError(f"{what}: not base64url") from None


@dataclass(frozen=True)
class JoinInfo:
    run_id: str
    coordinator_public_key: bytes  # raw Ed25519, 32 bytes
    initial_peers: tuple[str, ...]  # multiaddrs with /p2p/<peer id>
    tls_fingerprint: str = ""  # sha256 of the coordinator's TLS certificate, lowercase hex; "" = not pinned here

    def __post_init__(self) -> None:
        _check(self)

    def encode(self) -> str:
        """The join string (`bagel1:` + base64url JSON)."""
        body: dict[str, object] = {
            "v": VERSION,
            "r": self.run_id,
            "k": _b64encode(self.coordinator_public_key),
            "p": list(self.initial_peers),
        }
        if self.tls_fingerprint:
            body["t"] = _b64encode(bytes.fromhex(self.tls_fingerprint))
        return PREFIX + _b64encode(json.dumps(body, separators=(",", ":"), sort_keys=True).encode())

    def __str__(self) -> str:
        return self.encode()


def _check(info: JoinInfo) -> None:
    if not isinstance(info.run_id, str) or not RUN_ID_RE.fullmatch(info.run_id):
        raise JoinStringError("run id: lowercase letters, digits, '-' and '_', at most 63 characters")
    if not isinstance(info.coordinator_public_key, bytes) or len(info.coordinator_public_key) != 32:
        raise JoinStringError("coordinator public key: must be 32 bytes (Ed25519)")
    if not isinstance(info.initial_peers, tuple) or not info.initial_peers:
        raise JoinStringError("initial peers: at least one multiaddr is required")
    if len(info.initial_peers) > MAX_INITIAL_PEERS:
        raise JoinStringError(f"initial peers: at most {MAX_INITIAL_PEERS}")
    for i, maddr in enumerate(info.initial_peers):
        if not isinstance(maddr, str) or len(maddr) > MAX_MADDR_CHARS or not _MADDR_RE.fullmatch(maddr):
            raise JoinStringError(
                f"initial peer {i}: not a multiaddr ending in /p2p/<peer id> (got {str(maddr)[:80]!r})"
            )
    fp = info.tls_fingerprint
    if not isinstance(fp, str) or (fp and not _FINGERPRINT_RE.fullmatch(fp)):
        raise JoinStringError("TLS fingerprint: must be a sha256 in lowercase hex (64 digits)")


def make_join_string(
    run_id: str,
    coordinator_public_key: bytes,
    initial_peers: list[str] | tuple[str, ...],
    tls_fingerprint: str = "",
) -> str:
    """Build a join string; raises JoinStringError on bad parts (so the daemon fails early)."""
    peers = tuple(str(p) for p in initial_peers)
    return JoinInfo(run_id, bytes(coordinator_public_key), peers, tls_fingerprint).encode()


def parse_join_string(text: str) -> JoinInfo:
    """Parse and check a join string; JoinStringError says what is wrong."""
    if not isinstance(text, str):
        raise JoinStringError("join string must be text")
    text = text.strip()
    if len(text) > MAX_JOIN_STRING_CHARS:
        raise JoinStringError(f"too long ({len(text)} > {MAX_JOIN_STRING_CHARS} characters)")
    if not text.startswith(PREFIX):
        found = text.split(":", 1)[0][:16] if ":" in text else ""
        hint = f" (found prefix {found!r}: a newer Bagel?)" if found.startswith("bagel") else ""
        raise JoinStringError(f"must start with {PREFIX!r}{hint}")
    raw = _b64decode(text[len(PREFIX) :], "body")
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise JoinStringError("body: not JSON (truncated copy-paste?)") from None
    if not isinstance(body, dict):
        raise JoinStringError("body: must be a JSON object")
    if body.get("v") != VERSION:
        raise JoinStringError(f"version {body.get('v')!r} is not supported (expected {VERSION})")
    required, optional = {"v", "r", "k", "p"}, {"t"}
    if not required <= set(body) <= required | optional:
        missing, extra = sorted(required - set(body)), sorted(set(body) - required - optional)
        raise JoinStringError(f"body: missing fields {missing}, unknown fields {extra}")
    if not isinstance(body["k"], str):
        raise JoinStringError("coordinator public key: must be base64url text")
    if not isinstance(body["p"], list):
        raise JoinStringError("initial peers: must be a list")
    fingerprint = ""
    if "t" in body:
        if not isinstance(body["t"], str):
            raise JoinStringError("TLS fingerprint: must be base64url text")
        digest = _b64decode(body["t"], "TLS fingerprint")
        if len(digest) != 32 or _b64encode(digest) != body["t"]:
            raise JoinStringError("TLS fingerprint: must be 32 bytes (sha256) in canonical base64url")
        fingerprint = digest.hex()
    return JoinInfo(body["r"], _b64decode(body["k"], "coordinator public key"), tuple(body["p"]), fingerprint)
