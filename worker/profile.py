"""The worker's measured profile: device, memory budget, training throughput per cell, uplink.

The scheduler sizes each member's batch by throughput and only assigns cells that fit its
memory, so these numbers come from a measurement, not a guess:

- device and name: from torch (`cuda:N` or the CPU);
- memory: the GPU's total memory, or on CPU the `MemAvailable` of /proc/meminfo; capped by
  `--max-vram-gb` so a volunteer can keep part of the card for themselves; and the host's
  RAM beside a card (`MemAvailable`, capped by `--max-ram-gb`), which holds the committed
  states and the exchange's working copies (`bagel.protocol.cellmemory`). Read at each
  start, not cached: what else the machine runs changes it;
- samples/s per cell: a short benchmark of the real inner step (`InnerTrainer`, same loss,
  same autocast, the `--throttle` sleep included) on a few micro-batches, after one warmup
  step; a worker with N ranks reports N x its rank-0 figure; cells of one model config
  (all the experts of a run) share one measurement. The micro-batch is the one the
  coordinator will plan this worker at (`bench_micro_batches`: what its memory holds, by
  the coordinator's own rule in `bagel.protocol.cellmemory`, at most `BENCH_MICRO_BATCH`),
  so a card that holds a large expert only at a small micro-batch does not run out of
  memory measuring it; a cell its memory does not hold is not measured (the coordinator
  gives it no such cell);
- uplink bandwidth: measuring a real uplink needs a peer on the far side, and on loopback
  it would say gigabytes per second, which is no estimate of anything. We report
  `--uplink-mbps` (default 100 Mbit/s, a conservative figure for a home fibre/cable
  uplink), which the scheduler uses to predict communication time.

A measurement is cached in the data dir (`cached_profile`, written by the agent), so a
restart after a crash does not spend its first seconds re-benchmarking. It is reused only
under the same `profile_key` (the card, the torch build, the micro-batches, the settings),
and its memory figures are never reused.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bagel.protocol.cellmemory import MemoryBudget, fits, micro_batch_cap
from bagel.worker.trainer import CellTaskLike, InnerPlan, InnerTrainer, RoundKey

if TYPE_CHECKING:
    from bagel.protocol.runspec import RunSpec

DEFAULT_UPLINK_MBPS = 100.0
BENCH_MICRO_BATCH = 32
BENCH_STEPS = 3
PROFILE_MAX_AGE_S = 24 * 3600.0


@dataclass
class MeasuredProfile:
    """What this worker measured about itself; the agent sends it in Register as a
    `WorkerProfile` (the coordinator reads it as `bagel.protocol.messages.Profile`)."""

    name: str
    device_kind: str  # "cpu" | "cuda"
    device_name: str
    vram_bytes: int
    num_devices: int
    link_bandwidth_bytes_per_s: float
    samples_per_s: dict[str, float] = field(default_factory=dict)
    host_memory_bytes: int = 0  # RAM beside the device (on CPU: the same as vram_bytes)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


def memory_bytes(device: torch.device, max_vram_gb: float | None = None, max_ram_gb: float | None = None) -> int:
    """Usable accelerator memory (or RAM on CPU: `host_memory_bytes`), capped by
    `max_vram_gb` if given."""
    if device.type == "cuda":
        total = int(torch.cuda.get_device_properties(device).total_memory)
    else:
        total = host_memory_bytes(max_ram_gb)
    return _capped(total, max_vram_gb, "--max-vram-gb")


def host_memory_bytes(max_ram_gb: float | None = None) -> int:
    """The host RAM this worker may take: `MemAvailable` now, capped by `max_ram_gb` if given."""
    return _capped(_mem_available(), max_ram_gb, "--max-ram-gb")


def read_memory(
    device: torch.device, max_vram_gb: float | None = None, max_ram_gb: float | None = None
) -> tuple[int, int]:
    """(`memory_bytes`, `host_memory_bytes`) read now: what a profile declares as
    `vram_bytes` and `host_memory_bytes`. A start reads them once, sizes its micro-batches
    by them and declares the same figures (on a CPU worker both are `MemAvailable`, which
    moves with everything the machine runs, this worker's own benchmark included)."""
    return memory_bytes(device, max_vram_gb, max_ram_gb), host_memory_bytes(max_ram_gb)


def memory_budget(
    device: torch.device, max_vram_gb: float | None = None, max_ram_gb: float | None = None
) -> MemoryBudget:
    """What this worker declares of its memory (`WorkerProfile.vram_bytes` and `host_memory_bytes`)."""
    return MemoryBudget.of(device.type, *read_memory(device, max_vram_gb, max_ram_gb))


def _capped(total: int, cap_gb: float | None, flag: str) -> int:
    if cap_gb is None:
        return total
    if cap_gb <= 0:
        raise ValueError(f"{flag} must be positive, got {cap_gb}")
    return min(total, int(cap_gb * (1 << 30)))


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30  # no /proc: assume a modest 4 GiB


def benchmark_cell(
    task: CellTaskLike,
    device: torch.device,
    *,
    throttle: float = 1.0,
    micro_batch: int = BENCH_MICRO_BATCH,
    steps: int = BENCH_STEPS,
) -> float:
    """Samples/s of the real inner step of this cell's model on `device` (throttle included)."""
    model = task.build_model().to(device)
    trainer = InnerTrainer(task, model, device, lr=1e-4, throttle=throttle)
    n = trainer.num_train
    mb = max(1, min(micro_batch, n))
    plan = InnerPlan(inner_steps=1, micro_batch=mb, grad_accum=1)
    key = RoundKey("profile", "profile", 0, 0, 1)
    gen = torch.Generator().manual_seed(0)
    trainer.run(key, plan, torch.randint(0, n, (plan.samples,), generator=gen))  # warmup
    timed = InnerPlan(inner_steps=steps, micro_batch=mb, grad_accum=1)
    t0 = time.perf_counter()
    res = trainer.run(key, timed, torch.randint(0, n, (timed.samples,), generator=gen))
    elapsed = time.perf_counter() - t0
    del trainer, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res.samples / max(elapsed, 1e-9)


def bench_micro_batches(spec: RunSpec, budget: MemoryBudget) -> dict[str, int]:
    """{cell: the micro-batch to measure it at}: the largest the coordinator plans a worker
    with memory `budget` at (`micro_batch_cap` over the cell's memory with one sample, each
    further sample's activations and the host's share, as `coordinator/sizing.py` sizes
    them), at most `BENCH_MICRO_BATCH`; 0 for a cell that does not fit this memory at all."""
    from bagel.models.experts import cell_memory_sizes

    h, top = spec.schedule.vram_headroom, spec.diloco.max_micro_batch
    out = {}
    for c in spec.cell_ids:
        one, sample, host = cell_memory_sizes(spec, c)
        out[c] = (
            min(BENCH_MICRO_BATCH, micro_batch_cap(budget, one, sample, host, h, top))
            if fits(budget, one, host, h)
            else 0
        )
    return out


def measure(
    name: str,
    device: torch.device,
    tasks: Iterable[tuple[str, Callable[[], CellTaskLike]]],
    *,
    max_vram_gb: float | None = None,
    max_ram_gb: float | None = None,
    throttle: float = 1.0,
    num_devices: int = 1,
    uplink_mbps: float = DEFAULT_UPLINK_MBPS,
    same_model: Mapping[str, Hashable] | None = None,
    micro_batches: Mapping[str, int] | None = None,
    memory: tuple[int, int] | None = None,
) -> MeasuredProfile:
    """Profile this worker for every (cell_id, task factory) given.

    `same_model` maps a cell to what decides its step time (its model config: the inputs
    have the run's one shape); cells with equal keys are measured once and share the
    figure. A run of 256 expert cells of one architecture then costs one measurement
    instead of 256, and its experts are not ranked by the noise between measurements.
    `micro_batches` (`bench_micro_batches`) gives the micro-batch to measure each cell at;
    a cell at 0 is not measured and gets no figure. Without it, every cell is measured at
    `BENCH_MICRO_BATCH`. `memory` is (`memory_bytes`, `host_memory_bytes`) as read once
    by the caller, who sized the micro-batches by it (`read_memory`); without it they are
    read after the benchmark, when on a CPU worker its own freed buffers may still be held.
    """
    if uplink_mbps <= 0:
        raise ValueError(f"--uplink-mbps must be positive, got {uplink_mbps}")
    measured: dict[Hashable, float] = {}
    sps: dict[str, float] = {}
    for cell, make in tasks:
        mb = BENCH_MICRO_BATCH if micro_batches is None else micro_batches.get(cell, BENCH_MICRO_BATCH)
        if mb <= 0:
            continue
        model: Hashable = same_model[cell] if same_model is not None and cell in same_model else ("cell", cell)
        key = (model, mb)
        if key not in measured:
            measured[key] = benchmark_cell(make(), device, throttle=throttle, micro_batch=mb) * num_devices
        sps[cell] = measured[key]
    vram, host = memory if memory is not None else read_memory(device, max_vram_gb, max_ram_gb)
    return MeasuredProfile(
        name=name,
        device_kind=device.type,
        device_name=device_name(device),
        vram_bytes=vram,
        num_devices=num_devices,
        link_bandwidth_bytes_per_s=uplink_mbps * 1e6 / 8,
        samples_per_s=sps,
        host_memory_bytes=host,
    )


def cached_profile(
    path: Path,
    key: dict[str, Any],
    name: str,
    device: torch.device,
    memory: tuple[int, int],
) -> MeasuredProfile | None:
    """A profile measured earlier under the same key (`profile_key`), or None.

    Only the measured speeds and their time come from the file, and they are checked: a
    positive finite figure for exactly the cells the key's micro-batches measure, taken in
    the last `PROFILE_MAX_AGE_S` by this clock. Anything else in the file is not trusted:
    a damaged or edited file that the coordinator would refuse must not stop every start
    for a day. The rest comes from the key, and the memory figures are this start's
    (`memory`: `read_memory`, by which the key's micro-batches were sized), because what
    else the machine runs changes them (on a CPU worker both are `MemAvailable`)."""
    try:
        body = json.loads(path.read_text())
        age_s = time.time() - float(body["measured_unix_s"])
        if body.get("key") != key or not 0.0 <= age_s <= PROFILE_MAX_AGE_S:
            return None
        raw = body["profile"]["samples_per_s"]
        sps = {str(c): float(v) for c, v in raw.items()}
        measured = {c for c, mb in key["micro_batches"].items() if mb > 0}
        if set(sps) != measured or not all(math.isfinite(v) and v > 0 for v in sps.values()):
            return None
        vram, host = memory
        return MeasuredProfile(
            name=name,
            device_kind=device.type,
            device_name=str(key["device_name"]),
            vram_bytes=vram,
            num_devices=int(key["world"]),
            link_bandwidth_bytes_per_s=float(key["uplink_mbps"]) * 1e6 / 8,
            samples_per_s=sps,
            host_memory_bytes=host,
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def profile_key(
    device: torch.device, micro_batches: Mapping[str, int], *, world: int, uplink_mbps: float, **settings: Any
) -> dict[str, Any]:
    """What a cached measurement must match to be reused: the caller's settings (run spec,
    throttle, caps, ...), the world size and uplink the profile reports, the card itself
    (by name: `cuda:0` is whichever card sits in the slot), the torch build (its kernels set
    the step time) and the micro-batch each cell was measured at (it follows the memory
    free at the start, so a start with much less free memory measures again)."""
    return {
        **settings,
        "world": world,
        "uplink_mbps": uplink_mbps,
        "device": str(device),
        "device_name": device_name(device),
        "torch": torch.__version__,
        "micro_batches": dict(sorted(micro_batches.items())),
    }
