"""Join tokens of a permissioned run: operator-signed, checked on Register.

A token is a serialized `JoinToken`: `claims` (a serialized `JoinTokenClaims`: run id,
a random 16-byte token id, a name, issue and expiry times, a use count) and the
operator's Ed25519 signature over exactly those claim bytes (never a re-serialization,
as with envelopes). The operator's public key is the run spec's
`security.operator_public_key`, so only its holder can mint tokens. Humans and command
lines see the text form `bagel-token1:<urlsafe base64>`.

What a signature cannot say lives in the coordinator's store: how many uses are left,
which worker key the token was bound to at its first use, whether it was revoked
(`bagel.coordinator.store.Store.use_token`). This module is pure (no clock: `now_ms` is
an argument) and only checks what the bytes themselves prove.

Statuses (each a class with its `status`, mapped by the coordinator's interceptor):

| error          | status            | meaning                                         |
| -------------- | ----------------- | ----------------------------------------------- |
| TokenMissing   | UNAUTHENTICATED   | a permissioned run and no token                 |
| TokenMalformed | UNAUTHENTICATED   | not a JoinToken, bad sizes, claims do not parse |
| TokenForged    | UNAUTHENTICATED   | the operator's signature does not verify        |
| TokenExpired   | UNAUTHENTICATED   | past its expiry                                 |
| TokenWrongRun  | PERMISSION_DENIED | signed by the operator, for another run         |
| TokenUnknown   | PERMISSION_DENIED | validly signed, not issued from this data dir   |
| TokenRevoked   | PERMISSION_DENIED | revoked by the operator                         |
| TokenUsedUp    | PERMISSION_DENIED | no uses left                                    |
| TokenBound     | PERMISSION_DENIED | bound to another worker key at its first use    |

Missing, malformed, forged and expired tokens are not valid credentials at all
(UNAUTHENTICATED); the others are genuine operator tokens that do not admit this caller
(PERMISSION_DENIED).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, verify_signature

TEXT_PREFIX = "bagel-token1:"
TOKEN_ID_BYTES = 16
MAX_TOKEN_BYTES = 1024  # = validation.MAX_JOIN_TOKEN_BYTES
MAX_NAME_CHARS = 64
MAX_USES = 1 << 20


class JoinTokenError(Exception):
    """A join token was refused; `status` is the gRPC code the coordinator answers."""

    status: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED


class TokenMissing(JoinTokenError):
    status = grpc.StatusCode.UNAUTHENTICATED


class TokenMalformed(JoinTokenError):
    status = grpc.StatusCode.UNAUTHENTICATED


class TokenForged(JoinTokenError):
    status = grpc.StatusCode.UNAUTHENTICATED


class TokenExpired(JoinTokenError):
    status = grpc.StatusCode.UNAUTHENTICATED


class TokenWrongRun(JoinTokenError):
    status = grpc.StatusCode.PERMISSION_DENIED


class TokenUnknown(JoinTokenError):
    status = grpc.StatusCode.PERMISSION_DENIED


class TokenRevoked(JoinTokenError):
    status = grpc.StatusCode.PERMISSION_DENIED


class TokenUsedUp(JoinTokenError):
    status = grpc.StatusCode.PERMISSION_DENIED


class TokenBound(JoinTokenError):
    status = grpc.StatusCode.PERMISSION_DENIED


@dataclass(frozen=True)
class TokenClaims:
    run_id: str
    token_id: str  # hex of the 16 random bytes
    name: str
    issued_unix_ms: int
    expires_unix_ms: int
    uses: int


def operator_key_bytes(b64: str) -> bytes:
    """The raw 32-byte key of a base64 `security.operator_public_key`; ValueError if it is not one."""
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("operator_public_key is not base64") from None
    if len(raw) != PUBLIC_KEY_BYTES:
        raise ValueError(f"operator_public_key must be {PUBLIC_KEY_BYTES} bytes, got {len(raw)}")
    return raw


def issue_token(
    operator: Identity,
    *,
    run_id: str,
    token_id: bytes,
    name: str,
    issued_ms: int,
    expires_ms: int,
    uses: int,
) -> bytes:
    """A signed token (the wire bytes). ValueError for out-of-range arguments."""
    if len(token_id) != TOKEN_ID_BYTES:
        raise ValueError(f"token_id must be {TOKEN_ID_BYTES} bytes")
    if not name or len(name) > MAX_NAME_CHARS or not name.isprintable():
        raise ValueError(f"name: 1 to {MAX_NAME_CHARS} printable characters")
    if not 1 <= uses <= MAX_USES:
        raise ValueError(f"uses must be in [1, {MAX_USES}]")
    if expires_ms <= issued_ms:
        raise ValueError("the token must expire after it is issued")
    claims = pb.JoinTokenClaims(
        run_id=run_id,
        token_id=token_id,
        name=name,
        issued_unix_ms=issued_ms,
        expires_unix_ms=expires_ms,
        uses=uses,
    ).SerializeToString()
    raw = pb.JoinToken(claims=claims, signature=operator.sign(claims)).SerializeToString()
    if len(raw) > MAX_TOKEN_BYTES:
        raise ValueError("token too large")
    return raw


def to_text(raw: bytes) -> str:
    return TEXT_PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")


def from_text(text: str) -> bytes:
    """The wire bytes of a `bagel-token1:...` string; ValueError if it is not one."""
    text = text.strip()
    if not text.startswith(TEXT_PREFIX):
        raise ValueError(f"a join token starts with {TEXT_PREFIX!r}")
    body = text[len(TEXT_PREFIX) :]
    if len(body) > 2 * MAX_TOKEN_BYTES:
        raise ValueError("join token too long")
    try:
        raw = base64.b64decode(body + "=" * (-len(body) % 4), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("join token is not valid base64") from None
    if not raw:
        raise ValueError("join token is empty")
    return raw


def verify_token(raw: bytes, operator_public_key: bytes, run_id: str, now_ms: int) -> TokenClaims:
    """What the token's bytes prove: signed by the operator, for `run_id`, not expired.

    Raises the matching JoinTokenError; the store then checks uses, binding, revocation.
    Checks run cheapest-first, signature before anything in the claims is believed.
    """
    if not raw:
        raise TokenMissing("this run is permissioned: register with a join token from its operator")
    if len(raw) > MAX_TOKEN_BYTES:
        raise TokenMalformed(f"join token over {MAX_TOKEN_BYTES} bytes")
    token = pb.JoinToken()
    try:
        token.ParseFromString(raw)
    except DecodeError:
        raise TokenMalformed("join token does not parse") from None
    if len(token.signature) != SIGNATURE_BYTES or not token.claims:
        raise TokenMalformed("join token has no claims or a bad signature length")
    if not verify_signature(operator_public_key, token.signature, token.claims):
        raise TokenForged("join token is not signed by this run's operator")
    claims = pb.JoinTokenClaims()
    try:
        claims.ParseFromString(token.claims)
    except DecodeError:
        raise TokenMalformed("join token claims do not parse") from None
    if len(claims.token_id) != TOKEN_ID_BYTES or not 1 <= claims.uses <= MAX_USES:
        raise TokenMalformed("join token claims are out of range")
    if claims.run_id != run_id:
        raise TokenWrongRun(f"join token is for run {claims.run_id[:80]!r}, this is run {run_id!r}")
    if now_ms >= claims.expires_unix_ms:
        raise TokenExpired(f"join token {claims.name[:64]!r} expired")
    return TokenClaims(
        run_id=claims.run_id,
        token_id=claims.token_id.hex(),
        name=claims.name,
        issued_unix_ms=claims.issued_unix_ms,
        expires_unix_ms=claims.expires_unix_ms,
        uses=claims.uses,
    )
