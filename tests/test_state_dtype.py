"""The committed state's dtype (`[sync] state_dtype`).

fp32 (the default) must be exactly the format it always was: the same safetensors bytes and
the same state hashes, pinned below from a state computed before the key existed. bf16 and
fp16 put the committed state on that grid: the rounding must be a function of the fp32 bits
alone (checked against references that share no code with torch's cast), every path to a
committed state (a fresh build, a download, a local checkpoint, an outer step, the
coordinator's checkpoint) must give the same bytes, and a file in another dtype is refused.
The network paths (a download from donors, a catch-up by updates) are in
tests/test_statesync.py and tests/test_statesync_updates.py.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from bagel.models.experts import cell_task
from bagel.protocol.runspec import RunSpec, SpecError, load_spec, parse_spec
from bagel.worker.diloco import (
    CellState,
    OuterConfig,
    StateFormatError,
    ema_decay_at,
    outer_step,
    pseudo_gradient,
    state_dtype,
    to_state_dtype,
)
from bagel.worker.localstate import LocalCheckpoint, LocalStore
from bagel.worker.statesync import StateIntegrityError, verify_state_bytes

SHAPES = {"blk.bias": (6,), "blk.weight": (6, 5), "head.weight": (3, 6)}

# sha256 of the canonical state hash and of the safetensors file of `pinned_state()`, before
# and after two outer steps, computed with the code as it was before `state_dtype` existed
PINNED_INITIAL = (
    "26ad870f57dfad149541f4e00f03092884f6300099103d4aceb023c61ce158d5",
    "96d0639803a861b0d755cb7d8c64e3c24c1cdd4177d169f2060cb033c925e97a",
)
PINNED_STEPPED = (
    "2865b468bc70ede1cbbcb72c7a6704c6f6782d68872a7f19e83e26cea6f475a8",
    "201cc97dc9cb1302c905a71dfc659bb4dbb743939513ed828ab9f7e3dc7360b2",
)


def ramp(shape: tuple[int, ...], salt: int) -> torch.Tensor:
    """Fixed float32 values from integer arithmetic and one IEEE multiply (no random generator,
    no transcendental function), so they are the same bytes on any machine."""
    n = 1
    for s in shape:
        n *= s
    i = torch.arange(n, dtype=torch.int64)
    v = ((i * 2654435761 + salt * 40503) % 2**20 - 2**19).to(torch.float32)
    return (v * 3e-7).reshape(shape)


def pinned_weights() -> dict[str, torch.Tensor]:
    return {k: ramp(s, j) for j, (k, s) in enumerate(sorted(SHAPES.items()))}


def pinned_delta(rnd: int) -> dict[str, torch.Tensor]:
    return {k: ramp(s, 10 * rnd + j) * 0.01 for j, (k, s) in enumerate(sorted(SHAPES.items()))}


def fingerprint(state: CellState) -> tuple[str, str]:
    return state.state_hash(), hashlib.sha256(state.to_safetensors()).hexdigest()


def test_fp32_state_keeps_the_hashes_and_bytes_it_had() -> None:
    w = pinned_weights()
    state = CellState(w, None, w)
    assert fingerprint(state) == PINNED_INITIAL
    for rnd in (1, 2):
        outer_step(state, pinned_delta(rnd), OuterConfig(ema_decay=0.9), ema_step=rnd)
    assert fingerprint(state) == PINNED_STEPPED


# ---------------------------------------------------------------- rounding onto the grid


def bf16_reference(x: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16 to nearest, ties to even, by integer arithmetic on the bits alone
    (no float operation, no cast kernel): the top 16 bits after adding 0x7FFF plus the lowest
    kept bit. Finite inputs only (as a state's are)."""
    u = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = torch.where(r >= 0x8000, r - 0x10000, r)
    return r.to(torch.int16).view(torch.bfloat16)


