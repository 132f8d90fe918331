"""Cost model: how long compute, all-reduce and state download take for a synthetic worker.

Pure functions of the workload, the codec and the workers' links; the engine asks them for
durations and never measures anything.

Compute
    A worker's training throughput on a cell is `tflops x mfu x 1e12 / flops_per_sample`
    (training FLOPs per sample: forward + backward, about 3x the forward FLOPs). A round of
    H inner steps at `micro_batch x grad_accum` samples per step takes
    `H x micro_batch x grad_accum / samples_per_s`.

Communication
    Bagel's data plane (`worker/averaging.py`) is a butterfly all-reduce: the vector is cut
    into k contiguous parts for k contributors, sized by the coordinator's part weights
    (`robust.reduction.part_bounds`; equal when nothing is measured); in the reduce-scatter
    each contributor uploads the k - 1 parts it does not reduce, in the all-gather it
    uploads its reduced part (S_i bytes) to the k - 1 others, so it uploads
    S - S_i + (k - 1) S_i bytes and downloads as many (the others' contributions to its
    part, then the other averaged parts). The exchange takes the longest of each
    contributor's upload over its uplink and download over its downlink
    (`weighted_allreduce_s`; the population samples one link rate per worker, used both
    ways); with equal parts that is 2 (k - 1)/k x S over the slowest link. Each of the two
    phases also pays the largest one-way latency in the group. S is the codec's encoded
    size of the cell's parameter vector: `bagel.compression`'s
    `get_codec(name).encoded_nbytes(numel)` when that module provides it, otherwise the
    documented bytes per value below.

Join / resync
    The committed state (weights + outer momentum, and the average with `[ema]`, in the run
    spec's `[sync] state_dtype`: 8 bytes per parameter in fp32, 4 in bf16 or fp16;
    `state_bytes_per_param`, which a scenario's `[workload]` takes from its run spec unless
    it sets the figure itself) travels
    from the donors to the joiner, as the real worker fetches it (`worker/statesync.py`):
    each of the k donors the coordinator names sends a share proportional to its bandwidth,
    so all finish together, and the joiner's downlink or the donors' summed uplinks bound it
    (`multi_donor_download_s`; k = 1 is one donor's link against the joiner's).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from bagel.protocol.runspec import STATE_DTYPE_NBYTES

# Documented bytes per value of each codec family, used only when `bagel.compression`
# cannot answer: fp32/fp16/bf16 raw; blockwise int8/int4 with one fp32 absmax scale per block
# (default block 256); top-k with a 4-byte value and a 4-byte index per kept entry.
_DEFAULT_BLOCK = 256


def _fallback_bytes_per_value(codec: str) -> float:
    name, _, arg = codec.partition(":")
    opts = dict(kv.split("=", 1) for kv in arg.split(",") if "=" in kv)
    block = int(opts.get("block", _DEFAULT_BLOCK))
    if name == "fp32":
        return 4.0
    if name in ("fp16", "bf16"):
        return 2.0
    if name == "int8":
        return 1.0 + 4.0 / block
    if name == "int4":
        return 0.5 + 4.0 / block
    if name == "topk":
        frac = float(arg.split(",")[0]) if arg and "=" not in arg.split(",")[0] else 0.01
        return frac * 8.0
    raise ValueError(f"unknown codec {codec!r}")


@lru_cache(maxsize=64)
def encoded_nbytes(codec: str, numel: int) -> int:
    """Bytes on the wire for `numel` values under `codec` (the real codec if available)."""
    try:
        from bagel.compression import get_codec
    except ImportError:
        return int(math.ceil(numel * _fallback_bytes_per_value(codec)))
    return int(get_codec(codec).encoded_nbytes(numel))


@dataclass(frozen=True)
class WorkloadSpec:
    """What one cell costs. Figures for a DiT-XL/2-class expert are the defaults."""

    expert_params: float = 675e6  # DiT-XL/2 (Peebles & Xie 2023, Table 4)
    expert_gflops_per_sample: float = 357.0  # 3 x 119 GFLOPs forward (DiT-XL/2, 256 px)
    # the router: a classifier on noised latents with a DiT-B/2-sized trunk (130M
    # parameters, 23 GFLOPs forward; Peebles & Xie 2023, Table 4)
    router_params: float = 130e6
    router_gflops_per_sample: float = 69.0
    mfu: float = 0.35
    # bytes of committed state per parameter a joiner downloads and a checkpoint uploads:
    # fp32 weights + momentum here; a scenario file that does not set it gets its run spec's
    # figure (`state_bytes_per_param`, below: state dtype and average)
    state_bytes_per_param: float = 8.0
    # VRAM fit: weights, grads, AdamW m and v, outer copy and momentum (6 x fp32 per
    # parameter) plus one micro-batch of activations (a scenario figure, not derived)
    train_bytes_per_param: float = 24.0
    # what a worker holds on the host beside the card, per parameter: the real worker's
    # closed form (`bagel.protocol.cellmemory.host_bytes_per_param`: three committed states
    # and nine float32 working copies; 60 with a float32 state and no average), which a
    # scenario's `[workload]` takes from its run spec unless it sets the figure itself. The
    # coordinator checks it only against workers that declare their host RAM
    # (`[population] host_ram_gb_home` / `host_ram_gb_datacenter`); by default none do.
    host_bytes_per_param: float = 60.0
    expert_activation_bytes: float = 2e9
    router_activation_bytes: float = 0.25e9


def cell_params(work: WorkloadSpec, cell_id: str) -> float:
    return work.router_params if cell_id == "router" else work.expert_params


def cell_flops_per_sample(work: WorkloadSpec, cell_id: str) -> float:
    g = work.router_gflops_per_sample if cell_id == "router" else work.expert_gflops_per_sample
    return g * 1e9


def samples_per_s(work: WorkloadSpec, tflops: float, cell_id: str) -> float:
    return tflops * 1e12 * work.mfu / cell_flops_per_sample(work, cell_id)


def compute_s(samples: int, rate: float) -> float:
    return samples / rate if rate > 0 else math.inf


def allreduce_s(nbytes: int, bandwidths: Sequence[float], latencies: Sequence[float]) -> float:
    """Equal-part butterfly all-reduce time of an `nbytes` vector over the given uplinks (bytes/s)."""
    n = len(bandwidths)
    if n <= 1:
        return 0.0
    return 2.0 * nbytes * (n - 1) / n / min(bandwidths) + 2.0 * max(latencies)


def part_nbytes(nbytes: int, weights: Sequence[float]) -> list[float]:
    """Each contributor's part of an `nbytes` vector, in proportion to its part weight (the
    simulator's bytes are continuous; the data plane cuts whole elements)."""
    total = float(sum(weights))
    if total <= 0:
        return [nbytes / len(weights)] * len(weights) if weights else []
    return [nbytes * w / total for w in weights]


