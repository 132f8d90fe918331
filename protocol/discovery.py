"""Finding the coordinator through the hivemind DHT, authenticated by the join string's key.

The coordinator publishes its gRPC endpoint and run-spec hash as a DHT
record signed with its Ed25519 key; a worker resolves it from the join string alone.

Record layout. Key `bagel/<run_id>/coordinator`; subkey the hex of the publisher's public
key; value `{"body": bytes, "sig": bytes}` where `body` is a msgpack map with a fixed field
order (`kind`, `v`, `run_id`, `endpoint`, `spec_hash`, `public_key`, `issued_at`,
`expires_at`, `tls_sha256`) and `sig` is Ed25519 over exactly `body`. `tls_sha256` is the
fingerprint of the certificate the coordinator's gRPC port serves (`bagel.protocol.tls`),
or "" for a plaintext coordinator; the worker pins it. The resolver verifies the received
body bytes (never a re-encoding), then decodes them. `kind` is a domain separator, so no
other signature made with the coordinator key can pass as a record.

Why subkeys. hivemind keeps, per key, only the value with the latest expiration; an
attacker who stores a forged record under the same key with a later expiration would
hide the real one. With one subkey per publisher both survive, and the resolver checks
every entry, skips the ones that fail (another signer, bad signature, wrong run,
expired), and uses the freshest valid one. An attacker can still overwrite the subkey of
the coordinator's own key (with a later expiration) on nodes that do not check records;
that is a denial of service, never a forgery: nothing passes without the coordinator's
signature. `CoordinatorRecordValidator`, installed on honest DHT nodes (the coordinator's
own and every worker's), closes that gap: those nodes neither store such an entry nor
accept a peer's answer that carries one, and they refuse any entry, genuine or not, whose
DHT expiration lies more than `MAX_EXPIRATION_AHEAD_S` ahead, so nothing planted there can
outlive two record lifetimes.

Availability. hivemind validates a peer's answer as a whole: one bad entry in a
dictionary value makes the requesting node drop the entire dictionary (`DHTProtocol.
call_find` -> `_validate_dictionary`), the genuine entry with it. A node without the
validator (a public bootstrap node, an old node) may hold a forgery next to the genuine
record, and a validating worker that asks it sees nothing. So the resolver first asks the
join string's peers itself (`lookup_direct`): one raw `rpc_find` per peer, run inside the
worker's DHT process, that hands back every entry unvalidated; each is then verified here
on its own, and a bad one is skipped without hiding the good one. Only when that finds no
valid record does it fall back to hivemind's iterative lookup over the whole DHT.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import multiprocessing
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from bagel.protocol.identity import Identity, verify_signature
from bagel.protocol.joinstring import JoinInfo, parse_join_string
from bagel.protocol.shutdown import prepare_child

logger = logging.getLogger(__name__)

RECORD_KIND = "bagel/coordinator"
RECORD_VERSION = 2
DEFAULT_TTL_S = 60.0
# Validating nodes store and accept an entry under the coordinator key only if its DHT
# expiration is at most this far ahead of their clock: two record lifetimes (the
# publisher refreshes every third of one), which also absorbs the clock skew allowed.
MAX_EXPIRATION_AHEAD_S = 2 * DEFAULT_TTL_S
# A signed record may claim no longer a validity either, so a captured genuine record
# (an old endpoint) cannot be replayed for long.
MAX_TTL_S = MAX_EXPIRATION_AHEAD_S
MAX_RECORD_BYTES = 4096
MAX_DIRECT_ENTRIES = 32  # entries examined per peer in `lookup_direct` (each costs a signature check)
DIRECT_LOOKUP_TIMEOUT_S = 5.0
NEAREST_K = 5  # nodes nearest the record's key read entry by entry (hivemind's default num_replicas)
_MAX_DIRECT_ANSWER_BYTES = 4 * MAX_RECORD_BYTES * MAX_DIRECT_ENTRIES
DEFAULT_MAX_CLOCK_SKEW_S = 30.0
DHT_START_TIMEOUT_S = 60.0
_ENDPOINT_RE = re.compile(r"[\x21-\x7e]{1,256}")
_HASH_RE = re.compile(r"[0-9a-f]{64}")
_PEER_ID_RE = re.compile(r"/p2p/([1-9A-HJ-NP-Za-km-z]{32,128})$")


class DiscoveryError(Exception):
    """Base class of discovery failures."""


class RecordError(DiscoveryError):
    """A DHT record is malformed, signed by another key, for another run, or expired."""


class BootstrapUnreachable(DiscoveryError):
    """The DHT node could reach none of its bootstrap peers (the coordinator is down or unreachable)."""


class DhtStartTimeout(DiscoveryError):
    """The DHT node or its p2p daemon did not come up in time: a loaded or slow machine, not a
    wrong setting, so a volunteer waits and tries again (a bad address or a taken port stays
    a plain DiscoveryError)."""


class CoordinatorNotFound(DiscoveryError):
    """No valid coordinator record was found before the timeout (the message says what was seen)."""


class RelayLimitError(DiscoveryError):
    """A relay node's circuit relay answered a reservation with limits other than ours (the
    daemon's default-limit relay service serves: `bagel.protocol.relay`, "two relay services")."""


