"""Unit tests of the worker's parts: local checkpoint, display, round work, CLI, profile."""

from __future__ import annotations

import io
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import bagel.worker.profile as profile_module
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.cellmemory import MemoryBudget
from bagel.protocol.convert import instruction_from_pb
from bagel.worker import cli
from bagel.worker.diloco import CellState
from bagel.worker.display import Display, human_bytes
from bagel.worker.localstate import LocalCheckpoint, LocalStateError, LocalStore
from bagel.worker.profile import (
    BENCH_MICRO_BATCH,
    bench_micro_batches,
    benchmark_cell,
    cached_profile,
    device_name,
    host_memory_bytes,
    measure,
    memory_budget,
    memory_bytes,
    profile_key,
    read_memory,
)
from bagel.worker.roundwork import BYZANTINE_MODES, RoundWork, claimed, corrupt, fresh_feedback


def _state(seed: int = 0) -> CellState:
    g = torch.Generator().manual_seed(seed)
    return CellState({"a.weight": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g)})


# ---------------------------------------------------------------------------- local checkpoint


def test_local_checkpoint_round_trips_state_and_residuals(tmp_path: Path):
    store = LocalStore(tmp_path, "run", "spechash")
    assert store.load() is None
    st = _state()
    st.momentum["b"] += 1.5
    cp = LocalCheckpoint("k0.r0", 7, st, st.state_hash(), {"b": torch.full((5,), 0.25)})
    store.save(cp)
    back = store.load()
    assert back is not None
    assert (back.cell_id, back.committed_round, back.state_hash) == ("k0.r0", 7, st.state_hash())
    for k, v in st.to_flat().items():
        assert torch.equal(back.state.to_flat()[k], v)
    assert torch.equal(back.residuals["b"], torch.full((5,), 0.25))
    assert [p.name for p in store.path.parent.iterdir()] == ["local.safetensors"]  # no temp files left


def test_local_checkpoint_refuses_tampering_other_runs_and_garbage(tmp_path: Path):
    store = LocalStore(tmp_path, "run", "spechash")
    st = _state()
    store.save(LocalCheckpoint("k0.r0", 3, st, st.state_hash(), {}))
    with pytest.raises(LocalStateError, match="another run"):
        LocalStore(tmp_path, "run", "otherspec").load()
    raw = bytearray(store.path.read_bytes())
    raw[-1] ^= 0xFF  # flip a bit of the last tensor: the recorded hash no longer matches
    store.path.write_bytes(bytes(raw))
    with pytest.raises(LocalStateError, match="hash"):
        store.load()
    store.path.write_bytes(b"\x05\x00")
    with pytest.raises(LocalStateError):
        store.load()
    store.path.write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(LocalStateError):
        store.load()


# ---------------------------------------------------------------------------- display


def test_json_display_writes_one_object_per_line():
    out = io.StringIO()
    d = Display("json", stream=out)
    d.event("registered", worker_id="w1", cell="k0.r0")
    d.update(cell="k0.r0", round=3, step=1, steps=5, loss=float("nan"))
    d.event("exchange-failed", level="warning", message="x")
    recs = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["event"] for r in recs] == ["registered", "step", "exchange-failed"]
    assert recs[1]["loss"] is None and recs[1]["round"] == 3  # NaN is not JSON: null
    assert recs[2]["level"] == "warning"


def test_quiet_display_prints_only_warnings_and_errors():
    out, err = io.StringIO(), io.StringIO()
    d = Display("quiet", stream=out, err=err)
    d.event("registered", worker_id="w1")
    d.update(step=3, steps=5)
    d.event("coordinator-unreachable", level="warning", message="UNAVAILABLE")
    assert out.getvalue() == ""
    assert "coordinator-unreachable" in err.getvalue() and "registered" not in err.getvalue()


def test_plain_display_and_progress_line():
    out = io.StringIO()
    d = Display("auto", stream=out)  # not a TTY: plain lines
    assert d.mode == "plain"
    d.update(
        phase="training",
        cell="k0.r0",
        round=2,
        step=4,
        steps=10,
        loss=0.5,
        samples_per_s=120.0,
        exchange_sent=2_500_000,
        exchange_received=0,
        checkpoint_sent=203_600_000,
    )
    line = d.progress_line()
    assert "cell k0.r0 round 2" in line and "step 4/10" in line
    # exchange and checkpoint bytes apart: an upload does not count as exchange traffic
    assert "exchange sent 2.5 MB recv 0 B" in line and "checkpoints up 203.6 MB down 0 B" in line
    assert human_bytes(999) == "999 B" and human_bytes(1_200_000_000) == "1.2 GB"
    with pytest.raises(ValueError):
        Display("fancy")


