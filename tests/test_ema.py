"""The average of the committed weights (`[ema] decay`): bit-identical in every holder, part of
the hashed state, kept through a resync from a donor, a worker's resume from its local
checkpoint and a coordinator restart, and what `sample` and `export` read.

`tests/test_e2e.py` runs the same with real worker processes (its spec keeps an average):
three replicas' per-round checkpoints hold equal `ema.*` bytes, so does a late joiner's
after its sync, and the restarted coordinator's checkpoints.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from bagel.coordinator.committed import load_committed
from bagel.coordinator.daemon import start_coordinator
from bagel.models.experts import EMA_PREFIX, cell_state_schema, cell_task
from bagel.protocol.runspec import SpecError, parse_spec
from bagel.worker.diloco import CellState, OuterConfig, StateFormatError, ema_decay_at, outer_step
from bagel.worker.localstate import LocalCheckpoint, LocalStore
from bagel.worker.statesync import StateServer, fetch_state

from dataplane_peers import RUN_ID, peers, torch_shm_manager  # noqa: F401 (autouse fixture)
from simworkers import cluster_spec_text, start_workers, stop_workers, uniform_cells

DECAY = 0.9
SPEC = (
    cluster_spec_text("emarun", min_replicas=1, every_rounds=1, min_round_s=0.3, lease_s=15.0, heartbeat_s=0.5)
    .replace("clusters = 2", "clusters = 1")
    .replace("timestep_ranges = 2", "timestep_ranges = 1")
    .replace("router = true", "router = false")
    + f"\n[ema]\ndecay = {DECAY}\n"
)
CELL = "k0.r0"


def _model_state(rounds: int, seed: int = 0) -> CellState:
    """A real cell's initial state with an average, after `rounds` outer steps of seeded deltas."""
    spec = parse_spec(SPEC)
    state = CellState.from_model(cell_task(spec, CELL).build_model(), ema=True)
    g = torch.Generator().manual_seed(seed)
    cfg = OuterConfig.from_spec(spec.diloco, spec.ema)
    for r in range(1, rounds + 1):
        outer_step(state, {n: 0.01 * torch.randn(t.shape, generator=g) for n, t in state.weights.items()}, cfg, r)
    return state


def test_every_holder_keeps_the_same_average_bytes() -> None:
    spec = parse_spec(SPEC)
    cfg = OuterConfig.from_spec(spec.diloco, spec.ema)
    assert cfg.ema_decay == DECAY
    init = cell_task(spec, CELL).build_model()
    holders = [CellState.from_model(init, ema=True) for _ in range(3)]
    ref = {n: t.double() for n, t in holders[0].weights.items()}  # the average in float64, for the rule
    g = torch.Generator().manual_seed(1)
    for r in range(1, 6):
        delta = {n: 0.05 * torch.randn(t.shape, generator=g) for n, t in holders[0].weights.items()}
        for h in holders:
            outer_step(h, {n: d.clone() for n, d in delta.items()}, cfg, ema_step=r)
        d = ema_decay_at(DECAY, r)
        ref = {n: d * ref[n] + (1 - d) * holders[0].weights[n].double() for n in ref}
    blobs = {h.to_safetensors() for h in holders}
    assert len(blobs) == 1  # byte for byte, weights, momentum and average
    assert holders[0].ema is not None
    for n, e in holders[0].ema.items():
        assert torch.allclose(e.double(), ref[n], atol=1e-6), n
        assert not torch.equal(e, holders[0].weights[n]), n  # an average, not a copy of the weights
    # the warm-up: early rounds follow the weights closely, the cap holds later
    assert ema_decay_at(DECAY, 1) == pytest.approx(2 / 11) and ema_decay_at(DECAY, 1000) == DECAY
    # the average is hashed: a holder whose average differs reports another hash
    other = holders[1].clone()
    assert other.ema is not None
    first = sorted(other.ema)[0]
    other.ema[first].view(-1)[0] += 1e-3
    assert other.state_hash() != holders[0].state_hash()
    # and the checkpoint schema the coordinator checks uploads against names it
    schema = cell_state_schema(spec, CELL)
    assert {k for k in schema if k.startswith(EMA_PREFIX)} == {EMA_PREFIX + n for n in holders[0].weights}
    assert set(schema) == set(holders[0].to_flat())