def coordinator_key(run_id: str) -> str:
    """DHT key of the coordinator record of `run_id`."""
    return f"bagel/{run_id}/coordinator"


@dataclass(frozen=True)
class CoordinatorRecord:
    endpoint: str  # gRPC target, "host:port"
    run_id: str
    spec_hash: str  # hex sha256 of the run spec source
    public_key: bytes  # raw Ed25519 key of the coordinator
    issued_at: float  # DHT time (Unix seconds)
    expires_at: float
    tls_sha256: str = ""  # sha256 (hex) of the gRPC port's TLS certificate; "" = plaintext

    def body(self) -> bytes:
        """Canonical msgpack encoding of the fields (fixed order, bin type for bytes)."""
        return msgpack.packb(
            {
                "kind": RECORD_KIND,
                "v": RECORD_VERSION,
                "run_id": self.run_id,
                "endpoint": self.endpoint,
                "spec_hash": self.spec_hash,
                "public_key": self.public_key,
                "issued_at": float(self.issued_at),
                "expires_at": float(self.expires_at),
                "tls_sha256": self.tls_sha256,
            },
            use_bin_type=True,
        )


def sign_record(record: CoordinatorRecord, identity: Identity) -> dict[str, bytes]:
    """The DHT value for `record`: {"body": canonical msgpack, "sig": Ed25519 over body}."""
    if record.public_key != identity.public_key:
        raise ValueError("record.public_key must be the signing identity's key")
    body = record.body()
    return {"body": body, "sig": identity.sign(body)}


def _verify_signed(value: Any, *, public_key: bytes, run_id: str) -> CoordinatorRecord:
    """Signature, schema and run checks of a DHT value (no clock involved)."""
    if not isinstance(value, dict) or set(value) != {"body", "sig"}:
        raise RecordError("value is not a {body, sig} map")
    body, sig = value["body"], value["sig"]
    if not isinstance(body, bytes) or not isinstance(sig, bytes):
        raise RecordError("body and sig must be bytes")
    if len(body) > MAX_RECORD_BYTES:
        raise RecordError(f"body larger than {MAX_RECORD_BYTES} bytes")
    if not verify_signature(public_key, sig, body):
        raise RecordError("signature does not verify with the join string's coordinator key")
    try:
        fields = msgpack.unpackb(body, raw=False, strict_map_key=True)  # size checked above
    except Exception as e:  # msgpack raises several types on garbage
        raise RecordError(f"body is not msgpack: {e}") from None
    expected = {"kind", "v", "run_id", "endpoint", "spec_hash", "public_key", "issued_at", "expires_at", "tls_sha256"}
    if not isinstance(fields, dict) or set(fields) != expected:
        raise RecordError("body does not have the record fields")
    if fields["kind"] != RECORD_KIND or fields["v"] != RECORD_VERSION:
        raise RecordError(f"not a v{RECORD_VERSION} coordinator record")
    if fields["public_key"] != public_key:
        raise RecordError("record names another public key than its signer")
    if fields["run_id"] != run_id:
        raise RecordError(f"record is for run {str(fields['run_id'])[:80]!r}, not {run_id!r}")
    endpoint, spec_hash = fields["endpoint"], fields["spec_hash"]
    if not isinstance(endpoint, str) or not _ENDPOINT_RE.fullmatch(endpoint):
        raise RecordError("endpoint is not a host:port target")
    if not isinstance(spec_hash, str) or not _HASH_RE.fullmatch(spec_hash):
        raise RecordError("spec_hash is not a hex sha256")
    tls_sha256 = fields["tls_sha256"]
    if not isinstance(tls_sha256, str) or (tls_sha256 and not _HASH_RE.fullmatch(tls_sha256)):
        raise RecordError("tls_sha256 is neither empty nor a hex sha256")
    issued, expires = fields["issued_at"], fields["expires_at"]
    if not isinstance(issued, float) or not isinstance(expires, float):
        raise RecordError("issued_at/expires_at must be floats")
    if not issued <= expires <= issued + MAX_TTL_S:
        raise RecordError(f"validity interval is empty or longer than {MAX_TTL_S:g} s")
    return CoordinatorRecord(endpoint, run_id, spec_hash, public_key, issued, expires, tls_sha256)