def weighted_allreduce_s(
    nbytes: int,
    weights: Sequence[float],
    uplinks: Sequence[float],
    downlinks: Sequence[float],
    latencies: Sequence[float],
) -> float:
    """Butterfly all-reduce time with parts sized by `weights` (bytes/s links): the longest
    of each contributor's upload, S - S_i + (k - 1) S_i over its uplink, and download (as
    many bytes) over its downlink, plus the largest one-way latency twice. Equal weights
    give exactly `allreduce_s`."""
    k = len(weights)
    if k <= 1:
        return 0.0
    worst = 0.0
    for s_i, up, down in zip(part_nbytes(nbytes, weights), uplinks, downlinks, strict=True):
        moved = nbytes - s_i + (k - 1) * s_i
        worst = max(worst, moved / up, moved / down)
    return worst + 2.0 * max(latencies)


def weighted_allreduce_bytes(nbytes: int, weights: Sequence[float]) -> list[int]:
    """Bytes each contributor uploads (and downloads) in one exchange with weighted parts."""
    k = len(weights)
    if k <= 1:
        return [0] * k
    return [int(nbytes - s_i + (k - 1) * s_i) for s_i in part_nbytes(nbytes, weights)]


def allreduce_bytes_per_member(nbytes: int, n: int) -> int:
    """Bytes each contributor uploads (and downloads) in one exchange."""
    return int(2 * nbytes * (n - 1) / n) if n > 1 else 0


def download_s(nbytes: float, joiner_bw: float, donor_bw: float | None, latency_s: float) -> float:
    bw = joiner_bw if donor_bw is None else min(joiner_bw, donor_bw)
    return latency_s + nbytes / bw


def multi_donor_shares(donor_bws: Sequence[float]) -> list[float]:
    """The fraction of the state each donor sends: proportional to its bandwidth."""
    total = sum(donor_bws)
    return [b / total for b in donor_bws] if total > 0 else []


def multi_donor_download_s(nbytes: float, joiner_bw: float, donor_bws: Sequence[float], latency_s: float) -> float:
    """A download from k donors in parallel, in bandwidth-proportional shares (no donor: the
    joiner's own link bounds it, as `download_s` with no donor)."""
    return download_s(nbytes, joiner_bw, sum(donor_bws) if donor_bws else None, latency_s)


def cell_memory_bytes(work: WorkloadSpec, cell_id: str) -> int:
    act = work.router_activation_bytes if cell_id == "router" else work.expert_activation_bytes
    return int(cell_params(work, cell_id) * work.train_bytes_per_param + act)


def cell_host_bytes(work: WorkloadSpec, cell_id: str) -> int:
    return int(cell_params(work, cell_id) * work.host_bytes_per_param)


def state_bytes_per_param(state_dtype: str = "fp32", ema: bool = False) -> float:
    """Bytes of committed state per parameter: the weights and the outer momentum, and with
    `ema` the average of the weights, each in `state_dtype` (`[sync] state_dtype`)."""
    return float((3 if ema else 2) * STATE_DTYPE_NBYTES[state_dtype])


def cell_state_bytes(work: WorkloadSpec, cell_id: str) -> int:
    return int(cell_params(work, cell_id) * work.state_bytes_per_param)