# ---------------------------------------------------------------------------- round work


def _instruction(**kw) -> pb.Instruction:
    i = pb.Instruction(order=pb.ORDER_TRAIN, cell_id="k0.r0", round=4, round_attempt=2, committed_round=3)
    i.plan.inner_steps, i.plan.micro_batch, i.plan.grad_accum, i.plan.deadline_unix_ms = 5, 8, 2, 123
    for wid in ("wa", "wb", "wc"):
        i.plan.members.add(worker_id=wid, max_samples=80)
    for k, v in kw.items():
        setattr(i, k, v)
    return i


def test_round_work_from_an_instruction_and_for_catch_up():
    w = RoundWork.from_instruction(instruction_from_pb(_instruction()), 1)
    assert (w.cell_id, w.round, w.round_attempt, w.member_index, w.members) == ("k0.r0", 4, 2, 1, 3)
    # a late joiner (position 2 of 3, after 2 opening members) draws its shard as 2 of 3 too;
    # one admitted after it would draw as 3 of 4, with nobody's data moved
    late = instruction_from_pb(_instruction())
    late = replace(late, plan=replace(late.plan, late_from=1))
    assert [RoundWork.from_instruction(late, k).members for k in range(3)] == [1, 2, 3]
    assert (w.plan.inner_steps, w.plan.batch, w.plan.samples) == (5, 16, 80)
    assert w.catch_up is False and w.matches("k0.r0", 4, 2) and not w.matches("k0.r0", 4, 1)
    st = _state()
    c = RoundWork.for_catch_up(_instruction(), st)
    assert c.catch_up is True and c.result is not None and c.result.samples == 0
    assert c.delta is not None and all(torch.count_nonzero(t) == 0 for t in c.delta.values())
    assert set(c.delta) == set(st.weights)


def test_byzantine_corruptions():
    d = {"x": torch.tensor([1.0, -2.0])}
    prev = {"x": torch.tensor([5.0, 5.0])}
    assert torch.equal(corrupt(d, "sign-flip", None)["x"], torch.tensor([-1.0, 2.0]))
    assert torch.equal(corrupt(d, "scale", None)["x"], torch.tensor([100.0, -200.0]))
    assert torch.isnan(corrupt(d, "nan", None)["x"]).all()
    assert torch.equal(corrupt(d, "zero", None)["x"], torch.zeros(2))
    assert torch.equal(corrupt(d, "stale", prev)["x"], prev["x"])
    assert torch.equal(corrupt(d, "stale", None)["x"], torch.zeros(2))
    # alie: d - 1.5 |d|; ipm: -0.5 d (a lone worker's versions, robust/attacks.py)
    assert torch.equal(corrupt(d, "alie", None)["x"], torch.tensor([-0.5, -5.0]))
    assert torch.equal(corrupt(d, "ipm", None)["x"], torch.tensor([-0.5, 1.0]))
    first = {"x": torch.tensor([7.0, 7.0])}
    assert torch.equal(corrupt(d, "freeload-zero", None)["x"], torch.zeros(2))
    assert torch.equal(corrupt(d, "freeload-replay", prev, first)["x"], first["x"])
    assert torch.equal(corrupt(d, "freeload-replay", None, None)["x"], d["x"])  # its first round is honest
    assert torch.equal(corrupt(d, "budget-liar", prev)["x"], d["x"])  # it lies in its figures instead
    assert claimed("budget-liar", 320, 6_400) == (3_200, 640) and claimed("", 320, 6_400) == (320, 6_400)
    assert {
        "sign-flip",
        "scale",
        "nan",
        "zero",
        "stale",
        "freeload-zero",
        "freeload-replay",
        "budget-liar",
        "alie",
        "ipm",
        "bad-reducer",
    } <= set(BYZANTINE_MODES)
    assert torch.equal(corrupt(d, "bad-reducer", None)["x"], d["x"])  # it lies as a reducer instead
    with pytest.raises(ValueError, match="unknown byzantine"):
        corrupt(d, "evil", None)