def verify_record(
    value: Any,
    *,
    public_key: bytes,
    run_id: str,
    now: float,
    max_clock_skew_s: float = DEFAULT_MAX_CLOCK_SKEW_S,
) -> CoordinatorRecord:
    """Check a DHT value against the join string's key and run, at time `now` (Unix s).

    RecordError says why it is refused: not a {body, sig} map, signature not by
    `public_key` (a forgery), malformed body, another run, issued in the future beyond
    the skew, or expired.
    """
    record = _verify_signed(value, public_key=public_key, run_id=run_id)
    if record.issued_at > now + max_clock_skew_s:
        raise RecordError("record is issued in the future (clock skew?)")
    if record.expires_at < now:
        raise RecordError("record has expired")
    return record


class CoordinatorRecordValidator(RecordValidatorBase):
    """hivemind record validator: under the run's coordinator key, only the real record.

    Install it on every honest DHT node of the run (the coordinator's and each worker's:
    `hivemind.DHT(..., record_validators=[CoordinatorRecordValidator(run_id, key)])`).
    Such a node then refuses to store a forged entry, and drops a peer's answer that
    contains one, so an attacker cannot hide the real record by storing a forgery under
    the coordinator's own subkey with a later expiration. It also refuses a genuine record
    whose DHT expiration outlives its signed `expires_at` (a replayed record pinned far
    into the future would block later re-publications), and any entry whose DHT
    expiration lies more than `MAX_EXPIRATION_AHEAD_S` past this node's clock (a forgery
    planted to live for a day). Records under other keys pass. The resolver verifies
    records itself as well; this only closes the denial of service.
    """

    def __init__(self, run_id: str, public_key: bytes) -> None:
        self.run_id = run_id
        self.public_key = bytes(public_key)
        self._key_id = DHTID.generate(source=coordinator_key(run_id)).to_bytes()
        self._subkey = MSGPackSerializer.dumps(self.public_key.hex())

    def validate(self, record: DHTRecord) -> bool:
        if record.key != self._key_id:
            return True
        if record.subkey != self._subkey:
            return False
        if record.expiration_time > get_dht_time() + MAX_EXPIRATION_AHEAD_S:
            return False
        try:
            value = MSGPackSerializer.loads(record.value)
            signed = _verify_signed(value, public_key=self.public_key, run_id=self.run_id)
        except Exception:
            return False
        return record.expiration_time <= signed.expires_at + 1.0


# ---------------------------------------------------------------------------- DHT nodes


@functools.cache
def _child_safe_dht_class() -> type:
    """`hivemind.DHT` whose forked child first runs `shutdown.prepare_child` (SIGTERM kills
    it, SIGINT is ignored, it exits when its parent dies): see `bagel.protocol.shutdown`."""
    import hivemind

    class ChildSafeDHT(hivemind.DHT):
        p2pd_env: dict[str, str] = {}  # noqa: RUF012  (replaced per instance, never mutated)

        def run(self) -> None:
            prepare_child()
            # the child's environment is the one its p2p daemon inherits (`P2P.create` copies it)
            os.environ.update(self.p2pd_env)
            super().run()

    return ChildSafeDHT


