"""Join strings, signed coordinator records, and resolution through a real hivemind DHT."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest
from hivemind.utils import get_dht_time

from bagel.protocol.discovery import (
    DEFAULT_MAX_CLOCK_SKEW_S,
    DEFAULT_TTL_S,
    MAX_EXPIRATION_AHEAD_S,
    MAX_TTL_S,
    BootstrapUnreachable,
    CoordinatorNotFound,
    CoordinatorPublisher,
    CoordinatorRecord,
    CoordinatorRecordValidator,
    DhtStartTimeout,
    DiscoveryError,
    RecordError,
    _is_daemon_start_timeout,
    coordinator_key,
    lookup_coordinator,
    lookup_direct,
    publish_coordinator,
    resolve_coordinator,
    sign_record,
    start_dht,
    verify_record,
)
from bagel.protocol.identity import Identity
from bagel.protocol.joinstring import JoinInfo, JoinStringError, make_join_string, parse_join_string

RUN = "digits-2x2"
SPEC_HASH = "ab" * 32
PEER = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"

# ---------------------------------------------------------------------------- join string


def test_join_string_round_trip():
    key = Identity.generate().public_key
    text = make_join_string(RUN, key, [PEER, PEER.replace("4001", "4002")])
    assert text.startswith("bagel1:") and " " not in text
    info = parse_join_string("  " + text + "\n")
    assert info == JoinInfo(RUN, key, (PEER, PEER.replace("4001", "4002")))
    assert str(info) == text


def test_join_string_carries_the_tls_fingerprint():
    key, fp = Identity.generate().public_key, "0f" * 32
    text = make_join_string(RUN, key, [PEER], fp)
    info = parse_join_string(text)
    assert info == JoinInfo(RUN, key, (PEER,), fp) and info.tls_fingerprint == fp
    assert parse_join_string(make_join_string(RUN, key, [PEER])).tls_fingerprint == ""  # plaintext: no `t`
    with pytest.raises(JoinStringError, match="TLS fingerprint"):
        make_join_string(RUN, key, [PEER], "0F" * 32)  # only the canonical lowercase hex


def _encode(body: object) -> str:
    raw = json.dumps(body).encode()
    return "bagel1:" + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


GOOD_BODY = {"v": 1, "r": RUN, "k": base64.urlsafe_b64encode(b"k" * 32).rstrip(b"=").decode(), "p": [PEER]}


@pytest.mark.parametrize(
    "text,match",
    [
        ("", "must start with"),
        ("bagel2:abc", "a newer Bagel"),
        ("bagel1:", "not JSON"),
        ("bagel1:!!!", "not base64url"),
        ("bagel1:" + "A" * 5000, "too long"),
        (_encode([1, 2]), "JSON object"),
        (_encode({**GOOD_BODY, "v": 2}), "version"),
        (_encode({**GOOD_BODY, "x": 1}), "unknown fields"),
        (_encode({k: v for k, v in GOOD_BODY.items() if k != "p"}), "missing fields"),
        (_encode({**GOOD_BODY, "r": "Bad Run"}), "run id"),
        (_encode({**GOOD_BODY, "k": "AAAA"}), "32 bytes"),
        (_encode({**GOOD_BODY, "k": 5}), "base64url"),
        (_encode({**GOOD_BODY, "p": []}), "at least one"),
        (_encode({**GOOD_BODY, "p": PEER}), "must be a list"),
        (_encode({**GOOD_BODY, "p": ["/ip4/127.0.0.1/tcp/4001"]}), "/p2p/"),
        (_encode({**GOOD_BODY, "p": [7]}), "initial peer 0"),
        (_encode({**GOOD_BODY, "p": [PEER] * 17}), "at most"),
        (_encode({**GOOD_BODY, "t": "AAAA"}), "TLS fingerprint"),
        (_encode({**GOOD_BODY, "t": 5}), "TLS fingerprint: must be base64url"),
        (_encode({**GOOD_BODY, "t": "!" * 43}), "TLS fingerprint: not base64url"),
        # 43 characters whose last one carries bits beyond the 32 bytes: not canonical
        (_encode({**GOOD_BODY, "t": "A" * 42 + "B"}), "canonical"),
        (_encode({**GOOD_BODY, "t": "", "x": 1}), "unknown fields"),
    ],
)
def test_malformed_join_strings_rejected(text, match):
    with pytest.raises(JoinStringError, match=match):
        parse_join_string(text)


def test_truncated_join_string_rejected():
    text = make_join_string(RUN, b"k" * 32, [PEER])
    for cut in (len(text) - 1, len(text) - 7, 12):
        with pytest.raises(JoinStringError):
            parse_join_string(text[:cut])


# ---------------------------------------------------------------------------- records (no DHT)


def _record(ident: Identity, now: float, **kw) -> CoordinatorRecord:
    fields = dict(
        endpoint="127.0.0.1:7000",
        run_id=RUN,
        spec_hash=SPEC_HASH,
        public_key=ident.public_key,
        issued_at=now,
        expires_at=now + 60.0,
    )
    fields.update(kw)
    return CoordinatorRecord(**fields)


def test_record_sign_verify_and_refusals():
    coord, evil = Identity.generate(), Identity.generate()
    now = 1_700_000_000.0
    value = sign_record(_record(coord, now), coord)
    got = verify_record(value, public_key=coord.public_key, run_id=RUN, now=now + 1)
    assert got.endpoint == "127.0.0.1:7000" and got.spec_hash == SPEC_HASH

    with pytest.raises(RecordError, match="signature"):  # signed by another key
        verify_record(sign_record(_record(evil, now), evil), public_key=coord.public_key, run_id=RUN, now=now)
    tampered = dict(value, body=value["body"].replace(b"7000", b"6666"))
    with pytest.raises(RecordError, match="signature"):
        verify_record(tampered, public_key=coord.public_key, run_id=RUN, now=now)
    with pytest.raises(RecordError, match="for run"):
        verify_record(
            sign_record(_record(coord, now, run_id="other"), coord), public_key=coord.public_key, run_id=RUN, now=now
        )
    with pytest.raises(RecordError, match="expired"):
        verify_record(value, public_key=coord.public_key, run_id=RUN, now=now + 61)
    with pytest.raises(RecordError, match="future"):
        verify_record(value, public_key=coord.public_key, run_id=RUN, now=now - 3600)
    with pytest.raises(RecordError, match=f"longer than {MAX_TTL_S:g} s"):
        verify_record(
            sign_record(_record(coord, now, expires_at=now + 86400), coord),
            public_key=coord.public_key,
            run_id=RUN,
            now=now,
        )
    for junk in (None, b"x", {"body": b"x"}, {"body": "s", "sig": b""}):
        with pytest.raises(RecordError):
            verify_record(junk, public_key=coord.public_key, run_id=RUN, now=now)
    # A correctly signed body that is not a record (domain separation via `kind`).
    import msgpack

    body = msgpack.packb({"hello": 1})
    with pytest.raises(RecordError, match="fields"):
        verify_record({"body": body, "sig": coord.sign(body)}, public_key=coord.public_key, run_id=RUN, now=now)


def _dht_record(ident: Identity, signed: CoordinatorRecord, expiration: float, subkey: str | None = None):
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils.serializer import MSGPackSerializer

    return DHTRecord(
        key=DHTID.generate(source=coordinator_key(RUN)).to_bytes(),
        subkey=MSGPackSerializer.dumps(subkey or ident.public_key.hex()),
        value=MSGPackSerializer.dumps(sign_record(signed, ident)),
        expiration_time=expiration,
    )


def test_validator_caps_expirations_even_of_genuine_records():
    """Validating nodes refuse any entry under the coordinator key whose DHT expiration is
    more than MAX_EXPIRATION_AHEAD_S past their clock, and a record claiming a longer
    signed validity than MAX_TTL_S at all: nothing planted lives for a day."""
    coord, evil = Identity.generate(), Identity.generate()
    validator = CoordinatorRecordValidator(RUN, coord.public_key)
    now = get_dht_time()
    longest = _record(coord, now, expires_at=now + MAX_TTL_S)
    assert validator.validate(_dht_record(coord, longest, now + 60))
    assert validator.validate(_dht_record(coord, longest, now + MAX_EXPIRATION_AHEAD_S - 1))
    assert not validator.validate(_dht_record(coord, longest, now + MAX_EXPIRATION_AHEAD_S + 5))
    assert not validator.validate(_dht_record(coord, longest, now + 86400))
    # a day of signed validity is refused at any DHT expiration (the coordinator signs 60 s)
    day = _record(coord, now, expires_at=now + 86400)
    assert not validator.validate(_dht_record(coord, day, now + 60))
    # forgeries: another signer, under our subkey or its own, at any expiration
    forged = _record(evil, now)
    assert not validator.validate(_dht_record(evil, forged, now + 60, subkey=coord.public_key.hex()))
    assert not validator.validate(_dht_record(evil, forged, now + 60))
    # the publisher never asks for more than the cap allows
    assert DEFAULT_TTL_S <= MAX_EXPIRATION_AHEAD_S - DEFAULT_MAX_CLOCK_SKEW_S


def test_record_carries_the_tls_fingerprint():
    coord = Identity.generate()
    now = 1_700_000_000.0
    fp = "9a" * 32
    got = verify_record(
        sign_record(_record(coord, now, tls_sha256=fp), coord), public_key=coord.public_key, run_id=RUN, now=now
    )
    assert got.tls_sha256 == fp
    with pytest.raises(RecordError, match="tls_sha256"):
        verify_record(
            sign_record(_record(coord, now, tls_sha256="not-hex"), coord),
            public_key=coord.public_key,
            run_id=RUN,
            now=now,
        )


# ---------------------------------------------------------------------------- real DHT


@pytest.fixture(scope="module", autouse=True)
def _torch_shm_manager():
    """Start torch's shared-memory manager before the per-test leak check looks.

    hivemind's MPFuture shares memory through torch with the file_system strategy, which
    spawns one `torch_shm_manager` child for the whole process on first use. It is not a
    leak of any one test, and killing it breaks every later DHT call ("Broken pipe").
    """
    import torch

    torch.empty(1).share_memory_()
    yield


def _start(initial_peers=(), validators=()):
    # through the product's start: bounded, and the heap frozen across the fork (a plain
    # `hivemind.DHT(start=True)` here once forked a child that crashed collecting the test
    # process's gRPC objects, and waited for it until the test's timeout)
    return start_dht(
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        initial_peers=list(initial_peers),
        record_validators=list(validators),
    )


def _maddrs(dht) -> list[str]:
    return [str(m) for m in dht.get_visible_maddrs()]


@pytest.mark.timeout(60)
async def test_resolve_from_join_string_skips_forged_records():
    """A coordinator node publishes, an attacker node stores forgeries, workers resolve.

    1. The attacker stores a record signed by its own key under its own subkey: a worker
       DHT without any validator skips it and finds the genuine record.
    2. The attacker stores the forgery under the coordinator's subkey with a later
       expiration (which would shadow the genuine entry in hivemind's merge): a worker
       DHT running `CoordinatorRecordValidator` drops it and still finds the genuine one.
    """
    coord, evil = Identity.generate(), Identity.generate()
    dhts = []
    try:
        coord_dht = _start(validators=[CoordinatorRecordValidator(RUN, coord.public_key)])
        dhts.append(coord_dht)
        join = make_join_string(RUN, coord.public_key, _maddrs(coord_dht))
        info = parse_join_string(join)
        attacker = _start(_maddrs(coord_dht))
        dhts.append(attacker)

        async with CoordinatorPublisher(
            coord_dht, coord, run_id=RUN, endpoint="127.0.0.1:7000", spec_hash=SPEC_HASH, ttl_s=60.0
        ) as publisher:
            assert publisher.publishes == 1
            now = get_dht_time()
            forged = sign_record(_record(evil, now, endpoint="6.6.6.6:1", expires_at=now + 300), evil)
            # (the coordinator's node refuses it; the attacker keeps it in its own storage)
            await attacker.store(
                coordinator_key(RUN),
                forged,
                expiration_time=now + 300,
                subkey=evil.public_key.hex(),
                return_future=True,
            )
            seen = await attacker.get(coordinator_key(RUN), latest=True, return_future=True)
            assert evil.public_key.hex() in seen.value

            plain_worker = _start(_maddrs(coord_dht))
            dhts.append(plain_worker)
            record = await resolve_coordinator(join, dht=plain_worker, timeout_s=20, retry_interval_s=0.2)
            assert record.endpoint == "127.0.0.1:7000"
            assert record.public_key == coord.public_key and record.spec_hash == SPEC_HASH
            # the iterative lookup over the whole DHT meets the attacker's entry and skips it
            record, refused = await lookup_coordinator(plain_worker, info, direct=False)
            assert record is not None and record.endpoint == "127.0.0.1:7000"
            assert any("signature does not verify" in r for r in refused), refused

            await attacker.store(
                coordinator_key(RUN),
                forged,
                expiration_time=now + 300,
                subkey=coord.public_key.hex(),
                return_future=True,
            )
            # The attack is real: without a validator the later-expiring forgery shadows
            # the genuine entry in the iterative lookup (refused, so still no forgery is
            # ever returned) ...
            record, refused = await lookup_coordinator(plain_worker, info, direct=False)
            assert record is None and refused
            # ... but the join string's peer, the coordinator's own validating node, still
            # holds the genuine entry, and the default lookup asks it first.
            record, _ = await lookup_coordinator(plain_worker, info)
            assert record is not None and record.endpoint == "127.0.0.1:7000"
            guarded_worker = _start(
                _maddrs(coord_dht), validators=[CoordinatorRecordValidator(RUN, info.coordinator_public_key)]
            )
            dhts.append(guarded_worker)
            record = await resolve_coordinator(info, dht=guarded_worker, timeout_s=20, retry_interval_s=0.2)
            assert record.endpoint == "127.0.0.1:7000"
    finally:
        for dht in reversed(dhts):
            dht.shutdown()


@pytest.mark.timeout(60)
async def test_day_long_forgery_next_to_the_record_does_not_hide_it():
    """A node without the validator (a public bootstrap node) holds the genuine record and,
    next to it, a forgery expiring in a day. hivemind's iterative lookup on a validating
    worker drops that node's whole answer because of the forgery; the worker still
    resolves the coordinator, because it asks the join string's peer itself and checks
    each entry on its own."""
    coord, evil = Identity.generate(), Identity.generate()
    dhts = []
    try:
        bootstrap = _start()  # no validator: stores whatever it is given
        dhts.append(bootstrap)
        info = parse_join_string(make_join_string(RUN, coord.public_key, _maddrs(bootstrap)))
        await publish_coordinator(bootstrap, coord, run_id=RUN, endpoint="127.0.0.1:7010", spec_hash=SPEC_HASH)
        now = get_dht_time()
        day = now + 86400
        forged = sign_record(_record(evil, now, endpoint="6.6.6.6:1", expires_at=day), evil)
        assert await bootstrap.store(
            coordinator_key(RUN), forged, expiration_time=day, subkey=evil.public_key.hex(), return_future=True
        )
        worker = _start(_maddrs(bootstrap), validators=[CoordinatorRecordValidator(RUN, coord.public_key)])
        dhts.append(worker)
        # the failure mode: the validating worker's DHT drops the bootstrap's whole dictionary
        record, _ = await lookup_coordinator(worker, info, direct=False)
        assert record is None
        # asked directly, the bootstrap's answer yields the genuine entry and names the forgery
        record, refused = await lookup_direct(worker, info)
        assert record is not None and record.endpoint == "127.0.0.1:7010"
        assert len(refused) == 1 and "signature does not verify" in refused[0], refused
        record = await resolve_coordinator(info, dht=worker, timeout_s=10, retry_interval_s=0.2)
        assert record.endpoint == "127.0.0.1:7010" and record.public_key == coord.public_key
    finally:
        for dht in reversed(dhts):
            dht.shutdown()


@pytest.mark.timeout(60)
async def test_record_beyond_the_join_peers_is_read_entry_by_entry():
    """The join string's peer holds nothing (a validating node that refused the poisoned
    dictionary pushed to it); the record lives on a non-validating node next to a day-long
    forgery. The worker finds the nodes nearest the key and reads them entry by entry."""
    coord, evil = Identity.generate(), Identity.generate()
    validators = [CoordinatorRecordValidator(RUN, coord.public_key)]
    dhts = []
    try:
        holder = _start()  # alone when the record and the forgery are stored: only it has them
        dhts.append(holder)
        await publish_coordinator(holder, coord, run_id=RUN, endpoint="127.0.0.1:7020", spec_hash=SPEC_HASH)
        now = get_dht_time()
        forged = sign_record(_record(evil, now, endpoint="6.6.6.6:1", expires_at=now + 86400), evil)
        await holder.store(
            coordinator_key(RUN), forged, expiration_time=now + 86400, subkey=evil.public_key.hex(), return_future=True
        )
        entry = _start(_maddrs(holder), validators=validators)  # the join string's peer
        dhts.append(entry)
        info = parse_join_string(make_join_string(RUN, coord.public_key, _maddrs(entry)))
        worker = _start(_maddrs(entry), validators=validators)
        dhts.append(worker)
        record, _ = await lookup_direct(worker, info)
        assert record is None  # the join string's peer has no valid record
        record, _ = await lookup_coordinator(worker, info, direct=False)
        assert record is None  # hivemind's lookup drops the holder's whole answer
        record = await resolve_coordinator(info, dht=worker, timeout_s=10, retry_interval_s=0.2)
        assert record.endpoint == "127.0.0.1:7020"
    finally:
        for dht in reversed(dhts):
            dht.shutdown()


@pytest.mark.timeout(60)
async def test_only_forged_records_are_refused():
    """With no genuine record, resolution fails naming the refusal, never returns a forgery."""
    coord, evil = Identity.generate(), Identity.generate()
    dhts = []
    try:
        bootstrap = _start()
        dhts.append(bootstrap)
        join = parse_join_string(make_join_string(RUN, coord.public_key, _maddrs(bootstrap)))
        now = get_dht_time()
        # An attacker without the coordinator key publishes through the normal path (its
        # own subkey), and also plants a forgery under the coordinator's subkey.
        await publish_coordinator(bootstrap, evil, run_id=RUN, endpoint="6.6.6.6:1", spec_hash=SPEC_HASH)
        forged = sign_record(_record(evil, now, endpoint="6.6.6.6:1"), evil)
        await bootstrap.store(
            coordinator_key(RUN), forged, expiration_time=now + 60, subkey=coord.public_key.hex(), return_future=True
        )
        worker = _start(_maddrs(bootstrap))
        dhts.append(worker)
        with pytest.raises(CoordinatorNotFound, match="signature does not verify"):
            await resolve_coordinator(join, dht=worker, timeout_s=1.0, retry_interval_s=0.2)
        # A resolver that starts its own DHT installs the validator, which drops the
        # poisoned answer of the iterative lookup as a whole; asking the join string's peer
        # directly still sees each entry and names why it was refused.
        with pytest.raises(CoordinatorNotFound, match="signature does not verify"):
            await resolve_coordinator(join, timeout_s=1.0, retry_interval_s=0.2, host_maddrs=("/ip4/127.0.0.1/tcp/0",))
    finally:
        for dht in reversed(dhts):
            dht.shutdown()


@pytest.mark.timeout(60)
async def test_resolve_from_join_string_alone():
    """The resolver starts (and shuts down) its own DHT from the join string's peers."""
    coord = Identity.generate()
    coord_dht = _start(validators=[CoordinatorRecordValidator(RUN, coord.public_key)])
    try:
        published = await publish_coordinator(
            coord_dht, coord, run_id=RUN, endpoint="127.0.0.1:7001", spec_hash=SPEC_HASH, ttl_s=30.0
        )
        join = make_join_string(RUN, coord.public_key, _maddrs(coord_dht))
        record = await resolve_coordinator(
            join, timeout_s=20, retry_interval_s=0.2, host_maddrs=("/ip4/127.0.0.1/tcp/0",)
        )
        assert record == published
    finally:
        coord_dht.shutdown()