def test_fresh_feedback_holds_the_committed_residuals():
    ef = fresh_feedback({"x": torch.tensor([0.5, -0.25])})
    assert torch.equal(ef.compensate("x", torch.ones(2)), torch.tensor([1.5, 0.75]))
    assert torch.equal(ef.compensate("y", torch.ones(2)), torch.ones(2))


# ---------------------------------------------------------------------------- CLI


def test_cli_validates_flags_and_hides_byzantine(capsys, tmp_path: Path):
    p = cli.build_parser()
    args = p.parse_args(
        ["join", "bagel1:x", "--throttle", "2.5", "--data-dir", str(tmp_path), "--byzantine", "sign-flip", "--log-json"]
    )
    cfg = cli.config_from_args(args)
    assert cfg.throttle == 2.5 and cfg.byzantine == "sign-flip" and cfg.data_dir == tmp_path
    assert cfg.dht_listen == ("/ip4/0.0.0.0/tcp/0",)
    with pytest.raises(ValueError, match="--throttle"):
        cli.config_from_args(p.parse_args(["join", "x", "--throttle", "0.5"]))
    with pytest.raises(ValueError, match="--max-vram-gb"):
        cli.config_from_args(p.parse_args(["join", "x", "--max-vram-gb", "0"]))
    with pytest.raises(ValueError, match="--max-ram-gb"):
        cli.config_from_args(p.parse_args(["join", "x", "--max-ram-gb", "-2"]))
    assert cli.config_from_args(p.parse_args(["join", "x", "--max-ram-gb", "48"])).max_ram_gb == 48.0
    with pytest.raises(SystemExit):
        p.parse_args(["join", "x", "--byzantine", "evil"])
    with pytest.raises(SystemExit):
        p.parse_args(["join", "x", "--quiet", "--log-json"])
    with pytest.raises(SystemExit):
        p.parse_args(["join", "--help"])
    help_text = capsys.readouterr().out
    assert "--throttle" in help_text and "--byzantine" not in help_text
    assert cli.main(["join", "not-a-join-string", "--data-dir", str(tmp_path)]) == 2
    assert "bagel1:" in capsys.readouterr().err


# ---------------------------------------------------------------------------- profile


class _Tiny:
    def build_model(self) -> nn.Module:
        torch.manual_seed(0)
        return nn.Linear(4, 1)

    def train_data(self):
        g = torch.Generator().manual_seed(0)
        return torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)

    def loss(self, model, x, y, generator):
        return ((model(x) - y) ** 2).mean()


class _Sized(_Tiny):
    """A task that records the micro-batch each training step sees."""

    def __init__(self, seen: list[int]) -> None:
        self.seen = seen

    def loss(self, model, x, y, generator):
        self.seen.append(int(x.shape[0]))
        return super().loss(model, x, y, generator)


def test_each_cell_is_measured_at_the_micro_batch_the_coordinator_plans_and_one_that_does_not_fit_is_not():
    seen: dict[str, list[int]] = {"big": [], "small": [], "none": []}
    mbs = {"big": 2, "small": 8, "none": 0}
    prof = measure("me", torch.device("cpu"), [(c, lambda c=c: _Sized(seen[c])) for c in mbs], micro_batches=mbs)
    assert set(prof.samples_per_s) == {"big", "small"} and all(v > 0 for v in prof.samples_per_s.values())
    assert seen["big"] and set(seen["big"]) == {2}
    assert seen["small"] and set(seen["small"]) == {8}
    assert seen["none"] == []  # never built, never stepped