def start_dht(
    *, timeout_s: float = DHT_START_TIMEOUT_S, p2pd_env: Mapping[str, str] | None = None, **kwargs: Any
) -> Any:
    """Start a `hivemind.DHT(**kwargs)` node and wait at most `timeout_s` for it.

    The node is a child process with a p2p daemon of its own. When the process that
    started it dies without stopping it (SIGKILL to the pid alone, an OOM kill), the child
    notices within `shutdown.PARENT_POLL_S`, ends its p2p daemon and exits: left alive,
    the pair would keep the DHT port and the peer id, so a restart on the same data dir and
    port would be refused. The child also closes the descriptors `shutdown.close_in_children`
    names (the data dir locks), which the fork would otherwise hand it.

    `hivemind.DHT(start=True)` waits for its child without a bound, so a child that never
    comes up (its p2p daemon failing to start, a fork that deadlocks on a lock some other
    thread held) would block the caller forever, and with it any executor joining the
    thread it ran in. Here the child is terminated and DiscoveryError raised instead.
    `p2pd_env` is added to the environment of the child, and so of its p2p daemon, alone.
    Blocking: call it through `asyncio.to_thread` from a coroutine.
    """
    _free_update_lock()
    dht = _child_safe_dht_class()(start=False, **kwargs)
    dht.p2pd_env = dict(p2pd_env or {})
    # The node is a forked child. Objects it inherits from us (gRPC channels and servers
    # among them) must never be collected there: their finalizers call into gRPC's core,
    # which does not survive a fork, and a child crashing in a collection was seen under
    # load. So freeze the heap across the fork, as CPython's gc.freeze() docs advise for
    # fork, and give our objects back to the collector after it (unless someone had frozen
    # before: gc.unfreeze would undo theirs too).
    frozen_before = gc.get_freeze_count() > 0
    gc.freeze()
    try:
        dht.run_in_background(await_ready=True, timeout=timeout_s)
    except BaseException as e:
        if dht.is_alive():
            if isinstance(e, Exception) and not isinstance(e, TimeoutError):
                # the child sent its error and exits by itself: let it, or it may be killed
                # still holding the update lock it sent under (`_free_update_lock`); a child
                # that did not answer, or a caller interrupted, is not waited for
                dht.join(FAILED_CHILD_EXIT_S)
            if dht.is_alive():
                dht.terminate()
                dht.join(5)
        if isinstance(e, Exception) and "failed to connect to bootstrap peers" in str(e):
            peers = ", ".join(kwargs.get("initial_peers") or []) or "none"
            raise BootstrapUnreachable(f"none of the DHT bootstrap peers answered ({peers})") from e
        if isinstance(e, TimeoutError) or _is_daemon_start_timeout(e):
            waited = f"no answer in {timeout_s:g}s" if isinstance(e, TimeoutError) else _last_line(e)
            raise DhtStartTimeout(f"the DHT node did not start in time ({waited})") from e
        if isinstance(e, Exception) and not isinstance(e, DiscoveryError):
            raise DiscoveryError(f"the DHT node did not start: {e!r}") from e
        raise
    finally:
        if not frozen_before:
            gc.unfreeze()
    return dht


FAILED_CHILD_EXIT_S = 5.0
"""How long a DHT child that failed to start is given to exit by itself before it is terminated."""

STALE_LOCK_S = 2.0
"""A hivemind MPFuture update lock held this long when no DHT child of ours should be sending
is taken to be held by a dead process (`_free_update_lock`)."""


def _free_update_lock() -> None:
    """Make sure hivemind's MPFuture update lock can be taken before a DHT child is forked.

    A DHT child reports its start (ready, or the error it failed with) to this process through
    an MPFuture, writing under `MPFuture._update_lock`: one multiprocessing semaphore that every
    child forked from here shares. A child that dies while holding it (terminated just after
    its error arrived, but before it released the lock, or killed by the OOM killer) never
    releases it, and every later child blocks on it: each later DHT start of this process
    ends on `DHT_START_TIMEOUT_S` (seen: eight workers waiting for a coordinator that was down,
    on a 2-core host, hung for the whole timeout on 5 of 78 tries). `start_dht` lets a failed
    child exit by itself, which closes the common way in; this repairs any other: a lock not
    free within `STALE_LOCK_S` is replaced by a new one, which the next child inherits. A live
    holder only ever holds it for one pipe write."""
    from hivemind.utils.mpfuture import MPFuture

    lock = MPFuture._update_lock
    if lock.acquire(timeout=STALE_LOCK_S):
        lock.release()
        return
    logger.warning("hivemind's MPFuture update lock is held by a process that is gone: replacing it")
    MPFuture._update_lock = multiprocessing.Lock()


