"""Open-run admission: the proof of work, the rate limits and `--max-workers`.

Pure parts (the PoW puzzle, the token buckets, address keys, stream slots) are tested
directly; the rest against a real coordinator on port 0, each refusal with its precise
status and, where it applies, no state change.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest

from bagel.coordinator import cli
from bagel.coordinator.admission import Admission, DownloadsBusy, UploadBusy, client_address
from bagel.coordinator.daemon import CoordinatorHandle, start_coordinator
from bagel.coordinator.ratelimit import RateLimiter
from bagel.coordinator.store import Store
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol import bagel_pb2_grpc as pb_grpc
from bagel.protocol.client import CoordinatorClient
from bagel.protocol.envelope import sign_request
from bagel.protocol.identity import Identity
from bagel.protocol.pow import check_pow, leading_zero_bits, pow_digest, solve_pow
from bagel.protocol.runspec import SpecError, parse_spec

from simworkers import cluster_spec_text, fake_peer_id, uniform_cells

PROFILE = pb.WorkerProfile(name="w", device_kind="cpu", vram_bytes=8 << 30, num_devices=1)
PEER = pb.PeerAddress(peer_id=fake_peer_id("x"), maddrs=["/ip4/127.0.0.1/tcp/1"])


# ---------------------------------------------------------------------------- pure parts


def test_pow_solution_is_bound_to_challenge_run_and_key() -> None:
    ch, key = b"c" * 32, Identity.from_private_bytes(b"\2" * 32).public_key
    nonce = solve_pow(ch, "run", key, 12)
    assert check_pow(ch, "run", key, nonce, 12)
    assert leading_zero_bits(pow_digest(ch, "run", key, nonce)) >= 12
    # the same nonce buys nothing for another key, run or challenge (each a fresh 12-bit
    # lottery; every input is fixed, so this is deterministic)
    assert not check_pow(ch, "run", Identity.from_private_bytes(b"\1" * 32).public_key, nonce, 12)
    assert not check_pow(ch, "other", key, nonce, 12)
    assert not check_pow(b"d" * 32, "run", key, nonce, 12)
    assert not check_pow(ch, "run", key, -1, 0) and not check_pow(ch, "run", key, 1 << 64, 0)
    assert leading_zero_bits(b"\x00\x00\x01") == 23 and leading_zero_bits(b"\x80") == 0
    with pytest.raises(ValueError):
        solve_pow(ch, "run", key, 41)


def test_rate_limiter_buckets_refill_and_stay_bounded() -> None:
    lim = RateLimiter(rate=2.0, burst=3, capacity=4)
    assert [lim.take("a", 0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert lim.take("a", 0.0) == pytest.approx(0.5)  # one token back after 1/rate
    assert lim.take("b", 0.0) == 0.0  # buckets are per key
    assert lim.take("a", 0.6) == 0.0  # refilled
    assert lim.take("a", 0.6) > 0
    for i in range(100):  # a flood of new keys never grows the table past its capacity
        lim.take(f"k{i}", 1.0)
    assert len(lim) == 4
    with pytest.raises(ValueError):
        RateLimiter(rate=0, burst=1)


def test_client_address_keys() -> None:
    assert client_address("ipv4:10.1.2.3:5555") == "10.1.2.3"
    assert client_address("ipv6:[2001:db8:1:2:aaaa::1]:443") == "2001:db8:1:2::/64"
    assert client_address("ipv6:[2001:db8:1:2:bbbb::9]:80") == "2001:db8:1:2::/64"  # one /64, one bucket
    assert client_address("unix:/tmp/s") == "unix:/tmp/s"


def test_stream_slots() -> None:
    spec = parse_spec(cluster_spec_text("slots", extra="[security]\nmax_uploads = 2\nmax_downloads = 1\n"))
    adm = Admission(spec)
    with adm.upload_slot("a"):
        with pytest.raises(UploadBusy, match="one at a time"), adm.upload_slot("a"):
            pass
        with adm.upload_slot("b"), pytest.raises(UploadBusy, match="2 uploads"), adm.upload_slot("c"):
            pass
    assert adm.uploads == 0
    with adm.download_slot(), pytest.raises(DownloadsBusy), adm.download_slot():
        pass
    assert adm.downloads == 0


def test_security_keys_are_checked_and_hashed() -> None:
    base = cluster_spec_text("keys")
    assert parse_spec(base).security.pow_bits == 16  # on by default
    assert parse_spec(base + "[security]\npow_bits = 20\n").spec_hash != parse_spec(base).spec_hash
    for bad in (
        "pow_bits = 33",
        "key_burst = 0",
        "ip_rate_per_s = 0",
        "status_cache_ms = -1",
        'operator_public_key = "eA=="',
    ):
        with pytest.raises(SpecError, match="security"):
            parse_spec(base + f"[security]\n{bad}\n")


# ---------------------------------------------------------------------------- live coordinator


async def start(tmp_path: Path, security: str = "", **kw: Any) -> CoordinatorHandle:
    spec = parse_spec(cluster_spec_text("lim", lease_s=600.0, heartbeat_s=1.0, extra=f"[security]\n{security}"))
    return await start_coordinator(spec, tmp_path / "c", cells=uniform_cells(spec.cell_ids), tick_ms=50, **kw)


async def fingerprint(h: CoordinatorHandle) -> tuple[Any, ...]:
    await h.app.writer.barrier()
    store = Store.open_readonly(h.data_dir)
    try:
        return store.dump(), h.state.snapshot()
    finally:
        store.close()


@pytest.mark.timeout(60)
async def test_register_needs_a_valid_proof_of_work(tmp_path: Path) -> None:
    h = await start(tmp_path, "pow_bits = 12")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{h.port}") as ch:
            stub = pb_grpc.CoordinatorStub(ch)
            challenge = await stub.AdmissionChallenge(pb.AdmissionChallengeRequest(), timeout=10)
            assert challenge.pow_bits == 12 and len(challenge.challenge) == 32 and not challenge.token_required
            me = Identity.generate()

            async def send(**fields: Any) -> grpc.aio.AioRpcError:
                req = pb.RegisterRequest(profile=PROFILE, peer=PEER, **fields)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Register(sign_request(me, req, run_id="lim", method="Register"), timeout=10)
                return err.value

            nonce = solve_pow(challenge.challenge, "lim", me.public_key, 12)
            other = Identity.generate()
            cases = [
                (grpc.StatusCode.FAILED_PRECONDITION, "AdmissionChallenge", {}),
                (grpc.StatusCode.FAILED_PRECONDITION, "unknown or expired", {"pow_challenge": b"x" * 32}),
                # a solution for another identity
                (
                    grpc.StatusCode.PERMISSION_DENIED,
                    "leading zero bits",
                    {
                        "pow_challenge": challenge.challenge,
                        "pow_nonce": solve_pow(challenge.challenge, "lim", other.public_key, 12, start=nonce + 1),
                    },
                ),
            ]
            before = await fingerprint(h)
            for code, words, fields in cases:
                err = await send(**fields)
                assert err.code() == code and words in (err.details() or ""), err.details()
                assert await fingerprint(h) == before
            req = pb.RegisterRequest(profile=PROFILE, peer=PEER, pow_challenge=challenge.challenge, pow_nonce=nonce)
            resp = await stub.Register(sign_request(me, req, run_id="lim", method="Register"), timeout=10)
            assert resp.worker_id == me.worker_id
    finally:
        await h.stop()


@pytest.mark.timeout(60)
async def test_per_key_and_per_address_rate_limits(tmp_path: Path) -> None:
    h = await start(tmp_path, "pow_bits = 0\nkey_rate_per_s = 0.5\nkey_burst = 4\nip_rate_per_s = 1.0\nip_burst = 40")
    try:
        a, b = Identity.generate(), Identity.generate()
        async with (
            CoordinatorClient(f"127.0.0.1:{h.port}", a, "lim") as ca,
            CoordinatorClient(f"127.0.0.1:{h.port}", b, "lim") as cb,
        ):
            await ca.register(PROFILE, PEER)
            await cb.register(PROFILE, PEER)
            for _ in range(3):  # a's burst of 4: one Register, three heartbeats
                await ca.heartbeat(pb.PHASE_IDLE)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await ca.heartbeat(pb.PHASE_IDLE)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "retry after" in (err.value.details() or "")
            assert int(dict(err.value.trailing_metadata() or ())["bagel-retry-after-ms"]) > 0
            await cb.heartbeat(pb.PHASE_IDLE)  # another key is not affected
            # the address: 40 calls of any kind, then refusals (unsigned GetStatus included)
            codes = []
            for _ in range(45):
                try:
                    await cb.status(signed=False)
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as e:
                    codes.append(e.code())
            assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
            assert set(codes) == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
    finally:
        await h.stop()


@pytest.mark.timeout(60)
async def test_max_workers(tmp_path: Path) -> None:
    h = await start(tmp_path, "pow_bits = 4", max_workers=2)
    try:
        clients = [CoordinatorClient(f"127.0.0.1:{h.port}", Identity.generate(), "lim") for _ in range(3)]
        await clients[0].register(PROFILE, PEER)
        await clients[1].register(PROFILE, PEER)
        before = await fingerprint(h)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await clients[2].register(PROFILE, PEER)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await fingerprint(h) == before
        await clients[0].leave("bye")
        await clients[2].register(PROFILE, PEER)  # a slot freed
        await asyncio.gather(*(c.close() for c in clients))
    finally:
        await h.stop()


def test_serve_max_workers_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "s.toml"
    spec.write_text(cluster_spec_text("flag"))
    assert cli.main(["serve", "--run", str(spec), "--data-dir", str(tmp_path / "d"), "--max-workers", "0"]) == 2
    assert "--max-workers" in capsys.readouterr().err


@pytest.mark.timeout(60)
async def test_registrations_per_address_are_limited(tmp_path: Path) -> None:
    """Identities cost work, and an address mints only so many of them."""
    h = await start(tmp_path, "pow_bits = 0\nregister_rate_per_s = 0.01\nregister_burst = 3")
    try:
        clients = [CoordinatorClient(f"127.0.0.1:{h.port}", Identity.generate(), "lim") for _ in range(4)]
        for c in clients[:3]:
            await c.register(PROFILE, PEER)
        before = await fingerprint(h)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await clients[3].register(PROFILE, PEER)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "registrations from 127.0.0.1" in (err.value.details() or "")
        assert await fingerprint(h) == before
        await clients[0].heartbeat(pb.PHASE_IDLE)  # the other RPCs are not affected
        await asyncio.gather(*(c.close() for c in clients))
    finally:
        await h.stop()


def test_an_honest_checkpoint_fits_the_declared_size_bound() -> None:
    """The bound the servicer checks declarations against holds the real cell state of every
    cell of a run (DiT experts and the router), so no honest upload is refused by it."""
    from bagel.coordinator.sizing import checkpoint_bytes_bound
    from bagel.models import experts
    from bagel.worker.diloco import CellState

    spec = parse_spec(cluster_spec_text("bound"))
    for cell_id in spec.cell_ids:
        state = CellState.from_model(experts.build(experts.cell_config(spec, cell_id)))
        size = len(state.to_safetensors())
        bound = checkpoint_bytes_bound(spec, cell_id)
        assert size <= bound, (cell_id, size, bound)
        assert bound - size <= 2 << 20, "the bound is loose enough to invite padding"
