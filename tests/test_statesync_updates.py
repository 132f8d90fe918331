"""Catching up by committed updates over real hivemind peers on loopback, through the worker's
own path: members commit rounds with a real exchange (`reduce_round`, `Orders.commit`, which
keeps each round's update next to its state), and a joiner's `Orders._sync` reaches the
committed round from the state it holds by fetching and applying those updates, or falls
back to the full download when a donor refuses or lies."""

from __future__ import annotations

import asyncio
import struct
import zlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from bagel.protocol.messages import Donor, PeerAddress
from bagel.protocol.runspec import parse_spec
from bagel.worker import ddp
from bagel.worker.catchup import CommittedUpdate
from bagel.worker.diloco import CellState, OuterConfig, outer_step
from bagel.worker.display import Display
from bagel.worker.localstate import LocalCheckpoint
from bagel.worker.orders import Orders
from bagel.worker.roundwork import ReduceOutcome, RoundWork, reduce_round
from bagel.worker.statesync import StateServer, fetch_state
from bagel.worker.trainer import InnerPlan, TrainResult

from dataplane_peers import RUN_ID, Peer, peers, torch_shm_manager  # noqa: F401 (autouse fixture)

CELL = "k0.r0"
SPEC = parse_spec(f"""
[run]
id = "{RUN_ID}"
[diloco]
codec = "int8"
error_feedback = false
aggregation = "mean"
[ema]
decay = 0.9
[sync]
catch_up_rounds = 2
""")
CFG = OuterConfig.from_spec(SPEC.diloco, SPEC.ema)


def base_state(dtype: torch.dtype = torch.float32) -> CellState:
    """A committed state of ~137K parameters (weights, outer momentum, average): 1.6 MB in
    fp32, on the `dtype` grid."""
    g = torch.Generator().manual_seed(0)
    w = {"blocks.0.weight": torch.randn(256, 512, generator=g), "blocks.0.bias": torch.randn(512, generator=g),
         "head.weight": torch.randn(10, 512, generator=g)}  # fmt: skip
    state = CellState(w, None, w, dtype=dtype)
    outer_step(state, {n: 0.1 * torch.randn(t.shape, generator=g) for n, t in w.items()}, CFG, ema_step=4)
    return state


class Recorder(Display):
    def __init__(self) -> None:
        super().__init__("quiet")
        self.events: list[tuple[str, dict[str, Any]]] = []

    def event(self, name: str, level: str = "info", **fields: Any) -> None:
        self.events.append((name, fields))

    def named(self, name: str) -> list[dict[str, Any]]:
        return [f for n, f in self.events if n == name]


class Host:
    """What `Orders` needs of the agent, for a sync and a commit."""

    def __init__(self, spec: Any = SPEC) -> None:
        self.spec = spec
        self.tasks: list[asyncio.Task[Any]] = []

    def spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        t = asyncio.ensure_future(coro)
        self.tasks.append(t)
        return t

    def wake(self) -> None:
        pass

    async def sleep(self, s: float) -> None:
        await asyncio.sleep(0)

    def still_current(self, i: Any) -> bool:
        return True

    def on_instruction(self, instr: Any) -> None:
        pass

    async def ensure_data(self, cell_id: str) -> None:
        pass


async def _no_checkpoint(*_a: Any, **_k: Any) -> None:
    raise AssertionError("the coordinator's checkpoint is not used here")


async def worker(p: Peer, held: CellState | None, rnd: int, spec: Any = SPEC) -> Orders:
    """A worker's `Orders` on peer p of the run `spec`, holding `held` as the committed state
    of `rnd` (and serving it, as after a commit or a sync), or nothing."""
    link = SimpleNamespace(client=object(), wake_heartbeat=lambda: None, epoch=0, rpc=_no_checkpoint)
    cfg = SimpleNamespace(sync_timeout_s=30.0, keep_round_history=False, byzantine="", reduce_timeout_s=30.0)
    o = Orders(Host(spec), link, cfg, Recorder(), ddp.DistContext(), torch.device("cpu"), RUN_ID, p.worker_id)  # type: ignore[arg-type]
    server = StateServer(p.p2p, RUN_ID, chunk_nbytes=64 << 10, keep=3)
    await server.start()
    o.attach(p.p2p, p.plane, server, None)  # type: ignore[arg-type]  (no local store: nothing saved)
    if held is not None:
        o.held = LocalCheckpoint(CELL, rnd, held, held.state_hash(), {})
        server.publish(CELL, rnd, held)
    return o