def _is_daemon_start_timeout(e: BaseException) -> bool:
    """hivemind's P2P gives its daemon `startup_timeout` (15 s) and then raises P2PDaemonError
    "Daemon failed to start in 15.0 seconds"; the DHT child passes that on as its start's error."""
    return type(e).__name__ == "P2PDaemonError" and "failed to start in" in str(e)


def _last_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[-1][:200] if lines else type(e).__name__


RELAY_START_ATTEMPTS = 3  # with RELAY_P2PD_ENV ours lost 1 of 60 starts measured on a loaded 2-core host


def start_relay_dht(*, attempts: int = RELAY_START_ATTEMPTS, **kwargs: Any) -> Any:
    """`start_dht` for a node that serves as a circuit relay (`RelayPlan(serve=True)`), with its
    p2p daemon in `RELAY_P2PD_ENV`, checked: its relay must answer a reservation with our limits.

    The p2p daemon runs two relay services, one with go-libp2p's default limits; which one
    serves is decided at the daemon's start, by the Go scheduler (`bagel.protocol.relay`, "two
    relay services"). With the defaults every relayed connection is reset after 128 KiB, so no
    exchange between NAT'd workers could complete. A start that answers with other limits is
    stopped and started again (same key and port), with a warning; after `attempts` such
    starts RelayLimitError is raised, a startup error rather than a run that fails later. A
    relay that cannot be asked (the probe itself fails) is kept as it is, with a warning.
    Blocking, like `start_dht`."""
    from bagel.protocol.relay import RELAY_P2PD_ENV, probe_relay_limit

    for attempt in range(1, attempts + 1):
        try:
            dht = start_dht(p2pd_env=RELAY_P2PD_ENV, **kwargs)
        except DiscoveryError:
            if attempt == 1:
                raise  # as start_dht would: this node does not start at all
            time.sleep(1.0)  # the node just stopped may still hold its port
            dht = start_dht(p2pd_env=RELAY_P2PD_ENV, **kwargs)
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
        peer_id = dht.peer_id.to_base58()
        # the listen address as seen from this host too (an announced address may not hairpin)
        local = [re.sub(r"^/ip4/[^/]+/", "/ip4/127.0.0.1/", m) for m in maddrs if m.startswith("/ip4/")]
        candidates = [m if "/p2p/" in m else f"{m}/p2p/{peer_id}" for m in dict.fromkeys(maddrs + local)]
        try:
            limit = asyncio.run(probe_relay_limit(peer_id, candidates))
        except Exception as e:  # noqa: BLE001  (a relay we cannot ask may still serve; say so and keep it)
            logger.warning("could not ask this node's circuit relay for its limits (%s); keeping it unchecked", e)
            return dht
        if limit.is_ours():
            logger.info(
                "circuit relay serving with its configured limits (%d bytes, %d s per relayed connection), start %d",
                limit.data_bytes,
                limit.duration_s,
                attempt,
            )
            return dht
        dht.shutdown()
        if attempt == attempts:
            raise RelayLimitError(
                f"this node's circuit relay answered with limits of {limit.data_bytes} bytes and "
                f"{limit.duration_s} s per relayed connection (status {limit.status}) in {attempts} starts, "
                "not its configured ones; relayed exchanges would break after them"
            )
        logger.warning(
            "circuit relay started with limits of %d bytes per relayed connection, not its configured ones: "
            "starting it again (%d of %d)",
            limit.data_bytes,
            attempt + 1,
            attempts,
        )
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------- publishing


