"""State sync over real hivemind peers: round trip with hash verification, and hostile donors."""

from __future__ import annotations

import asyncio
import hashlib
import io
from collections.abc import Callable

import pytest
import torch

from bagel.protocol import dataplane_pb2 as dp
from bagel.worker.diloco import CellState, OuterConfig, outer_step
from bagel.worker.framing import read_message, write_frame, write_message
from bagel.worker.statesync import (
    STATE_PROTOCOL,
    StateIntegrityError,
    StateNotAvailable,
    StateServer,
    StateSyncError,
    fetch_state,
    linger,
    verify_state_bytes,
)

from dataplane_peers import RUN_ID, Peer, peers, torch_shm_manager  # noqa: F401 (autouse fixture)

CELL = "k1.r0"


def committed_state(seed: int = 0) -> CellState:
    g = torch.Generator().manual_seed(seed)
    state = CellState({"net.weight": torch.randn(40, 30, generator=g), "net.bias": torch.randn(30, generator=g)})
    outer_step(state, {n: 0.1 * torch.randn(t.shape, generator=g) for n, t in state.weights.items()}, OuterConfig())
    return state


async def fetch(joiner: Peer, donor: Peer, rnd: int, want: str, **kw) -> object:
    args = dict(run_id=RUN_ID, cell_id=CELL, committed_round=rnd, state_hash=want, max_nbytes=1 << 20, timeout_s=20.0)
    args.update(kw)
    return await asyncio.wait_for(fetch_state(joiner.p2p, donor.plane.peer_id, **args), 60)