@pytest.mark.timeout(60)
async def test_validator_refuses_forgery_under_coordinator_subkey():
    coord, evil = Identity.generate(), Identity.generate()
    dhts = []
    try:
        guarded = _start(validators=[CoordinatorRecordValidator(RUN, coord.public_key)])
        dhts.append(guarded)
        now = get_dht_time()
        forged = sign_record(_record(evil, now), evil)
        ok = await guarded.store(
            coordinator_key(RUN), forged, expiration_time=now + 60, subkey=coord.public_key.hex(), return_future=True
        )
        assert not ok
        genuine = sign_record(_record(coord, now), coord)
        # A genuine record pinned beyond its signed expiry is refused too.
        ok = await guarded.store(
            coordinator_key(RUN), genuine, expiration_time=now + 3600, subkey=coord.public_key.hex(), return_future=True
        )
        assert not ok
        ok = await guarded.store(
            coordinator_key(RUN), genuine, expiration_time=now + 60, subkey=coord.public_key.hex(), return_future=True
        )
        assert ok
        # Other keys are not affected.
        assert await guarded.store("unrelated", b"x", expiration_time=now + 60, return_future=True)
    finally:
        for dht in reversed(dhts):
            dht.shutdown()


@pytest.mark.timeout(60)
async def test_publisher_refreshes_before_expiry():
    """With a 0.9 s TTL the record is still resolvable well after the first one expired."""
    coord = Identity.generate()
    dht = _start(validators=[CoordinatorRecordValidator(RUN, coord.public_key)])
    try:
        info = parse_join_string(make_join_string(RUN, coord.public_key, _maddrs(dht)))
        async with CoordinatorPublisher(
            dht, coord, run_id=RUN, endpoint="127.0.0.1:7002", spec_hash=SPEC_HASH, ttl_s=0.9
        ) as publisher:
            first = publisher.record
            await asyncio.sleep(2.0)
            record, refused = await lookup_coordinator(dht, info)
            assert publisher.publishes >= 3
            assert get_dht_time() > first.expires_at  # the first record alone would be gone
            assert record is not None and record.issued_at > first.issued_at, refused
        assert publisher._task is None
    finally:
        dht.shutdown()