async def publish_coordinator(
    dht: Any,
    identity: Identity,
    *,
    run_id: str,
    endpoint: str,
    spec_hash: str,
    ttl_s: float = DEFAULT_TTL_S,
    now: float | None = None,
    tls_sha256: str = "",
) -> CoordinatorRecord:
    """Sign and store the coordinator record once; DiscoveryError if no node stored it."""
    if not 0 < ttl_s <= MAX_EXPIRATION_AHEAD_S - DEFAULT_MAX_CLOCK_SKEW_S:
        raise ValueError(f"ttl_s must be in (0, {MAX_EXPIRATION_AHEAD_S - DEFAULT_MAX_CLOCK_SKEW_S:g}]")
    issued = get_dht_time() if now is None else now
    record = CoordinatorRecord(
        endpoint, run_id, spec_hash, identity.public_key, float(issued), float(issued + ttl_s), tls_sha256
    )
    ok = await dht.store(
        coordinator_key(run_id),
        sign_record(record, identity),
        expiration_time=record.expires_at,
        subkey=identity.public_key.hex(),
        return_future=True,
    )
    if not ok:
        raise DiscoveryError("the DHT did not store the coordinator record")
    return record


class CoordinatorPublisher:
    """Re-publishes the coordinator record every `ttl_s / 3`, so it never lapses.

    `await start()` publishes once (raising if that fails, so the daemon does not print a
    join string nobody can resolve) and then refreshes in a background task; a failed
    refresh is logged and retried after a short pause. `await stop()` cancels it.
    """

    def __init__(
        self,
        dht: Any,
        identity: Identity,
        *,
        run_id: str,
        endpoint: str,
        spec_hash: str,
        ttl_s: float = DEFAULT_TTL_S,
        tls_sha256: str = "",
    ) -> None:
        self._args = dict(run_id=run_id, endpoint=endpoint, spec_hash=spec_hash, ttl_s=ttl_s, tls_sha256=tls_sha256)
        self._dht, self._identity, self.ttl_s = dht, identity, ttl_s
        self._task: asyncio.Task[None] | None = None
        self.record: CoordinatorRecord | None = None
        self.publishes = 0

    async def publish_now(self) -> CoordinatorRecord:
        self.record = await publish_coordinator(self._dht, self._identity, **self._args)  # type: ignore[arg-type]
        self.publishes += 1
        return self.record

    async def start(self) -> CoordinatorRecord:
        record = await self.publish_now()
        self._task = asyncio.create_task(self._loop(), name="bagel-coordinator-publisher")
        return record

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                await self.publish_now()
            except Exception as e:  # keep refreshing: the DHT may be briefly unreachable
                logger.warning("re-publishing the coordinator record failed: %s", e)
                await asyncio.sleep(min(5.0, self.ttl_s / 10))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def __aenter__(self) -> CoordinatorPublisher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


# ---------------------------------------------------------------------------- resolving


def _pick(
    entries: list[tuple[str, Any]], join: JoinInfo, now: float, max_clock_skew_s: float
) -> tuple[CoordinatorRecord | None, list[str]]:
    """The freshest entry that verifies against `join` (and its TLS pin), and why the others did not."""
    best: CoordinatorRecord | None = None
    refused: list[str] = []
    for label, value in entries:
        try:
            record = verify_record(
                value,
                public_key=join.coordinator_public_key,
                run_id=join.run_id,
                now=now,
                max_clock_skew_s=max_clock_skew_s,
            )
            if join.tls_fingerprint and record.tls_sha256 != join.tls_fingerprint:
                raise RecordError(
                    f"record names TLS certificate {record.tls_sha256[:16] or '(plaintext)'}, "
                    f"the join string pins {join.tls_fingerprint[:16]}"
                )
        except RecordError as e:
            refused.append(f"{label[:40]}: {e}")
            continue
        if best is None or record.issued_at > best.issued_at:
            best = record
    return best, refused


def peer_ids_of(join: JoinInfo) -> list[str]:
    """The base58 peer ids named by the join string's multiaddrs, in order, without repeats."""
    ids: list[str] = []
    for maddr in join.initial_peers:
        m = _PEER_ID_RE.search(maddr)
        if m and m.group(1) not in ids:
            ids.append(m.group(1))
    return ids