async def test_round_trip_in_chunks_with_hash_verification() -> None:
    async with peers(2) as (donor, joiner):
        server = StateServer(donor.p2p, RUN_ID, chunk_nbytes=1000, keep=2)
        await server.start()
        try:
            state = committed_state()
            want = server.publish(CELL, 5, state)
            assert want == state.state_hash()
            maddrs = [str(m) for m in donor.dht.get_visible_maddrs()]
            got = await fetch(joiner, donor, 5, want, donor_maddrs=maddrs)
            assert (got.cell_id, got.committed_round, got.state_hash) == (CELL, 5, want)
            assert got.nbytes == len(state.to_safetensors()) > 5 * 1000  # several chunks
            for n in state.weights:
                assert torch.equal(got.state.weights[n], state.weights[n])
                assert torch.equal(got.state.momentum[n], state.momentum[n])
            assert server.bytes_served >= got.nbytes

            # the donor keeps its last `keep` committed rounds, and nothing else
            server.publish(CELL, 6, committed_state(1))
            assert (await fetch(joiner, donor, 5, want)).state_hash == want
            server.publish(CELL, 7, committed_state(2))
            with pytest.raises(StateNotAvailable, match="not held"):
                await fetch(joiner, donor, 5, want)
            with pytest.raises(StateNotAvailable, match="different hash"):
                await fetch(joiner, donor, 6, want)
            with pytest.raises(StateNotAvailable, match="wrong run"):
                await fetch(joiner, donor, 7, committed_state(2).state_hash(), run_id="other")
            # a state larger than the joiner's limit is refused before it is read
            with pytest.raises(StateIntegrityError, match="limit"):
                await fetch(joiner, donor, 7, committed_state(2).state_hash(), max_nbytes=1000)
            server.withdraw(CELL)
            with pytest.raises(StateNotAvailable):
                await fetch(joiner, donor, 7, committed_state(2).state_hash())
            with pytest.raises(ValueError, match="hash is required"):
                await fetch(joiner, donor, 7, "")
        finally:
            await server.close()


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_superseded_state_is_kept_while_it_is_asked_for_then_dropped() -> None:
    """A state a newer round has superseded is kept `superseded_s` after that round's
    publication and after every request for it, so a joiner's download in progress goes on,
    and dropped once nobody asks for it: the donor does not hold a stale copy of the
    parameters until its next commit."""
    clock = Clock()
    async with peers(2) as (donor, joiner):
        server = StateServer(donor.p2p, RUN_ID, chunk_nbytes=1000, superseded_s=30.0, clock=clock)
        await server.start()
        try:
            five = server.publish(CELL, 5, committed_state(0))
            server.publish(CELL, 6, committed_state(1))
            assert server.held_rounds(CELL) == (5, 6)
            clock.now += 29.0
            server.drop_superseded()
            assert server.held_rounds(CELL) == (5, 6)
            assert (await fetch(joiner, donor, 5, five)).state_hash == five  # asked for: 30 s more
            clock.now += 29.0  # 58 s after round 6, 29 s after the request
            server.drop_superseded()
            assert server.held_rounds(CELL) == (5, 6)
            clock.now += 1.5
            server.drop_superseded()
            assert server.held_rounds(CELL) == (6,)
            with pytest.raises(StateNotAvailable, match=f"{CELL} round 5 is not held here"):
                await fetch(joiner, donor, 5, five)
            # the newest is never dropped, however long nobody asks
            clock.now += 1e6
            server.drop_superseded()
            assert server.held_rounds(CELL) == (6,)
        finally:
            await server.close()

        # on the running loop, a timer drops it without another publication or request
        server = StateServer(donor.p2p, RUN_ID, superseded_s=0.05)
        await server.start()
        try:
            server.publish(CELL, 5, committed_state(0))
            server.publish(CELL, 6, committed_state(1))
            await asyncio.wait_for(until(lambda: server.held_rounds(CELL) == (6,)), 30)
        finally:
            await server.close()

        # superseded_s=None: kept as long as `keep` allows
        server = StateServer(None, RUN_ID, superseded_s=None, clock=clock)  # type: ignore[arg-type]
        server.publish(CELL, 5, committed_state(0))
        server.publish(CELL, 6, committed_state(1))
        clock.now += 1e6
        server.drop_superseded()
        assert server.held_rounds(CELL) == (5, 6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
async def test_a_half_precision_state_downloads_losslessly(dtype: torch.dtype) -> None:
    """A run whose committed state lives on the bf16 / fp16 grid (`[sync] state_dtype`): the
    joiner downloads the donors' half-size file, from one donor and from two at once, and
    holds exactly the donor's bytes under the committed hash; a joiner that expects another
    dtype refuses the file, and nothing is cast."""
    from bagel.worker.statesync import DonorRef, fetch_state_from_donors

    g = torch.Generator().manual_seed(5)
    # ~0.7 MB in half precision (weights and EMA): 11 pieces of 64 KB, so both donors serve some even when one
    # answers much faster (with 2 pieces, a loaded machine let one donor take both)
    w = {"net.weight": torch.randn(400, 300, generator=g), "net.bias": torch.randn(300, generator=g)}
    state = CellState(w, None, w, dtype=dtype)  # rounded onto the grid, as every member's is
    cfg = OuterConfig(ema_decay=0.9)
    outer_step(state, {n: 0.1 * torch.randn(t.shape, generator=g) for n, t in w.items()}, cfg)
    fp32_nbytes = len(CellState(w, None, w).to_safetensors())
    async with peers(3) as (d0, d1, joiner):
        servers = [StateServer(d.p2p, RUN_ID, chunk_nbytes=16 << 10) for d in (d0, d1)]
        try:
            for s in servers:
                await s.start()
                want = s.publish(CELL, 5, state)
            assert want == state.state_hash()
            one = await fetch(joiner, d0, 5, want, dtype=dtype)
            refs = [DonorRef(d.plane.peer_id, tuple(str(m) for m in d.dht.get_visible_maddrs()), 0.0, d.worker_id)
                    for d in (d0, d1)]  # fmt: skip
            both = await asyncio.wait_for(
                fetch_state_from_donors(
                    joiner.p2p, refs, run_id=RUN_ID, cell_id=CELL, committed_round=5, state_hash=want,
                    max_nbytes=1 << 22, timeout_s=20.0, stall_s=5.0, request_nbytes=64 << 10, dtype=dtype,
                ),
                60,
            )  # fmt: skip
            assert all(b > 0 for b in both.nbytes_by_donor.values()) and len(both.nbytes_by_donor) == 2
            for got in (one, both.synced):
                assert got.state_hash == want == got.state.state_hash() and got.state.dtype == dtype
                assert got.state.to_safetensors() == state.to_safetensors()
                assert all(torch.equal(got.state.to_flat()[k], v) for k, v in state.to_flat().items())
                assert got.nbytes == len(state.to_safetensors()) < 0.51 * fp32_nbytes
            # the joiner of an fp32 run (or of the other half dtype) refuses the file
            other = torch.float32 if dtype == torch.float16 else torch.float16
            with pytest.raises(StateIntegrityError, match=f"expected {str(other).removeprefix('torch.')}"):
                await fetch(joiner, d0, 5, want, dtype=other)
        finally:
            for s in servers:
                await s.close()


async def until(cond: Callable[[], bool]) -> None:
    while not cond():
        await asyncio.sleep(0.01)


async def test_a_round_newer_than_any_held_is_waited_for_briefly() -> None:
    """The coordinator names a donor of round N once N commits, maybe before the donor publishes N."""
    async with peers(2) as (donor, joiner):
        # a wait far longer than the fetches' 20 s timeout: only a publish or a refusal ends one
        server = StateServer(donor.p2p, RUN_ID, keep=2, round_wait_s=600.0)
        await server.start()
        try:
            server.publish(CELL, 5, committed_state(0))
            six = committed_state(1)
            fetching = asyncio.create_task(fetch(joiner, donor, 6, six.state_hash()))
            await asyncio.wait_for(until(lambda: server.waiting == 1), 30)  # asked before round 6 is held
            server.publish(CELL, 6, six)
            got = await fetching
            assert (got.committed_round, got.state_hash) == (6, six.state_hash())
            assert server.waiting == 0

            # refused at once, not after the wait: an older round not held (5 was evicted by
            # keep=2 once 7 is published), a cell not held, another run
            server.publish(CELL, 7, committed_state(2))
            with pytest.raises(StateNotAvailable, match=f"{CELL} round 5 is not held here"):
                await fetch(joiner, donor, 5, committed_state(0).state_hash())
            with pytest.raises(StateNotAvailable, match="k9.r0 round 8 is not held here"):
                await fetch(joiner, donor, 8, six.state_hash(), cell_id="k9.r0")
            with pytest.raises(StateNotAvailable, match="wrong run"):
                await fetch(joiner, donor, 8, six.state_hash(), run_id="other")

            # a waiting request is refused as soon as its cell is withdrawn
            fetching = asyncio.create_task(fetch(joiner, donor, 8, six.state_hash()))
            await asyncio.wait_for(until(lambda: server.waiting == 1), 30)
            server.withdraw(CELL)
            with pytest.raises(StateNotAvailable, match=f"{CELL} round 8 is not held here"):
                await fetching
            assert server.waiting == 0
        finally:
            await server.close()

        # a round that never comes is refused once the wait is over
        server = StateServer(donor.p2p, RUN_ID, round_wait_s=0.2)
        await server.start()
        try:
            server.publish(CELL, 5, committed_state(0))
            with pytest.raises(StateNotAvailable, match=f"{CELL} round 6 is not held here"):
                await fetch(joiner, donor, 6, committed_state(1).state_hash())
            assert server.waiting == 0
        finally:
            await server.close()

        # no room to wait (max_waiting reached; 0 here): refused at once, not after 600 s
        server = StateServer(donor.p2p, RUN_ID, round_wait_s=600.0, max_waiting=0)
        await server.start()
        try:
            server.publish(CELL, 5, committed_state(0))
            with pytest.raises(StateNotAvailable, match=f"{CELL} round 6 is not held here"):
                await fetch(joiner, donor, 6, committed_state(1).state_hash())
        finally:
            await server.close()


async def hostile_donor(donor: Peer, info: dp.StateInfo, chunks: list[bytes], *, hang_up: bool = False) -> None:
    """A donor that answers every request with the given StateInfo and chunks, whatever they are.

    It then waits for the joiner to close, as the real donor does (`linger`): closing at once
    can make the libp2p daemon reset the stream before the last bytes leave, and the joiner
    would then refuse a cut stream instead of what the case sent. hang_up: close at once."""

    async def handler(_info, reader, writer) -> None:
        try:
            await read_message(reader, dp.StateRequest)
            await write_message(writer, info)
            for c in chunks:
                await write_frame(writer, c)
            if not hang_up:
                await linger(reader)
        finally:
            writer.close()

    await donor.p2p.add_binary_stream_handler(STATE_PROTOCOL, handler)


async def test_tampered_or_lying_donor_is_rejected() -> None:
    async with peers(2) as (donor, joiner):
        good = committed_state()
        want = good.state_hash()
        data = good.to_safetensors()
        sha = hashlib.sha256(data).hexdigest()

        def info(**kw) -> dp.StateInfo:
            base = dict(status=dp.STATUS_OK, cell_id=CELL, committed_round=3, state_hash=want,
                        total_nbytes=len(data), sha256=sha, chunk_nbytes=4096)  # fmt: skip
            base.update(kw)
            return dp.StateInfo(**base)

        def chunked(b: bytes) -> list[bytes]:
            return [b[i : i + 4096] for i in range(0, len(b), 4096)]

        cases = []
        # 1. bytes flipped in transit (or at rest): the sha256 check catches it
        flipped = bytearray(data)
        flipped[len(data) // 2] ^= 0xFF
        cases.append((info(), chunked(bytes(flipped)), "sha256"))
        # 2. a lying donor: a different, self-consistent state under the committed hash
        lie = committed_state(seed=9).to_safetensors()
        cases.append((info(total_nbytes=len(lie), sha256=hashlib.sha256(lie).hexdigest()), chunked(lie), "state hash"))
        # 3. a chunk longer than announced
        cases.append((info(chunk_nbytes=1024), [data], "limit"))
        # 4. announced round is not the requested one
        cases.append((info(committed_round=2), [data], "not the requested"))
        # 5. a pickle (what torch.save writes) with a matching sha256: parsed by safetensors only, refused
        buf = io.BytesIO()
        torch.save(good.to_flat(), buf)
        pickled = buf.getvalue()
        cases.append(
            (info(total_nbytes=len(pickled), sha256=hashlib.sha256(pickled).hexdigest()), chunked(pickled), "malformed")
        )
        # 6. the stream ends early
        cases.append((info(), [data[:100]], "closed"))

        for inf, chunks, why in cases:
            await hostile_donor(donor, inf, chunks, hang_up=why == "closed")
            with pytest.raises(StateIntegrityError, match=why):
                await fetch(joiner, donor, 3, want)
            await donor.p2p.remove_binary_stream_handler(STATE_PROTOCOL)


async def test_unreachable_donor_fails_within_timeout() -> None:
    async with peers(2) as (donor, joiner):
        donor_id = donor.plane.peer_id
        await donor.plane.close()
        donor.dht.shutdown()
        with pytest.raises(StateSyncError):
            await asyncio.wait_for(
                fetch_state(
                    joiner.p2p,
                    donor_id,
                    run_id=RUN_ID,
                    cell_id=CELL,
                    committed_round=1,
                    state_hash="ab" * 32,
                    max_nbytes=1 << 20,
                    timeout_s=5.0,
                ),  # fmt: skip
                60,
            )


def test_verify_state_bytes_checks_format_and_hash() -> None:
    state = committed_state()
    assert verify_state_bytes(state.to_safetensors(), state.state_hash()).state_hash() == state.state_hash()
    with pytest.raises(StateIntegrityError, match="state hash"):
        verify_state_bytes(state.to_safetensors(), "00" * 32)
    with pytest.raises(StateIntegrityError, match="malformed"):
        verify_state_bytes(b"not a safetensors file", state.state_hash())