def test_dht_that_does_not_come_up_in_time_is_terminated_not_waited_for() -> None:
    # hivemind.DHT(start=True) would wait for its child without a bound; start_dht gives up,
    # kills the child (the suite's leak check would fail otherwise) and says why; a slow start
    # is its own error, which a volunteer waits out (a bad address is not)
    with pytest.raises(DhtStartTimeout, match="did not start in time"):
        start_dht(timeout_s=0.001, host_maddrs=["/ip4/127.0.0.1/tcp/0"])


def test_only_a_slow_daemon_start_counts_as_a_start_timeout() -> None:
    """hivemind's own words for a p2p daemon that missed its startup_timeout are a slow start;
    its other start failures (a taken port, a bad address) are not, and stay fatal."""
    from hivemind.p2p import P2PDaemonError

    assert _is_daemon_start_timeout(P2PDaemonError("Daemon failed to start in 15.0 seconds"))
    assert not _is_daemon_start_timeout(P2PDaemonError("Daemon failed to start: address already in use"))
    assert not _is_daemon_start_timeout(ValueError("failed to start in 15.0 seconds"))
    assert issubclass(DhtStartTimeout, DiscoveryError)


def _dead_peer() -> tuple[object, str]:
    """A bound port nothing listens on (a dial is refused at once), as a bootstrap peer."""
    import socket

    from simworkers import fake_peer_id

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock, f"/ip4/127.0.0.1/tcp/{sock.getsockname()[1]}/p2p/{fake_peer_id('dead')}"