async def _find_raw(
    key: str, peer_ids: list[str], nearest_k: int, timeout_s: float, _dht: Any, node: Any
) -> list[tuple[str, bytes, bytes]]:
    """Runs inside a DHT process (`DHT.run_coroutine`): ask each of `peer_ids` and, with
    `nearest_k`, the `nearest_k` nodes nearest to `key` (found by hivemind's beam search,
    which learns neighbours even from answers it drops), for `key` with one raw `rpc_find`
    each; return (peer, subkey bytes, value bytes) for every entry, unvalidated.

    hivemind's `call_find` would validate each answer as a whole and drop it on one bad
    entry; here nothing is dropped, the caller verifies each entry. Bounded: at most
    `MAX_DIRECT_ENTRIES` entries per peer, answers of at most `_MAX_DIRECT_ANSWER_BYTES`.
    """
    from hivemind.dht.storage import DictionaryDHTValue
    from hivemind.p2p import PeerID
    from hivemind.proto import dht_pb2

    key_id = DHTID.generate(source=key)
    peers = list(peer_ids)
    if nearest_k > 0:
        nearest = await node.find_nearest_nodes([key_id], k_nearest=nearest_k)
        for peer_id in list(nearest.get(key_id, {}).values())[:nearest_k]:
            if peer_id.to_base58() not in peers:
                peers.append(peer_id.to_base58())

    async def ask(peer_b58: str) -> list[tuple[str, bytes, bytes]]:
        peer = PeerID.from_base58(peer_b58)
        out: list[tuple[str, bytes, bytes]] = []
        if peer == node.peer_id:  # our own node is one of them: read its storage
            local = node.protocol.storage.get(key_id)
            items = None if local is None else local.value
            regular = None if isinstance(items, DictionaryDHTValue) else items
        else:
            request = dht_pb2.FindRequest(keys=[key_id.to_bytes()], peer=node.protocol.node_info)
            response = await node.protocol.get_stub(peer).rpc_find(request, timeout=timeout_s)
            items = regular = None
            for result in list(response.results)[:1]:
                if result.type == dht_pb2.FOUND_REGULAR:
                    regular = result.value
                elif result.type == dht_pb2.FOUND_DICTIONARY and len(result.value) <= _MAX_DIRECT_ANSWER_BYTES:
                    items = MSGPackSerializer.loads(result.value)
        if isinstance(regular, bytes):
            out.append((peer_b58, b"", bytes(regular)))
        if isinstance(items, DictionaryDHTValue):
            for subkey, item in list(items.items())[:MAX_DIRECT_ENTRIES]:
                out.append((peer_b58, MSGPackSerializer.dumps(subkey), bytes(item.value)))
        return out

    answers = await asyncio.gather(*(ask(p) for p in peers), return_exceptions=True)
    return [entry for answer in answers if isinstance(answer, list) for entry in answer]


async def lookup_direct(
    dht: Any,
    join: JoinInfo,
    *,
    nearest_k: int = 0,
    now: float | None = None,
    max_clock_skew_s: float = DEFAULT_MAX_CLOCK_SKEW_S,
    timeout_s: float = DIRECT_LOOKUP_TIMEOUT_S,
) -> tuple[CoordinatorRecord | None, list[str]]:
    """Ask the join string's peers themselves (and, with `nearest_k`, the nodes nearest the
    record's key), verifying every entry on its own (module docstring)."""
    peers = peer_ids_of(join)
    if not peers and not nearest_k:
        return None, []
    coro = functools.partial(_find_raw, coordinator_key(join.run_id), peers, nearest_k, timeout_s)
    raw = await dht.run_coroutine(coro, return_future=True)
    entries: list[tuple[str, Any]] = []
    for peer, subkey, value in raw[: MAX_DIRECT_ENTRIES * (len(peers) + nearest_k)]:
        try:
            label = f"{peer[-8:]}/{str(MSGPackSerializer.loads(subkey))[:16] if subkey else '-'}"
        except Exception:  # msgpack raises several types on garbage
            label = f"{peer[-8:]}/?"
        if len(value) > 2 * MAX_RECORD_BYTES:
            entries.append((label, None))
            continue
        try:
            entries.append((label, MSGPackSerializer.loads(value)))
        except Exception:  # msgpack raises several types on garbage
            entries.append((label, None))
    return _pick(entries, join, time.time() if now is None else now, max_clock_skew_s)