def test_bench_micro_batches_follow_the_coordinators_rule_on_a_dit_xl_run():
    """A DiT-XL/2 expert needs 10.8 GiB on the card with one sample and 0.78 GiB for each
    further one, and 37.6 GiB on the host beside it: a 24 GiB card measures it at the
    micro-batch the coordinator plans it at (11) when its host has the RAM (or declares
    none), not at all beside 32 GiB of free RAM; a 12 GiB card not at all; on a CPU worker
    training and the host's share come out of one RAM. The small router fits them all."""
    from bagel.coordinator import sizing
    from bagel.protocol.cellmemory import MemoryBudget, fits, micro_batch_cap
    from bagel.protocol.runspec import parse_spec

    spec = parse_spec(
        '[run]\nid = "xl"\n[model]\narch = "dit"\npreset = "XL/2"\nimage_size = 32\nchannels = 3\n'
        "num_classes = 10\n[data]\nclusters = 2\n[cells]\ntimestep_ranges = 1\nrouter = true\n"
        "[diloco]\nmax_micro_batch = 32\n"
    )
    gib = 1 << 30
    r = BENCH_MICRO_BATCH
    assert bench_micro_batches(spec, MemoryBudget(24 * gib)) == {"k0.r0": 11, "k1.r0": 11, "router": r}
    assert bench_micro_batches(spec, MemoryBudget(24 * gib, 64 * gib)) == {"k0.r0": 11, "k1.r0": 11, "router": r}
    assert bench_micro_batches(spec, MemoryBudget(24 * gib, 32 * gib)) == {"k0.r0": 0, "k1.r0": 0, "router": r}
    assert bench_micro_batches(spec, MemoryBudget(12 * gib, 64 * gib)) == {"k0.r0": 0, "k1.r0": 0, "router": r}
    assert bench_micro_batches(spec, MemoryBudget(56 * gib, 0, True)) == {"k0.r0": 0, "k1.r0": 0, "router": r}
    assert bench_micro_batches(spec, MemoryBudget(80 * gib, 0, True))["k0.r0"] == 21
    assert bench_micro_batches(spec, MemoryBudget(80 * gib, 128 * gib))["k0.r0"] == min(32, r)
    # the coordinator's sizing of the same run agrees: the cells it gives a worker, at the same micro-batch
    configs = sizing.cell_configs(spec, sizes=[1, 1])
    h = spec.schedule.vram_headroom
    for budget in (
        MemoryBudget(16 * gib),
        MemoryBudget(24 * gib, 32 * gib),
        MemoryBudget(24 * gib, 64 * gib),
        MemoryBudget(40 * gib, 60 * gib),
        MemoryBudget(80 * gib, 128 * gib),
        MemoryBudget(70 * gib, 0, True),
        MemoryBudget(96 * gib, 0, True),
    ):
        mine = bench_micro_batches(spec, budget)
        for c in configs:
            if not fits(budget, c.memory_bytes, c.host_bytes, h):
                assert mine[c.cell_id] == 0
            else:
                top = spec.diloco.max_micro_batch
                planned = micro_batch_cap(budget, c.memory_bytes, c.sample_bytes, c.host_bytes, h, top)
                assert mine[c.cell_id] == min(BENCH_MICRO_BATCH, planned) > 0