def test_a_state_and_a_run_that_disagree_about_the_average_are_refused() -> None:
    spec = parse_spec(SPEC)
    with_avg = CellState.from_model(cell_task(spec, CELL).build_model(), ema=True)
    without = CellState(with_avg.weights)
    zero = {n: torch.zeros_like(t) for n, t in with_avg.weights.items()}
    with pytest.raises(StateFormatError, match="has none"):
        outer_step(without, zero, OuterConfig.from_spec(spec.diloco, spec.ema))
    with pytest.raises(StateFormatError, match="run has none"):
        outer_step(with_avg, zero, OuterConfig.from_spec(spec.diloco))
    flat = with_avg.to_flat()
    flat.pop(EMA_PREFIX + sorted(with_avg.weights)[0])
    with pytest.raises(StateFormatError, match="ema names differ"):
        CellState.from_flat(flat)
    with pytest.raises(SpecError, match=r"ema\.decay"):
        parse_spec(SPEC.replace(f"decay = {DECAY}", "decay = 1.0"))
    # off (the default): the state is weights and momentum only, as before
    assert parse_spec(SPEC.replace(f"decay = {DECAY}", "decay = 0")).ema.decay == 0
    assert not any(k.startswith(EMA_PREFIX) for k in cell_state_schema(parse_spec(cluster_spec_text()), CELL))


async def test_a_joiner_that_syncs_and_a_resumed_worker_hold_the_same_average(tmp_path: Path) -> None:
    state = _model_state(rounds=3)
    async with peers(2) as (donor, joiner):
        server = StateServer(donor.p2p, RUN_ID, chunk_nbytes=1 << 16)
        await server.start()
        try:
            want = server.publish(CELL, 3, state)
            got = await asyncio.wait_for(
                fetch_state(
                    joiner.p2p,
                    donor.plane.peer_id,
                    run_id=RUN_ID,
                    cell_id=CELL,
                    committed_round=3,
                    state_hash=want,
                    max_nbytes=64 << 20,
                    timeout_s=20.0,
                ),
                60,
            )
        finally:
            await server.close()
    assert got.state.ema is not None and state.ema is not None
    assert got.state.to_safetensors() == state.to_safetensors()  # the average's bytes included
    # a worker that restarts reads the same average back from its local checkpoint
    store = LocalStore(tmp_path, RUN_ID, "spec-hash")
    store.save(LocalCheckpoint(CELL, 3, got.state, want, {"x": torch.ones(2)}))
    back = store.load()
    assert back is not None and back.state_hash == want and back.state.ema is not None
    assert all(torch.equal(back.state.ema[n], state.ema[n]) for n in state.ema)
    assert set(back.residuals) == {"x"}  # error-feedback residuals ("e.") stay apart from the average ("ema.")


def _ema_states(base: dict[str, np.ndarray]):
    """Honest rounds' states: the weights nudged by a pure function of the round, and an average."""

    def state(cell_id: str, rnd: int, prev_hash: str, contributors: object) -> dict[str, np.ndarray]:
        seed = int.from_bytes(hashlib.sha256(f"{cell_id}|{rnd}|{prev_hash}".encode()).digest()[:8], "little")
        rng = np.random.default_rng(seed)
        flat = {}
        for n, w in base.items():
            flat["w." + n] = (w + 1e-3 * rng.standard_normal(w.shape)).astype(np.float32)
            flat["m." + n] = np.zeros_like(w)
            flat[EMA_PREFIX + n] = (w + 1e-4 * rng.standard_normal(w.shape)).astype(np.float32)
        return flat

    return state


@pytest.mark.timeout(120)
async def test_the_coordinator_keeps_the_average_through_a_restart_and_samples_it(tmp_path: Path) -> None:
    spec = parse_spec(SPEC)
    base = {n: p.detach().numpy().copy() for n, p in cell_task(spec, CELL).build_model().named_parameters()}
    data = tmp_path / "data"
    h = await start_coordinator(spec, data, cells=uniform_cells(spec.cell_ids), tick_ms=50)
    workers = await start_workers(f"127.0.0.1:{h.port}", spec.run.id, 2, cells=[CELL], state_fn=_ema_states(base))
    try:
        deadline = time.monotonic() + 60
        while not h.app.checkpoints.list(CELL):
            assert time.monotonic() < deadline, f"no checkpoint yet: {[w.stats.errors[-3:] for w in workers]}"
            await asyncio.sleep(0.1)
    finally:
        await stop_workers(workers)
        await h.stop()
    before = load_committed(data).cells[CELL]
    assert before.ema and before.manifest()["weights"] == "ema"
    h = await start_coordinator(spec, data, cells=uniform_cells(spec.cell_ids), tick_ms=50)  # the restart
    try:
        assert h.app.checkpoints.list(CELL), "the restarted coordinator lists no checkpoint"
        after = load_committed(data).cells[CELL]
        meta = [m for m in h.app.checkpoints.list(CELL) if m.round == after.round][0]
    finally:
        await h.stop()
    assert (after.round, after.state_hash, after.ema) == (before.round, before.state_hash, True)
    # what sample and export read is the stored checkpoint's average, byte for byte, not its weights
    flat = load_file(str(data / "checkpoints" / meta.path))  # the root committed.py reads too
    for n, t in after.weights.items():
        assert torch.equal(t, before.weights[n]) and torch.equal(t, flat[EMA_PREFIX + n]), n
        assert not torch.equal(t, flat["w." + n]), n