async def lookup_coordinator(
    dht: Any,
    join: JoinInfo,
    *,
    now: float | None = None,
    max_clock_skew_s: float = DEFAULT_MAX_CLOCK_SKEW_S,
    direct: bool = True,
) -> tuple[CoordinatorRecord | None, list[str]]:
    """One lookup: (freshest valid record or None, reasons the other entries were refused).

    With `direct` (the default) our own entry-by-entry reads come first: the join
    string's peers (`lookup_direct`), then the `NEAREST_K` nodes nearest the record's key.
    hivemind's iterative lookup (`DHT.get`, which drops a node's whole answer on one bad
    entry) runs last, only if neither found a valid record; `direct=False` runs it alone.
    """
    refused: list[str] = []
    if direct:
        for nearest_k in (0, NEAREST_K):
            try:
                record, refused_now = await lookup_direct(
                    dht, join, nearest_k=nearest_k, now=now, max_clock_skew_s=max_clock_skew_s
                )
            except Exception as e:  # the peers may be gone (a restarted coordinator): go wider
                logger.debug("reading the coordinator record entry by entry failed: %s", e)
                record, refused_now = None, []
            refused += [r for r in refused_now if r not in refused]
            if record is not None:
                return record, refused
    found = await dht.get(coordinator_key(join.run_id), latest=True, return_future=True)
    if found is None:
        return None, refused
    entries = found.value
    if not isinstance(entries, dict):  # stored without a subkey: not ours, maybe an attacker's
        return None, [*refused, "value stored without a publisher subkey"]
    record, wide = _pick(
        [(str(subkey), getattr(item, "value", None)) for subkey, item in entries.items()],
        join,
        time.time() if now is None else now,
        max_clock_skew_s,
    )
    return record, [*refused, *[r for r in wide if r not in refused]]


async def resolve_coordinator(
    join: JoinInfo | str,
    *,
    dht: Any = None,
    timeout_s: float = 30.0,
    retry_interval_s: float = 0.5,
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",),
    max_clock_skew_s: float = DEFAULT_MAX_CLOCK_SKEW_S,
) -> CoordinatorRecord:
    """Resolve the coordinator from the join string alone.

    Uses `dht` (an existing `hivemind.DHT`, e.g. the worker's, ideally created with a
    `CoordinatorRecordValidator`) or starts a temporary one
    on `host_maddrs` bootstrapped from the join string's initial peers (and shuts it down
    again). Retries the lookup until a record signed by the join string's key, for its
    run, unexpired, is found; forged entries are skipped. CoordinatorNotFound on timeout.
    """
    info = parse_join_string(join) if isinstance(join, str) else join
    own = None
    if dht is None:
        own = await asyncio.to_thread(
            start_dht,
            timeout_s=max(timeout_s, DHT_START_TIMEOUT_S),
            initial_peers=list(info.initial_peers),
            host_maddrs=list(host_maddrs),
            record_validators=[CoordinatorRecordValidator(info.run_id, info.coordinator_public_key)],
        )
        dht = own
    try:
        deadline = time.monotonic() + timeout_s
        refused: list[str] = []
        while True:
            left = max(1.0, deadline - time.monotonic())
            try:  # a DHT child that died never answers; bound every lookup by the deadline
                record, refused_now = await asyncio.wait_for(
                    lookup_coordinator(dht, info, max_clock_skew_s=max_clock_skew_s), left
                )
            except TimeoutError:
                record, refused_now = None, []
            if record is not None:
                if refused_now:
                    logger.warning("skipped %d invalid coordinator records: %s", len(refused_now), refused_now)
                return record
            refused = refused_now or refused
            if time.monotonic() >= deadline:
                detail = f"; refused: {'; '.join(refused)}" if refused else "; no record found"
                raise CoordinatorNotFound(f"no valid coordinator record for run {info.run_id!r}{detail}")
            await asyncio.sleep(retry_interval_s)
    finally:
        if own is not None:
            await asyncio.to_thread(own.shutdown)