def test_profile_measures_throughput_and_caps_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    cpu = torch.device("cpu")
    assert memory_bytes(cpu) > 0  # the machine's real MemAvailable, which moves between two reads
    monkeypatch.setattr(profile_module, "_mem_available", lambda: 8 << 30)  # so the caps are checked on a fixed one
    assert memory_bytes(cpu, 0.5) == 1 << 29
    assert memory_bytes(cpu) == 8 << 30 and memory_bytes(cpu, 1e9) == 8 << 30
    with pytest.raises(ValueError):
        memory_bytes(cpu, -1)
    # the host's RAM: the same MemAvailable, capped by --max-ram-gb; on a CPU it caps the device too
    assert host_memory_bytes() == 8 << 30 and host_memory_bytes(2.0) == 2 << 30
    assert memory_bytes(cpu, None, 2.0) == 2 << 30 and memory_bytes(cpu, 4.0, 2.0) == 2 << 30
    with pytest.raises(ValueError):
        host_memory_bytes(0.0)
    assert memory_budget(cpu, None, 2.0) == MemoryBudget(2 << 30, 0, True)  # one pool
    assert benchmark_cell(_Tiny(), cpu, micro_batch=8, steps=2) > 0
    prof = measure("me", cpu, [("c1", _Tiny), ("c2", _Tiny)], max_vram_gb=1.0, num_devices=2, uplink_mbps=80)
    assert set(prof.samples_per_s) == {"c1", "c2"} and all(v > 0 for v in prof.samples_per_s.values())
    assert prof.vram_bytes == 1 << 30 and prof.link_bandwidth_bytes_per_s == 10e6 and prof.num_devices == 2
    assert prof.host_memory_bytes == 8 << 30
    # cells of one model are measured once and share the figure; another model is measured too
    built: list[str] = []

    def counted(cell: str):  # noqa: ANN202
        def make() -> _Tiny:
            built.append(cell)
            return _Tiny()

        return make

    cells = ["k0.r0", "k0.r1", "k1.r0", "router"]
    same = {"k0.r0": "dit", "k0.r1": "dit", "k1.r0": "dit", "router": "router"}
    grouped = measure("me", cpu, [(c, counted(c)) for c in cells], same_model=same)
    assert built == ["k0.r0", "router"]
    sps = grouped.samples_per_s
    assert set(sps) == set(cells) and sps["k0.r0"] == sps["k0.r1"] == sps["k1.r0"] > 0 and sps["router"] > 0
    # the cache: same key -> the same profile back; another key or an old entry -> None
    import dataclasses
    import time

    mbs = {"c2": 16, "c1": 16, "c3": 0}  # c3: not measured (the memory does not hold it)
    key = profile_key(cpu, mbs, world=2, uplink_mbps=80, spec_hash="s", throttle=1.0)
    assert key == {"spec_hash": "s", "throttle": 1.0, "world": 2, "uplink_mbps": 80, "device": "cpu",
                   "device_name": device_name(cpu), "torch": torch.__version__,
                   "micro_batches": {"c1": 16, "c2": 16, "c3": 0}}  # fmt: skip
    assert json.loads(json.dumps(key)) == key  # what the file holds compares equal to a new key
    path = tmp_path / "profile.json"

    def write(*, at: float | None = None, **profile: Any) -> None:
        body = {**dataclasses.asdict(prof), **profile}
        path.write_text(json.dumps({"key": key, "measured_unix_s": time.time() if at is None else at, "profile": body}))

    write()
    back = cached_profile(path, key, "renamed", cpu, read_memory(cpu, 1.0))
    assert back is not None and back.samples_per_s == prof.samples_per_s and back.name == "renamed"
    assert (back.num_devices, back.link_bandwidth_bytes_per_s, back.device_name) == (2, 10e6, device_name(cpu))
    assert (back.vram_bytes, back.host_memory_bytes) == (1 << 30, 8 << 30)
    # the memory is this start's reading, never taken from the file: here the machine has less free now
    monkeypatch.setattr(profile_module, "_mem_available", lambda: 3 << 30)
    now = read_memory(cpu)
    back = cached_profile(path, key, "x", cpu, now)
    assert back is not None and back.vram_bytes == back.host_memory_bytes == 3 << 30
    # only the speeds come from the file: what else it says is not read
    write(device_kind="cuda", num_devices=64, link_bandwidth_bytes_per_s=1e12, vram_bytes=1 << 50)
    back = cached_profile(path, key, "x", cpu, now)
    assert back is not None and (back.device_kind, back.num_devices, back.vram_bytes) == ("cpu", 2, 3 << 30)
    # a start reads the memory once: the figures it sized its micro-batches by are the ones
    # declared, cached or measured, whatever MemAvailable says by the time the profile is built
    memory = read_memory(cpu, None, 2.0)
    assert memory == (2 << 30, 2 << 30) and MemoryBudget.of("cpu", *memory) == memory_budget(cpu, None, 2.0)
    monkeypatch.setattr(profile_module, "_mem_available", lambda: 1 << 30)
    back = cached_profile(path, key, "x", cpu, memory)
    assert back is not None and (back.vram_bytes, back.host_memory_bytes) == (2 << 30, 2 << 30)
    fresh = measure("me", cpu, [("c1", _Tiny)], memory=memory)
    assert (fresh.vram_bytes, fresh.host_memory_bytes) == (2 << 30, 2 << 30)
    assert measure("me", cpu, [("c1", _Tiny)]).vram_bytes == 1 << 30  # without it: read after the benchmark
    monkeypatch.setattr(profile_module, "_mem_available", lambda: 3 << 30)
    # anything the speed depends on, changed: measured again
    assert cached_profile(path, {**key, "throttle": 2.0}, "x", cpu, now) is None
    assert cached_profile(path, {**key, "device_name": "another card in the same slot"}, "x", cpu, now) is None
    other_mb = profile_key(cpu, {**mbs, "c1": 8}, world=2, uplink_mbps=80, spec_hash="s", throttle=1.0)
    assert cached_profile(path, other_mb, "x", cpu, now) is None
    # a damaged or edited file is measured again rather than sent (the coordinator would refuse it)
    for bad in ({"c1": 5.0}, {"c1": 5.0, "c2": 5.0, "c3": 5.0}, {"c1": 5.0, "c2": float("nan")},
                {"c1": 5.0, "c2": -1.0}, {"c1": 5.0, "c2": "fast"}, ["c1", "c2"], None):  # fmt: skip
        write(samples_per_s=bad)
        assert cached_profile(path, key, "x", cpu, now) is None, bad
    for at in (0.0, time.time() + 3600, float("nan")):  # too old, from the future, no time
        write(at=at)
        assert cached_profile(path, key, "x", cpu, now) is None, at
    path.write_text("not json")
    assert cached_profile(path, key, "x", cpu, now) is None
    path.write_text("[]")
    assert cached_profile(path, key, "x", cpu, now) is None
    assert os.path.exists(path)