@pytest.mark.timeout(60)
def test_a_child_that_failed_to_start_exits_by_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """The child reports its error under hivemind's MPFuture update lock, a semaphore every
    later child of this process shares. Terminated as soon as the error arrived, it could die
    before releasing it (seen under load: 5 of 78 tries of eight waiting workers then hung for
    the whole start timeout, and every later start of that worker would have), so it is given
    the time to exit on its own."""
    import multiprocessing.process

    terminated: list[int] = []
    real = multiprocessing.process.BaseProcess.terminate

    def record(self: multiprocessing.process.BaseProcess) -> None:
        terminated.append(self.pid or 0)
        real(self)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "terminate", record)
    sock, dead = _dead_peer()
    try:
        for _ in range(3):
            with pytest.raises(BootstrapUnreachable):
                start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[dead], timeout_s=30)
    finally:
        sock.close()
    assert terminated == []
    from hivemind.utils.mpfuture import MPFuture

    assert MPFuture._update_lock.acquire(timeout=1)
    MPFuture._update_lock.release()


@pytest.mark.timeout(60)
def test_an_update_lock_left_held_by_a_dead_process_does_not_stop_later_starts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A process that died holding the shared update lock (killed mid-write) would block every
    later DHT child's report of its start: the start sees the lock stuck and replaces it."""
    import multiprocessing as mp
    import os

    from hivemind.utils.mpfuture import MPFuture

    def die_holding_it() -> None:
        MPFuture._update_lock.acquire()
        os._exit(0)

    holder = mp.get_context("fork").Process(target=die_holding_it)
    holder.start()
    holder.join(10)
    assert holder.exitcode == 0
    assert not MPFuture._update_lock.acquire(timeout=0.2)  # stuck: the holder is gone
    with caplog.at_level("WARNING", logger="bagel.protocol.discovery"):
        dht = start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"], timeout_s=30)
    try:
        assert dht.is_alive() and _maddrs(dht)
    finally:
        dht.shutdown()
    assert "held by a process that is gone" in caplog.text