def reduce_order(members: list[Peer]) -> SimpleNamespace:
    """The REDUCE instruction's fields an exchange reads: attempt 1 among these members, no deadline."""
    return SimpleNamespace(
        reduce_attempt=1,
        reduce_deadline_unix_ms=0,
        contributors=[
            SimpleNamespace(worker_id=c.worker_id, peer=SimpleNamespace(peer_id=c.peer_id, maddrs=list(c.maddrs)),
                            max_samples=c.max_samples, no_reduce=False, part_weight=0)
            for c in (p.contributor() for p in members)
        ],
    )  # fmt: skip


async def commit_round(members: list[tuple[Peer, Orders]], rnd: int, spec: Any = SPEC) -> list[ReduceOutcome]:
    """Round `rnd` committed as the workers commit it: a real exchange among the members
    (`reduce_round`, what `Orders._reduce` runs), then `Orders.commit` of its outcome."""
    order = reduce_order([p for p, _ in members])
    works = []
    for i, (_, o) in enumerate(members):
        assert o.held is not None
        w = RoundWork(CELL, rnd, 1, i, len(members), InnerPlan(1, 1, 1), 0)
        w.result = TrainResult(samples=10, mean_loss=0.0, steps=1, compute_s=0.0, completed=True)
        g = torch.Generator().manual_seed(100 * rnd + i)
        w.delta = {n: 0.01 * torch.randn(t.shape, generator=g) for n, t in o.held.state.weights.items()}
        works.append(w)
    outs = await asyncio.gather(
        *(
            reduce_round(p.plane, spec, p.worker_id, o.held.state, w, order, None, 30.0, base_hash=o.held.state_hash)  # type: ignore[union-attr]
            for (p, o), w in zip(members, works, strict=True)
        )
    )
    assert len({out.state_hash for out in outs}) == 1, "replicas differ"
    for (_, o), w, out in zip(members, works, outs, strict=True):
        assert out.update is not None and out.update.round == rnd
        w.pending = out
        o.work = w
        o.commit(w)
    return list(outs)


def donor(p: Peer) -> Donor:
    return Donor(p.worker_id, PeerAddress(p.plane.peer_id, tuple(str(m) for m in p.dht.get_visible_maddrs())), -1, 0.0)


async def close(*orders: Orders) -> None:
    for o in orders:
        await o.stateserver.close()


@pytest.mark.timeout(180)
async def test_catch_up_by_updates_gives_the_state_of_a_full_download() -> None:
    async with peers(4) as (d0, d1, joiner, second):
        s4 = base_state()
        m0, m1 = await worker(d0, s4, 4), await worker(d1, s4, 4)
        outs5 = await commit_round([(d0, m0), (d1, m1)], 5)
        outs6 = await commit_round([(d0, m0), (d1, m1)], 6)
        s5, h6 = outs5[0].state, outs6[0].state_hash
        assert m0.stateserver.held_updates(CELL) == (5, 6)  # kept on commit, next to the states
        # the update kept is the exchange's wire form: its parts, as every member applied them
        u6 = outs6[0].update
        assert u6 is not None and u6 == outs6[1].update and u6.base_hash == outs5[0].state_hash
        assert sum(u6.part_numels) == sum(t.numel() for t in s4.weights.values()) and len(u6.parts) == 2
        j = await worker(joiner, s4, 4)
        k = await worker(second, s5, 5)
        try:
            await j._sync(CELL, 6, h6, (donor(d0),))
            assert j.held is not None and (j.held.committed_round, j.held.state_hash) == (6, h6)
            [synced] = j.display.named("synced")  # type: ignore[attr-defined]
            caught = j.counters.checkpoint_received
            assert synced["source"] == f"donor w0 (updates of rounds 5..6, {caught} bytes)", synced
            assert j.display.named("sync-donor-failed") == []  # type: ignore[attr-defined]
            assert caught == u6.nbytes + outs5[0].update.nbytes  # type: ignore[union-attr]
            assert synced["donor_rates"]["w0"]["bytes"] == caught  # measured, and reported (releases the donor)
            assert m0.stateserver.bytes_served == m0.stateserver.update_bytes_served > 0  # no state byte
            # the same state, tensor for tensor, as the full download of round 6 from the same donor
            full = await fetch_state(joiner.p2p, d0.plane.peer_id, run_id=RUN_ID, cell_id=CELL, committed_round=6,
                                     state_hash=h6, max_nbytes=1 << 30)  # fmt: skip
            assert full.state.to_safetensors() == j.held.state.to_safetensors() == outs6[0].state.to_safetensors()
            assert j.reset_optimizer and j.held.residuals == {}
            # far fewer bytes: two rounds of int8 updates are about 1/6 of the state
            assert caught * 5 < full.nbytes, (caught, full.nbytes)
            print(f"\ncatch-up by 2 rounds: {caught} bytes; full download: {full.nbytes} bytes")
            # a worker that caught up keeps the updates it applied and serves them in turn:
            # one round behind, the second joiner catches up from it
            assert j.stateserver.held_updates(CELL) == (5, 6)
            await k._sync(CELL, 6, h6, (donor(joiner),))
            assert k.held is not None and k.held.state_hash == h6
            [synced] = k.display.named("synced")  # type: ignore[attr-defined]
            one = k.counters.checkpoint_received
            assert synced["source"] == f"donor {joiner.worker_id} (update of round 6, {one} bytes)", synced
            assert one == u6.nbytes and one * 10 < full.nbytes, (one, full.nbytes)
            print(f"catch-up by 1 round: {one} bytes")
        finally:
            await close(m0, m1, j, k)