def test_waiting_backoff_grows_is_capped_and_jittered() -> None:
    import random

    from bagel.worker import waiting

    rng = random.Random(0)
    delays = [waiting.delay_s(a, rng) for a in range(1, 12)]
    lo, hi = 1 - waiting.JITTER, 1 + waiting.JITTER
    for a, d in enumerate(delays, 1):
        base = min(waiting.MAX_DELAY_S, waiting.FIRST_DELAY_S * 2 ** (a - 1))
        assert base * lo <= d <= base * hi
    assert max(delays) <= waiting.MAX_DELAY_S * hi and len(set(delays)) == len(delays)


async def test_waiting_retry_shows_each_failure_and_stops_on_request() -> None:
    import asyncio
    import io

    from bagel.worker import waiting
    from bagel.worker.display import Display

    out = io.StringIO()
    display = Display("plain", stream=out, err=out)
    stop = asyncio.Event()
    calls = []

    async def step() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("no answer\nfrom the peer")
        return "up"

    waiting.FIRST_DELAY_S, saved = 0.01, waiting.FIRST_DELAY_S
    try:
        got = await waiting.retry(
            step,
            what=lambda e: "down" if isinstance(e, ConnectionError) else "?",
            hint="wait",
            retryable=(ConnectionError,),
            display=display,
            stop=stop,
        )
        assert got == "up" and len(calls) == 3
        lines = [ln for ln in out.getvalue().splitlines() if "waiting: down: from the peer; wait; retrying in" in ln]
        assert len(lines) == 2 and "(attempt 2)" in lines[1]

        async def never() -> str:
            raise ConnectionError("still down")

        stop_soon = asyncio.get_running_loop().call_later(0.05, stop.set)
        assert (
            await waiting.retry(never, what="d", hint="h", retryable=(ConnectionError,), display=display, stop=stop)
            is None
        )
        stop_soon.cancel()

        async def broken() -> str:
            raise KeyError("not retryable")

        stop.clear()
        with pytest.raises(KeyError):
            await waiting.retry(broken, what="d", hint="h", retryable=(ConnectionError,), display=display, stop=stop)
    finally:
        waiting.FIRST_DELAY_S = saved


def test_a_worker_that_holds_no_cell_says_which_memory_in_one_line():
    """The card, the host beside it, or a CPU's one RAM: the line names the one that is short."""
    from types import SimpleNamespace

    from bagel.protocol.runspec import parse_spec
    from bagel.worker.agent import Agent

    spec = parse_spec(
        '[run]\nid = "xl"\n[model]\narch = "dit"\npreset = "XL/2"\nimage_size = 32\nchannels = 3\n'
        "num_classes = 10\n[data]\nclusters = 1\n[cells]\ntimestep_ranges = 1\nrouter = false\n"
    )
    gib = 1 << 30

    def line(kind: str, budget: MemoryBudget, **caps: float) -> str:
        me = SimpleNamespace(
            device=torch.device(kind), cfg=SimpleNamespace(max_vram_gb=caps.get("vram"), max_ram_gb=caps.get("ram"))
        )
        assert not any(bench_micro_batches(spec, budget).values())
        text = Agent._holds_no_cell(me, spec, budget)  # type: ignore[arg-type]
        assert "\n" not in text
        return text

    card = line("cuda", MemoryBudget(8 * gib, 128 * gib), vram=8)
    assert "worker's memory (8.0 GiB, capped by --max-vram-gb)" in card and "10.8 GiB" in card
    host = line("cuda", MemoryBudget(24 * gib, 32 * gib))
    assert "host's free RAM (32.0 GiB)" in host and "37.6 GiB on the host" in host
    cpu = line("cpu", MemoryBudget(40 * gib, 0, True), ram=40)
    assert "cpu worker's free RAM (40.0 GiB, capped by --max-ram-gb)" in cpu and "48.5 GiB" in cpu