def fp16_reference(x: torch.Tensor) -> torch.Tensor:
    """float32 -> float16 by numpy's own IEEE conversion (to nearest, ties to even)."""
    return torch.from_numpy(x.numpy().astype(np.float16))


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def awkward_float32(n: int, lo: float, hi: float, seed: int) -> torch.Tensor:
    """Values of both signs across magnitudes 10^lo..10^hi, plus exact ties of the grids:
    float32 bit patterns whose dropped bits are exactly half (bf16: low 16 bits 0x8000,
    fp16: low 13 bits 0x1000), with the lowest kept bit even and odd."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.pow(10.0, lo + (hi - lo) * torch.rand(n, generator=g, dtype=torch.float64)).to(torch.float32)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    x = mag * sign
    raw = x.view(torch.int32)
    ties = torch.cat([(raw & ~0xFFFF) | 0x8000, (raw & ~0x1FFF) | 0x1000, ((raw & ~0x1FFF) | 0x1000) ^ 0x2000])
    return torch.cat([x, ties.view(torch.float32), torch.tensor([0.0, -0.0, 1.0, -1.0])])


def test_bf16_rounding_is_the_bitwise_nearest_even() -> None:
    """torch's CPU cast, which `to_state_dtype` uses, agrees with the integer reference on
    normals, float32 subnormals (bf16 keeps fp32's exponent range) and exact ties."""
    x = awkward_float32(200_000, -44, 38, seed=1)
    got = to_state_dtype(x, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and bits(got) == bits(bf16_reference(x))


def test_fp16_rounding_is_the_ieee_nearest_even() -> None:
    """Within float16's range, subnormals (under 6e-5) and exact ties included, torch's cast
    and numpy's conversion give the same bits."""
    x = awkward_float32(200_000, -9, 4.8, seed=2)
    x = x[x.abs() < 65504]
    got = to_state_dtype(x, torch.float16)
    assert got.dtype == torch.float16 and bits(got) == bits(fp16_reference(x))


def test_to_state_dtype_copies_and_refuses_float16_overflow() -> None:
    x = torch.ones(4)
    y = to_state_dtype(x, torch.float32)
    y[0] = 5.0
    assert float(x[0]) == 1.0  # a copy, never the caller's tensor
    with pytest.raises(StateFormatError, match="beyond float16's range"):
        to_state_dtype(torch.tensor([1.0, 70000.0]), torch.float16, "weight 'a'")
    assert bits(to_state_dtype(torch.tensor([65504.0]), torch.float16)) == bits(torch.tensor([65504.0]).half())


def reference_outer_step(
    w: np.ndarray, m: np.ndarray, e: np.ndarray, g: np.ndarray, cfg: OuterConfig, step: int, round_to
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The outer step written again in numpy float32 (one IEEE operation per expression, the
    order `outer_step` documents), the new state rounded by `round_to`."""
    f = np.float32
    buf = m * f(cfg.momentum) + g
    update = (buf * f(cfg.momentum) + g) * f(cfg.lr)
    w_new = round_to(w - update)
    keep = ema_decay_at(cfg.ema_decay, step)
    e_new = round_to(e * f(keep) + w_new * f(1.0 - keep))
    return w_new, round_to(buf), e_new


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_outer_step_on_the_grid_equals_an_independent_reference(dtype: torch.dtype) -> None:
    """Two independent paths to the same committed state: `outer_step` on a half-precision
    state, and the step in numpy float32 on its exact upcast, rounded by the reference
    rounding. Byte for byte, for three rounds in a row (the average included)."""
    ref_round = bf16_reference if dtype == torch.bfloat16 else fp16_reference

    def round_to(a: np.ndarray) -> np.ndarray:
        return ref_round(torch.from_numpy(np.ascontiguousarray(a, np.float32))).float().numpy()

    cfg = OuterConfig(lr=0.7, momentum=0.9, ema_decay=0.9)
    w0 = {n: ramp(s, j) * 100 for j, (n, s) in enumerate(sorted(SHAPES.items()))}
    state = CellState(w0, None, w0, dtype=dtype)
    ref = {n: (state.weights[n].float().numpy(), np.zeros(s, np.float32), state.ema[n].float().numpy())  # type: ignore[index]
           for n, s in SHAPES.items()}  # fmt: skip
    for rnd in (1, 2, 3):
        delta = {n: d * 1000 for n, d in pinned_delta(rnd).items()}
        outer_step(state, delta, cfg, ema_step=rnd)
        ref = {n: reference_outer_step(*ref[n], delta[n].numpy(), cfg, rnd, round_to) for n in SHAPES}
        assert state.dtype == dtype
        for n in SHAPES:
            w, m, e = ref[n]
            assert state.weights[n].dtype == state.momentum[n].dtype == state.ema[n].dtype == dtype  # type: ignore[index]
            assert bits(state.weights[n].float()) == w.tobytes()
            assert bits(state.momentum[n].float()) == m.tobytes()
            assert bits(state.ema[n].float()) == e.tobytes()  # type: ignore[index]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_replicas_on_the_grid_stay_bit_identical(dtype: torch.dtype) -> None:
    """A member that built the initial state from the model, one that downloaded its file and
    one that resumed from a flat copy apply the same updates and hold the same bytes; the
    state is half the size of the fp32 one, and training sees its exact upcast."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    built = CellState.from_model(model, ema=True, dtype=dtype)
    fp32 = CellState.from_model(model, ema=True)
    downloaded = CellState.from_safetensors(built.to_safetensors(), dtype=dtype)
    resumed = CellState.from_flat({k: v.clone() for k, v in built.to_flat().items()}, dtype=dtype)
    cfg = OuterConfig(ema_decay=0.9)
    for rnd in (1, 2, 3):
        g = torch.Generator().manual_seed(rnd)
        delta = {n: 0.01 * torch.randn(t.shape, generator=g) for n, t in built.weights.items()}
        for s in (built, downloaded, resumed):
            outer_step(s, delta, cfg, ema_step=rnd)
    assert built.state_hash() == downloaded.state_hash() == resumed.state_hash()
    assert built.to_safetensors() == downloaded.to_safetensors() == resumed.to_safetensors()
    assert built.nbytes() * 2 == fp32.nbytes()
    assert len(built.to_safetensors()) < 0.55 * len(fp32.to_safetensors())
    # the model trains from the exact float32 value of the grid state
    built.load_into(model)
    assert all(torch.equal(p.detach(), built.weights[n].float()) for n, p in model.named_parameters())
    delta = pseudo_gradient(built.weights, model.named_parameters())
    assert all(d.dtype == torch.float32 and not d.any() for d in delta.values())


def test_a_state_in_another_dtype_is_refused_not_cast() -> None:
    w = pinned_weights()
    bf = CellState(w, None, None, dtype=torch.bfloat16)
    with pytest.raises(StateFormatError, match="is bfloat16, expected float32"):
        CellState.from_safetensors(bf.to_safetensors())
    with pytest.raises(StateFormatError, match="is float32, expected bfloat16"):
        CellState.from_safetensors(CellState(w).to_safetensors(), dtype=torch.bfloat16)
    with pytest.raises(StateFormatError, match="'m.blk.bias' is float32, expected bfloat16"):  # a mixed file
        CellState.from_flat({**bf.to_flat(), "m.blk.bias": torch.zeros(6)}, dtype=torch.bfloat16)
    with pytest.raises(StateFormatError, match="not float64"):
        CellState(w, dtype=torch.float64)
    # the joiner's check: the dtype is named before the hash is even looked at
    with pytest.raises(StateIntegrityError, match="expected float32"):
        verify_state_bytes(bf.to_safetensors(), bf.state_hash())
    assert verify_state_bytes(bf.to_safetensors(), bf.state_hash(), torch.bfloat16).state_hash() == bf.state_hash()


def test_a_local_checkpoint_keeps_its_state_dtype(tmp_path) -> None:
    w = pinned_weights()
    state = CellState(w, None, w, dtype=torch.float16)
    store = LocalStore(tmp_path, "run", "spechash")
    store.save(LocalCheckpoint("k0.r0", 3, state, state.state_hash(), {"blk.bias": torch.ones(6)}))
    cp = store.load()
    assert cp is not None and cp.state.dtype == torch.float16 and cp.state_hash == state.state_hash()
    assert cp.state.to_safetensors() == state.to_safetensors() and cp.residuals["blk.bias"].dtype == torch.float32


# ---------------------------------------------------------------- the run spec and what follows it


def spec_with(sync: str = "", ema: bool = False) -> RunSpec:
    text = '[run]\nid = "dtype"\n[model]\npreset = "tiny"\n'
    if sync:
        text += f"[sync]\n{sync}\n"
    if ema:
        text += "[ema]\ndecay = 0.9\n"
    return parse_spec(text)


def test_spec_key_default_values_and_errors() -> None:
    assert spec_with().sync.state_dtype == "fp32"
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        spec = spec_with(f'state_dtype = "{name}"')
        assert spec.sync.state_dtype == name and state_dtype(spec) == dtype
    assert state_dtype(object()) == torch.float32  # a test double without [sync]
    for bad, named in (('"fp8"', "'fp8'"), ('"BF16"', "'BF16'"), ('"float16"', "'float16'"), ("16", "16")):
        with pytest.raises(SpecError) as e:
            spec_with(f"state_dtype = {bad}")
        assert str(e.value) == f"sync.state_dtype: {named} is not one of ['fp32', 'bf16', 'fp16']"
    # a different state dtype is a different run
    assert spec_with('state_dtype = "bf16"').spec_hash != spec_with().spec_hash


def test_checkpoint_schema_and_bound_follow_the_state_dtype() -> None:
    from bagel.coordinator.sizing import CHECKPOINT_HEADER_SLACK_BYTES, checkpoint_bytes_bound
    from bagel.models.experts import cell_state_schema

    for ema in (False, True):
        fp32, bf16, fp16 = (spec_with(f'state_dtype = "{d}"', ema) for d in ("fp32", "bf16", "fp16"))
        s32, s16 = cell_state_schema(fp32, "k0.r0"), cell_state_schema(bf16, "k0.r0")
        assert {k: shape for k, (_, shape) in s32.items()} == {k: shape for k, (_, shape) in s16.items()}
        assert {dt for dt, _ in s32.values()} == {"F32"} and {dt for dt, _ in s16.values()} == {"BF16"}
        assert {dt for dt, _ in cell_state_schema(fp16, "k0.r0").values()} == {"F16"}
        b32 = checkpoint_bytes_bound(fp32, "k0.r0") - CHECKPOINT_HEADER_SLACK_BYTES
        assert b32 == 2 * (checkpoint_bytes_bound(bf16, "k0.r0") - CHECKPOINT_HEADER_SLACK_BYTES)
        assert b32 == 2 * (checkpoint_bytes_bound(fp16, "k0.r0") - CHECKPOINT_HEADER_SLACK_BYTES)


def test_the_coordinator_stores_a_grid_checkpoint_and_refuses_one_in_another_dtype(tmp_path) -> None:
    """A bf16 run's checkpoint: the worker's file is stored and hashes to the worker's state
    hash; the same state in fp32 (or fp16) is refused by the schema, not cast."""
    from functools import partial

    from bagel.coordinator.checkpoints import CheckpointRejected, CheckpointStore
    from bagel.coordinator.store import Store
    from bagel.models.experts import cell_state_schema, cell_task

    spec = spec_with('state_dtype = "bf16"', ema=True)
    model = cell_task(spec, "k0.r0").build_model()
    state = CellState.from_model(model, ema=True, dtype=state_dtype(spec))
    store = Store.open(tmp_path)
    try:
        schema = partial(cell_state_schema, spec)
        cs = CheckpointStore(tmp_path / "ck", store, keep=2, max_bytes=64 << 20, schema=schema)
        for other in (torch.float32, torch.float16):
            wrong = CellState.from_model(model, ema=True, dtype=other)
            data = wrong.to_safetensors()
            up = cs.begin_upload("k0.r0", 1, wrong.state_hash(), len(data), hashlib.sha256(data).hexdigest())
            up.write(data)
            with pytest.raises(CheckpointRejected, match="the cell's model has BF16"):
                up.finish(now_ms=1)
        data = state.to_safetensors()
        up = cs.begin_upload("k0.r0", 1, state.state_hash(), len(data), hashlib.sha256(data).hexdigest())
        up.write(data)
        meta = up.finish(now_ms=1)
        assert meta.state_hash == state.state_hash()
        # a joiner falling back to the checkpoint adopts exactly the committed state
        back = verify_state_bytes(cs.read_verified(meta), state.state_hash(), torch.bfloat16)
        assert back.to_flat().keys() == state.to_flat().keys()
        assert all(torch.equal(back.to_flat()[k], v) for k, v in state.to_flat().items())
    finally:
        store.close()


def test_round0_from_init_weights_is_rounded_onto_the_grid(tmp_path) -> None:
    """`[model] init_from` weights reach the round-0 state through the same rounding as a
    fresh initialisation: every member's initial state is the rounded weights, bit for bit."""
    from safetensors.torch import save_file

    fresh = cell_task(spec_with(), "k0.r0").build_model()
    init = {n: p.detach() * 1.5 + 0.001 for n, p in fresh.named_parameters() if p.requires_grad}
    save_file(init, str(tmp_path / "init.safetensors"))
    text = '[run]\nid = "dtype"\n[model]\npreset = "tiny"\ninit_from = "init.safetensors"\n'
    (tmp_path / "run.toml").write_text(text + '[sync]\nstate_dtype = "bf16"\n')
    spec = load_spec(tmp_path / "run.toml")
    a = CellState.from_model(cell_task(spec, "k0.r0").build_model(), dtype=state_dtype(spec))
    b = CellState.from_model(cell_task(spec, "k0.r0").build_model(), dtype=state_dtype(spec))
    assert a.state_hash() == b.state_hash() and a.dtype == torch.bfloat16
    for n, w in init.items():
        assert bits(a.weights[n]) == bits(bf16_reference(w))


def test_sim_state_bytes_follow_the_run_spec() -> None:
    from bagel.sim.discrete import costmodel as cm
    from bagel.sim.discrete.scenario import load_sim_scenario, parse_sim_scenario

    def scenario(sync: str, ema: str = "", workload: str = "") -> cm.WorkloadSpec:
        text = f'[scenario]\nname = "t"\n[run_spec.run]\nid = "t"\n[run_spec.sync]\n{sync}\n{ema}\n{workload}\n'
        return parse_sim_scenario(text).workload

    assert scenario("").state_bytes_per_param == 8.0 == cm.WorkloadSpec().state_bytes_per_param
    assert scenario('state_dtype = "bf16"').state_bytes_per_param == 4.0
    assert scenario('state_dtype = "fp16"', "[run_spec.ema]\ndecay = 0.9").state_bytes_per_param == 6.0
    assert scenario("", "[run_spec.ema]\ndecay = 0.9").state_bytes_per_param == 12.0
    # a scenario that sets the figure keeps it
    explicit = scenario('state_dtype = "bf16"', workload="[workload]\nstate_bytes_per_param = 7.5")
    assert explicit.state_bytes_per_param == 7.5
    work = scenario('state_dtype = "bf16"')
    assert cm.cell_state_bytes(work, "k0.r0") * 2 == cm.cell_state_bytes(cm.WorkloadSpec(), "k0.r0")
    # the shipped scenarios' run spec is fp32 without an average: their figure is unchanged
    shipped = load_sim_scenario(Path(__file__).parent.parent / "sim" / "scenarios" / "heterogeneity-10x.toml")
    assert shipped.workload.state_bytes_per_param == 8.0


@pytest.mark.timeout(120)
async def test_the_coordinator_keeps_and_samples_a_half_precision_run(tmp_path: Path) -> None:
    """A real coordinator of an fp16 run: its workers' fp16 checkpoints pass the daemon's
    schema check, and `sample`/`export` read back the committed fp16 weights into a model."""
    import asyncio
    import time

    from bagel.coordinator.committed import load_committed
    from bagel.coordinator.daemon import start_coordinator

    from simworkers import cluster_spec_text, start_workers, stop_workers, uniform_cells

    text = (
        cluster_spec_text("halfrun", min_replicas=1, every_rounds=1, min_round_s=0.3, lease_s=15.0, heartbeat_s=0.5)
        .replace("clusters = 2", "clusters = 1")
        .replace("timestep_ranges = 2", "timestep_ranges = 1")
        .replace("router = true", "router = false")
        + '\n[sync]\nstate_dtype = "fp16"\n'
    )
    spec = parse_spec(text)
    cell = "k0.r0"
    base = CellState.from_model(cell_task(spec, cell).build_model(), dtype=state_dtype(spec))

    def states(cell_id: str, rnd: int, prev_hash: str, contributors: object) -> dict[str, np.ndarray]:
        nudge = np.float16(1e-3 * (rnd % 7 + 1))
        return {k: (v.numpy() + nudge).astype(np.float16) for k, v in base.to_flat().items()}

    data = tmp_path / "data"
    h = await start_coordinator(spec, data, cells=uniform_cells(spec.cell_ids), tick_ms=50)
    workers = await start_workers(f"127.0.0.1:{h.port}", spec.run.id, 2, cells=[cell], state_fn=states)
    try:
        deadline = time.monotonic() + 60
        while not h.app.checkpoints.list(cell):
            assert time.monotonic() < deadline, f"no checkpoint yet: {[w.stats.errors[-3:] for w in workers]}"
            await asyncio.sleep(0.1)
    finally:
        await stop_workers(workers)
        await h.stop()
    got = load_committed(data).cells[cell]
    assert {t.dtype for t in got.weights.values()} == {torch.float16}
    model = got.model()
    assert all(torch.equal(p.detach(), got.weights[n].float()) for n, p in model.named_parameters())