@pytest.mark.timeout(180)
async def test_a_donor_missing_an_update_refuses_and_the_state_is_downloaded() -> None:
    async with peers(3) as (d0, d1, joiner):
        s4 = base_state()
        m0, m1 = await worker(d0, s4, 4), await worker(d1, s4, 4)
        await commit_round([(d0, m0), (d1, m1)], 5)
        outs6 = await commit_round([(d0, m0), (d1, m1)], 6)
        h6 = outs6[0].state_hash
        # d0 holds round 6's update but not round 5's (as after a full download of round 5)
        m0.stateserver.withdraw()
        m0.stateserver.publish(CELL, 6, outs6[0].state, updates=[outs6[0].update])  # type: ignore[list-item]
        j = await worker(joiner, s4, 4)
        try:
            await j._sync(CELL, 6, h6, (donor(d0),))
            assert j.held is not None and (j.held.committed_round, j.held.state_hash) == (6, h6)
            [failed] = j.display.named("sync-donor-failed")  # type: ignore[attr-defined]
            assert failed["donor"] == "w0" and failed["lied"] is False
            assert failed["message"] == (
                f"catch-up by updates: refused: {CELL}: the update of round 5 is not held here (held: 6)"
            )
            [synced] = j.display.named("synced")  # type: ignore[attr-defined]
            full = len(outs6[0].state.to_safetensors())
            assert synced["source"] == f"donor w0 ({full} bytes)", synced  # the full download
            assert j.held.state.to_safetensors() == outs6[0].state.to_safetensors()
            assert m0.stateserver.update_bytes_served == 0
            # a worker that downloaded the whole state holds no update to serve
            assert j.stateserver.held_updates(CELL) == ()
        finally:
            await close(m0, m1, j)


