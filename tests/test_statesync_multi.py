"""State sync from several donors at once, over real hivemind peers on loopback: the same bytes
as one donor, a donor that dies or hangs mid-transfer, lying donors, ranged requests at the
donor, and why ranges of different donors fit together (byte-identical serializations)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable

import pytest
import torch

from bagel.protocol import dataplane_pb2 as dp
from bagel.worker import pacing
from bagel.worker.diloco import CellState, OuterConfig, outer_step
from bagel.worker.framing import LEN_NBYTES, read_frame, read_message, write_frame, write_message
from bagel.worker.statesync import (
    MIN_PIECE_NBYTES,
    STATE_PROTOCOL,
    DonorRef,
    MultiSynced,
    StateIntegrityError,
    StateServer,
    StateSyncError,
    fetch_state,
    linger,
    piece_digests,
    piece_nbytes_for,
    split_pieces,
)
from bagel.worker.statesync import (
    fetch_state_from_donors as fetch_multi,
)

from dataplane_peers import RUN_ID, Peer, peers, torch_shm_manager  # noqa: F401 (autouse fixture)

CELL = "k1.r0"
ROUND = 4


def big_state(seed: int = 0, *, ema: bool = True) -> CellState:
    """About 1.6 MB of safetensors: 25 pieces of 64 KiB."""
    g = torch.Generator().manual_seed(seed)
    w = {"a.weight": torch.randn(300, 400, generator=g), "b.bias": torch.randn(333, generator=g)}
    state = CellState(w, None, w if ema else None)
    delta = {n: 0.1 * torch.randn(t.shape, generator=g) for n, t in w.items()}
    outer_step(state, delta, OuterConfig(ema_decay=0.9 if ema else 0.0))
    return state


def ref(p: Peer, bw: float = 0.0) -> DonorRef:
    return DonorRef(p.plane.peer_id, tuple(str(m) for m in p.dht.get_visible_maddrs()), bw, p.worker_id)


async def multi(joiner: Peer, donors: list[DonorRef], want: str, **kw) -> MultiSynced:
    args = dict(run_id=RUN_ID, cell_id=CELL, committed_round=ROUND, state_hash=want, max_nbytes=8 << 20)
    args.update(timeout_s=30.0, stall_s=5.0, request_nbytes=128 << 10)
    args.update(kw)
    return await asyncio.wait_for(fetch_multi(joiner.p2p, donors, **args), 60)


async def serve(ps: list[Peer], state: CellState) -> list[StateServer]:
    out = []
    for p in ps:
        s = StateServer(p.p2p, RUN_ID, chunk_nbytes=16 << 10)
        await s.start()
        s.publish(CELL, ROUND, state)
        out.append(s)
    return out


def test_every_donor_serializes_the_same_state_to_the_same_bytes() -> None:
    """Ranges of different donors fit together only if their files are byte-identical."""
    computed = big_state()  # a member that ran the outer step
    synced = CellState.from_safetensors(computed.to_safetensors())  # a joiner that synced it (and now serves it)
    # a state built another way: names in another order, from non-contiguous views of equal values
    rebuilt = CellState(
        {n: (t.T.contiguous().T if t.dim() == 2 else t.clone()) for n, t in reversed(computed.weights.items())},
        {n: computed.momentum[n].clone() for n in reversed(list(computed.momentum))},
        {n: computed.ema[n].clone() for n in reversed(list(computed.ema or {}))},
    )
    data = computed.to_safetensors()
    assert synced.to_safetensors() == data and rebuilt.to_safetensors() == data
    assert rebuilt.clone().to_safetensors() == data
    # and a different state is different bytes (so the check above can fail)
    other = big_state(seed=1)
    assert other.to_safetensors() != data
    n = len(data)
    piece = piece_nbytes_for(n)
    assert piece == MIN_PIECE_NBYTES and piece_digests(data, piece) == piece_digests(synced.to_safetensors(), piece)


def test_pieces_and_proportional_split() -> None:
    assert piece_nbytes_for(1) == MIN_PIECE_NBYTES
    assert piece_nbytes_for(5_400_000_000) == 8 << 20  # a DiT-XL state: 644 pieces of 8 MiB
    for total in (1, MIN_PIECE_NBYTES * 1024, MIN_PIECE_NBYTES * 1024 + 1, 10**10):
        assert -(-total // piece_nbytes_for(total)) <= 1024
    assert split_pieces(10, [1, 1]) == [(0, 5), (5, 10)]
    assert split_pieces(100, [40e6, 10e6, 30e6, 20e6]) == [(0, 40), (40, 50), (50, 80), (80, 100)]
    assert split_pieces(7, [1, 2, 4]) == [(0, 1), (1, 3), (3, 7)]
    # unknown figures count as the mean of the known ones; none known: equal shares
    assert split_pieces(9, [0.0, 2.0, float("nan")]) == [(0, 3), (3, 6), (6, 9)]
    assert split_pieces(3, [0, 0, 0, 0]) == [(0, 1), (1, 2), (2, 3), (3, 3)]


async def test_three_donors_give_the_bytes_of_one_and_each_serves_its_share() -> None:
    async with peers(4) as (d0, d1, d2, joiner):
        state = big_state()
        want = state.state_hash()
        # each donor holds the state its own way (computed, synced, rebuilt): the same bytes
        copies = [state, CellState.from_safetensors(state.to_safetensors()), state.clone()]
        servers = []
        for p, c in zip((d0, d1, d2), copies, strict=True):
            servers += await serve([p], c)
        try:
            one = await fetch_state(joiner.p2p, d0.plane.peer_id, run_id=RUN_ID, cell_id=CELL,
                                    committed_round=ROUND, state_hash=want, max_nbytes=8 << 20)  # fmt: skip
            before = [s.bytes_served for s in servers]
            three = await multi(joiner, [ref(d0, 10e6), ref(d1, 20e6), ref(d2, 10e6)], want)
            assert three.synced.state.to_safetensors() == one.state.to_safetensors() == state.to_safetensors()
            assert three.synced.state_hash == one.state_hash == want and three.synced.nbytes == one.nbytes
            assert three.failed == {} and three.liars == ()
            shares = three.nbytes_by_donor
            assert sum(shares.values()) == one.nbytes and all(v > 0 for v in shares.values()), shares
            # what the joiner reports of each donor: the time its requests were in flight
            assert set(three.seconds_by_donor) == set(shares) and all(t > 0 for t in three.seconds_by_donor.values())
            # each donor sent ranges, not the file. How much each sent depends on how fast it
            # answered (a donor done early steals the back half of another's range), so the
            # bound is on the sum: every byte once, plus at most one endgame copy of the one
            # request each donor has in flight, plus the frames' length prefixes (a request spans
            # whole pieces of at least 64 KiB, so it is at most two frames per 16 KiB chunk).
            sent = [s.bytes_served - b for s, b in zip(servers, before, strict=True)]
            assert all(0 < n < one.nbytes for n in sent), sent
            body = one.nbytes + 3 * (128 << 10)
            assert one.nbytes <= sum(sent) <= body + 2 * LEN_NBYTES * -(-body // (16 << 10)), (sent, one.nbytes)

            # the donor answers ranges exactly, and refuses ranges outside its file
            data = state.to_safetensors()
            for offset, length, status in ((100, 5000, dp.STATUS_OK), (len(data) - 10, 99, dp.STATUS_OK),
                                           (len(data), 1, dp.STATUS_REJECTED), (-1, 10, dp.STATUS_REJECTED),
                                           (0, -5, dp.STATUS_REJECTED)):  # fmt: skip
                info, body = await ask(joiner, d1, want, offset=offset, length=length)
                assert info.status == status, (offset, length, info.reason)
                if status == dp.STATUS_OK:
                    assert body == data[offset : offset + length]
                    assert (info.range_offset, info.range_nbytes) == (offset, len(body))
            info, body = await ask(joiner, d1, want, pieces_only=True)
            assert body == b"" and info.piece_sha256 == piece_digests(data, piece_nbytes_for(len(data)))
        finally:
            for s in servers:
                await s.close()


async def ask(joiner: Peer, donor: Peer, want: str, **kw) -> tuple[dp.StateInfo, bytes]:
    """One raw request to a donor: its StateInfo and every data byte after it."""
    from hivemind.p2p import PeerID

    _, reader, writer = await joiner.p2p.call_binary_stream_handler(
        PeerID.from_base58(donor.plane.peer_id), STATE_PROTOCOL
    )
    try:
        req = dp.StateRequest(run_id=RUN_ID, cell_id=CELL, committed_round=ROUND, state_hash=want, **kw)
        await write_message(writer, req)
        info, _ = await asyncio.wait_for(read_message(reader, dp.StateInfo), 10)
        body = bytearray()
        # the bytes announced (the donor keeps the stream open until we close it: `statesync.linger`)
        size = info.range_nbytes if kw else info.total_nbytes
        while info.status == dp.STATUS_OK and len(body) < size:
            body += await asyncio.wait_for(read_frame(reader, size - len(body)), 10)
        return info, bytes(body)
    finally:
        writer.close()


async def until(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.005)


async def hostile(p: Peer, data: bytes, *, after: int, mode: str, release: asyncio.Event | None = None) -> None:
    """A donor that announces `data` and serves ranges of it, but once it has sent `after`
    bytes: 'hang' sends nothing more until `release` is set, 'flip' flips every byte;
    'mute' does not even announce (until `release`)."""
    sent = 0
    total = len(data)
    piece = piece_nbytes_for(total)
    shown = data

    async def handler(_info, reader, writer) -> None:
        nonlocal sent
        try:
            req, _ = await read_message(reader, dp.StateRequest)
            info = dp.StateInfo(status=dp.STATUS_OK, cell_id=CELL, committed_round=ROUND, state_hash=req.state_hash,
                                total_nbytes=total, sha256=hashlib.sha256(shown).hexdigest(), chunk_nbytes=16 << 10,
                                piece_nbytes=piece)  # fmt: skip
            if req.pieces_only:
                if mode == "mute":
                    assert release is not None
                    await asyncio.wait_for(release.wait(), 30)
                info.piece_sha256 = piece_digests(shown, piece)
                await write_message(writer, info)
                await linger(reader)
                return
            end = min(total, req.offset + req.length)
            info.range_offset, info.range_nbytes = req.offset, end - req.offset
            await write_message(writer, info)
            for at in range(req.offset, end, 16 << 10):
                chunk = data[at : min(end, at + (16 << 10))]
                if sent >= after:
                    if mode == "hang":
                        assert release is not None
                        await asyncio.wait_for(release.wait(), 30)
                    chunk = bytes(b ^ 0xFF for b in chunk)
                await write_frame(writer, chunk)
                sent += len(chunk)
            await linger(reader)  # as the real donor: closing at once may cut the last frame
        except (ConnectionError, OSError, TimeoutError):
            pass
        finally:
            writer.close()

    await p.p2p.add_binary_stream_handler(STATE_PROTOCOL, handler)


async def test_a_donor_that_dies_or_hangs_mid_transfer_is_replaced_by_the_others() -> None:
    async with peers(4) as (d0, d1, d2, joiner):
        state = big_state()
        want, data = state.state_hash(), state.to_safetensors()
        servers = await serve([d0, d1], state)
        release = asyncio.Event()
        try:
            # d2 serves its first 100 KiB, then sends nothing: the others take the rest of its
            # share (what it had not asked for, then its request in flight), or it is dropped
            # after stall_s, whichever comes first
            await hostile(d2, data, after=100 << 10, mode="hang", release=release)
            got = await multi(joiner, [ref(d2, 50e6), ref(d0), ref(d1)], want, stall_s=1.0)
            assert got.synced.state.to_safetensors() == data and got.liars == ()
            assert set(got.failed) <= {"w2"}
            assert got.nbytes_by_donor["w2"] == MIN_PIECE_NBYTES  # its one whole piece; the rest from the others
            release.set()
            await d2.p2p.remove_binary_stream_handler(STATE_PROTOCOL)
            # d2 does not even answer the announcement: the others start stall_s after the first
            release = asyncio.Event()
            await hostile(d2, data, after=0, mode="mute", release=release)
            got = await multi(joiner, [ref(d2), ref(d0), ref(d1)], want, stall_s=1.0)
            assert got.synced.state.to_safetensors() == data and "w2" not in got.nbytes_by_donor
            assert "announced nothing within" in got.failed["w2"]
            release.set()
            await d2.p2p.remove_binary_stream_handler(STATE_PROTOCOL)

            # d1 really dies mid-transfer: its process's P2P and DHT go away while it streams
            pacing.install(pacing.UploadPacer(1.5e6))  # this process's donors send 1.5 MB/s together
            try:
                before = servers[1].bytes_served  # what it served in the fetch above
                fetching = asyncio.create_task(multi(joiner, [ref(d0), ref(d1)], want))
                await until(lambda: servers[1].bytes_served > before)
                await d1.plane.close()
                d1.dht.shutdown()
                got = await fetching
            finally:
                pacing.install(None)
            assert got.synced.state.to_safetensors() == data
            assert list(got.failed) == ["w1"] and got.nbytes_by_donor["w1"] < len(data) / 2
            assert got.nbytes_by_donor["w0"] > len(data) / 2  # d0 fetched d1's share too
        finally:
            release.set()
            for s in servers:
                await s.close()


async def test_lying_donors_are_caught_and_never_adopted() -> None:
    async with peers(3) as (d0, d1, joiner):
        state = big_state()
        want, data = state.state_hash(), state.to_safetensors()
        [server] = await serve([d0], state)
        try:
            # 1. d1 announces the true file but flips the bytes it sends after 64 KiB: caught
            #    at the first bad piece, a proven liar; d0 serves the rest
            await hostile(d1, data, after=64 << 10, mode="flip")
            got = await multi(joiner, [ref(d1, 50e6), ref(d0)], want)
            assert got.synced.state_hash == want and got.synced.state.to_safetensors() == data
            assert got.liars == ("w1",) and "does not match the announced digest" in got.failed["w1"]
            await d1.p2p.remove_binary_stream_handler(STATE_PROTOCOL)

            # 2. d1 announces and serves another, self-consistent state under the committed hash
            #    (first in the coordinator's order, so its file is tried first): the state hash
            #    refutes it and d0's file is fetched instead
            lie = big_state(seed=9).to_safetensors()
            await hostile(d1, lie, after=1 << 30, mode="flip")
            got = await multi(joiner, [ref(d1), ref(d0)], want)
            assert got.synced.state.to_safetensors() == data and got.liars == ("w1",)
            assert "not the committed state" in got.failed["w1"]

            # 3. every donor lies together: the sync fails, nothing is adopted
            await server.close()
            await hostile(d0, lie, after=1 << 30, mode="flip")
            with pytest.raises(StateIntegrityError, match="state hash"):
                await multi(joiner, [ref(d0), ref(d1)], want)
            for p in (d0, d1):
                await p.p2p.remove_binary_stream_handler(STATE_PROTOCOL)

            # 4. a state larger than the joiner's limit is refused before a byte of it is fetched
            [server] = await serve([d0], state)
            await hostile(d1, data, after=1 << 30, mode="flip")
            with pytest.raises(StateSyncError, match="limit"):
                await multi(joiner, [ref(d0), ref(d1)], want, max_nbytes=len(data) - 1)
            assert server.bytes_served == 0
        finally:
            await server.close()


async def test_one_donor_and_old_donors_take_the_single_stream() -> None:
    async with peers(3) as (d0, d1, joiner):
        state = big_state(ema=False)
        want, data = state.state_hash(), state.to_safetensors()
        [server] = await serve([d0], state)
        try:
            got = await multi(joiner, [ref(d0)], want)  # one donor: `fetch_state`, unranged
            assert got.synced.state.to_safetensors() == data and server.bytes_served > len(data)

            # d1 speaks the protocol before ranges: it answers every request with the whole file
            async def old(_info, reader, writer) -> None:
                try:
                    req, _ = await read_message(reader, dp.StateRequest)
                    await write_message(writer, dp.StateInfo(status=dp.STATUS_OK, cell_id=CELL, committed_round=ROUND,
                                                             state_hash=req.state_hash, total_nbytes=len(data),
                                                             sha256=hashlib.sha256(data).hexdigest(),
                                                             chunk_nbytes=len(data)))  # fmt: skip
                    await write_frame(writer, data)
                    await linger(reader)
                except (ConnectionError, OSError):
                    pass
                finally:
                    writer.close()

            await d1.p2p.add_binary_stream_handler(STATE_PROTOCOL, old)
            await server.close()  # d0 gone: only the old donor is left
            got = await multi(joiner, [ref(d0), ref(d1)], want)
            assert got.synced.state.to_safetensors() == data and list(got.nbytes_by_donor) == ["w1"]
            assert list(got.seconds_by_donor) == ["w1"] and got.seconds_by_donor["w1"] > 0
        finally:
            await server.close()