def _lie(update: CommittedUpdate) -> CommittedUpdate:
    """The update with one code byte of its first part flipped, the codec's CRC and the part
    digest made to match: bytes that arrive intact and decode, but that no member applied."""
    buf = bytearray(update.parts[0])
    buf[len(buf) // 2] ^= 0x01
    buf[-4:] = struct.pack("<I", zlib.crc32(bytes(buf[:-4])))
    return CommittedUpdate.of(update.round, update.codec, update.part_numels, (bytes(buf), *update.parts[1:]))


@pytest.mark.timeout(180)
async def test_a_lying_donor_is_caught_by_the_hash_and_never_asked_again() -> None:
    async with peers(3) as (d0, d1, joiner):
        s4 = base_state()
        m0, m1 = await worker(d0, s4, 4), await worker(d1, s4, 4)
        outs5 = await commit_round([(d0, m0), (d1, m1)], 5)
        outs6 = await commit_round([(d0, m0), (d1, m1)], 6)
        h6, s6 = outs6[0].state_hash, outs6[0].state
        # d1 serves round 6's update with one byte flipped; d0 holds the state but no update
        m1.stateserver.withdraw()
        m1.stateserver.publish(CELL, 6, s6, updates=[outs5[1].update, _lie(outs6[1].update)])  # type: ignore[list-item,arg-type]
        m0.stateserver.withdraw()
        m0.stateserver.publish(CELL, 6, s6)
        j = await worker(joiner, s4, 4)
        before = j.held.state.to_safetensors()  # type: ignore[union-attr]
        try:
            await j._sync(CELL, 6, h6, (donor(d1), donor(d0)))
            failed = {f["donor"]: f for f in j.display.named("sync-donor-failed")}  # type: ignore[attr-defined]
            assert set(failed) == {"w0", "w1"}
            assert (
                failed["w1"]["lied"] is True and "the updates of rounds 5..6 give state hash" in failed["w1"]["message"]
            )
            assert (
                failed["w0"]["lied"] is False
                and "the updates of rounds 5, 6 are not held here (held: none)" in failed["w0"]["message"]
            )
            # the full download, from the honest donor only: the liar is not asked again
            [synced] = j.display.named("synced")  # type: ignore[attr-defined]
            assert synced["source"] == f"donor w0 ({len(s6.to_safetensors())} bytes)", synced
            assert m1.stateserver.bytes_served == m1.stateserver.update_bytes_served > 0
            assert (
                j.held is not None and j.held.state_hash == h6 and j.held.state.to_safetensors() == s6.to_safetensors()
            )
            assert before == s4.to_safetensors()  # what the joiner held was never touched
        finally:
            await close(m0, m1, j)


BF16_SPEC = parse_spec(SPEC.source + 'state_dtype = "bf16"\n')  # [sync] is the source's last table


@pytest.mark.timeout(180)
async def test_bf16_catch_up_by_updates_and_a_full_download_land_on_the_same_bytes() -> None:
    """On the bf16 grid (`[sync] state_dtype = "bf16"`), through the worker's own paths:
    members commit rounds 5 and 6 (the outer step rounds the new state onto the grid), a
    joiner holding round 4 catches up by the two rounds' updates, and a joiner holding
    nothing downloads the whole state. Both hold the members' exact bytes under the
    committed hash, in bf16, and the download is half the fp32 file."""
    assert BF16_SPEC.sync.state_dtype == "bf16" and BF16_SPEC.sync.catch_up_rounds == 2
    async with peers(4) as (d0, d1, catcher, fresh):
        s4 = base_state(torch.bfloat16)
        m0, m1 = await worker(d0, s4, 4, BF16_SPEC), await worker(d1, s4, 4, BF16_SPEC)
        await commit_round([(d0, m0), (d1, m1)], 5, BF16_SPEC)
        outs6 = await commit_round([(d0, m0), (d1, m1)], 6, BF16_SPEC)
        s6, h6 = outs6[0].state, outs6[0].state_hash
        assert s6.dtype == torch.bfloat16 and all(t.dtype == torch.bfloat16 for t in s6.to_flat().values())
        j = await worker(catcher, s4, 4, BF16_SPEC)
        k = await worker(fresh, None, 0, BF16_SPEC)
        try:
            await j._sync(CELL, 6, h6, (donor(d0),))
            await k._sync(CELL, 6, h6, (donor(d1),))
            [caught] = j.display.named("synced")  # type: ignore[attr-defined]
            [downloaded] = k.display.named("synced")  # type: ignore[attr-defined]
            assert "updates of rounds 5..6" in caught["source"], caught
            assert downloaded["source"] == f"donor w1 ({len(s6.to_safetensors())} bytes)", downloaded
            for o in (j, k):
                assert o.held is not None and (o.held.committed_round, o.held.state_hash) == (6, h6)
                assert o.held.state.dtype == torch.bfloat16
                assert o.held.state.to_safetensors() == s6.to_safetensors() == outs6[1].state.to_safetensors()
            assert len(s6.to_safetensors()) < 0.51 * len(base_state().to_safetensors())
        finally:
            await close(m0, m1, j, k)
