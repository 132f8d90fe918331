"""Synthetic volunteer population: GPU classes, links, availability, bad actors.

The simulator's workers are drawn from this module, so every figure that decides who is
fast, who is slow and who vanishes lives here, next to where it comes from.

GPU classes
    Relative training throughput is the vendor's *peak dense* tensor-core rate for
    16-bit inputs with FP32 accumulation (what mixed-precision training uses), in TFLOPS,
    without the 2:4 sparsity doubling the spec sheets headline. Achieved throughput is that
    peak times one model-FLOPs-utilisation factor (`WorkloadSpec.mfu`) shared by every
    class. That is an assumption, stated as one: real MFU differs by class (consumer cards
    are more often memory-bound), and published benchmark ratios (e.g. Lambda's PyTorch
    training benchmarks) show smaller spreads than the peak ratios; a scenario that wants
    them can override a class's `tflops` in its `[population.gpu_tflops]` table.
    Sources, per row below:
      - [GA102] NVIDIA Ampere GA102 GPU Architecture whitepaper (2020), table "GeForce RTX
        3090": "Peak FP16 Tensor TFLOPS with FP32 Accumulate 71/142" (dense/sparse).
      - [GA106-derived] RTX 3060: not in the GA102 whitepaper; derived from the same
        whitepaper's GA10x per-SM rate (71 TFLOPS / (82 SMs x 1.695 GHz) = 512 FLOP/clk/SM)
        x 28 SMs x 1.777 GHz boost (NVIDIA RTX 3060 product page) = 25.5 TFLOPS.
      - [AD102] NVIDIA Ada Lovelace architecture whitepaper (2022), RTX 4090: "Peak FP16
        Tensor TFLOPS with FP32 Accumulate 165.2/330.4".
      - [A100] NVIDIA A100 Tensor Core GPU datasheet: "BF16 Tensor Core 312 TFLOPS | 624
        TFLOPS*" (* with sparsity), both the 40 GB and 80 GB parts.
      - [H100] NVIDIA H100 Tensor Core GPU datasheet, SXM: "BF16 Tensor Core 1,979
        teraFLOPS*" (* with sparsity) -> 989.5 dense.
      - [A10] NVIDIA A10 datasheet: "BF16 Tensor Core 125 TF | 250 TF*".
    VRAM is the marketed memory size (GiB-rounded spec value), in bytes.

Links
    Home uplinks are log-normal in Mbit/s, clipped to [10, 100] (the range the design's
    data-plane discussion assumes for volunteers); datacenter links are log-normal in
    Gbit/s, clipped to [1, 10]. Each worker also has a one-way latency.

Availability
    A worker alternates online sessions and offline gaps. Session lengths are Weibull
    (shape k < 1 gives many short sessions and a long tail, as measured for volunteer
    computing hosts, e.g. Javadi et al., "Discovering statistical models of availability in
    large distributed systems", MASCOTS 2009). Spot workers additionally die at an
    exponential preemption hazard. Offline gaps are exponential, thinned by a diurnal
    availability curve so that arrivals peak in the evening. A departure is a graceful
    Leave with probability `graceful_leave_fraction`, otherwise a silent crash that only the
    coordinator's lease expiry notices. Preemptions are always silent.

Everything random is drawn from a `numpy.random.Generator` passed in: no global state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

GIB = 1 << 30


@dataclass(frozen=True)
class GpuClass:
    name: str
    tflops: float  # peak dense 16-bit tensor TFLOPS, FP32 accumulate (see module doc)
    vram_bytes: int
    source: str
    datacenter: bool  # datacenter parts sit behind datacenter links by default


GPU_CLASSES: dict[str, GpuClass] = {
    c.name: c
    for c in (
        GpuClass("rtx3060", 25.5, 12 * GIB, "GA106-derived", False),
        GpuClass("rtx3090", 71.0, 24 * GIB, "GA102", False),
        GpuClass("rtx4090", 165.2, 24 * GIB, "AD102", False),
        GpuClass("a10", 125.0, 24 * GIB, "A10", True),
        GpuClass("a100-40gb", 312.0, 40 * GIB, "A100", True),
        GpuClass("a100-80gb", 312.0, 80 * GIB, "A100", True),
        GpuClass("h100-80gb", 989.5, 80 * GIB, "H100", True),
    )
}


@dataclass(frozen=True)
class LinkSpec:
    home_mbit_median: float = 30.0
    home_mbit_sigma: float = 0.6  # of ln(Mbit/s)
    home_mbit_min: float = 10.0
    home_mbit_max: float = 100.0
    home_latency_ms_min: float = 15.0
    home_latency_ms_max: float = 80.0
    dc_gbit_median: float = 3.0
    dc_gbit_sigma: float = 0.5
    dc_gbit_min: float = 1.0
    dc_gbit_max: float = 10.0
    dc_latency_ms_min: float = 2.0
    dc_latency_ms_max: float = 20.0


@dataclass(frozen=True)
class AvailabilitySpec:
    session_weibull_shape: float = 0.8
    session_weibull_scale_h: float = 8.0
    offline_mean_h: float = 4.0
    # diurnal curve: arrival acceptance 1 - amplitude * (1 - cos(2 pi (t - peak)/24h)) / 2
    diurnal_amplitude: float = 0.3
    diurnal_peak_h: float = 20.0
    spot_fraction: float = 0.0
    spot_preemption_per_h: float = 0.0
    graceful_leave_fraction: float = 0.7
    # at t=0 this fraction of the population is online (the rest arrive over time)
    initial_online_fraction: float = 0.7


@dataclass(frozen=True)
class PopulationSpec:
    gpu_mix: tuple[tuple[str, float], ...] = (("rtx3090", 0.5), ("rtx4090", 0.5))
    gpu_tflops: tuple[tuple[str, float], ...] = ()  # overrides of GpuClass.tflops
    byzantine_fraction: float = 0.0
    # lognormal per-worker jitter of achieved throughput around its class (sigma of ln)
    throughput_jitter: float = 0.1
    links: LinkSpec = LinkSpec()
    availability: AvailabilitySpec = AvailabilitySpec()
    # free host RAM beside the card, GiB -> weight, for home and for datacenter machines (by
    # the GPU class's `datacenter`): what a worker declares in its profile, which the
    # coordinator holds against a cell's host share. Empty: that group declares none (0),
    # as by default, and the host is not checked. Drawn after everything else, so a
    # scenario without it draws the same population as before it existed.
    host_ram_gb_home: tuple[tuple[str, float], ...] = ()
    host_ram_gb_datacenter: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class Population:
    """Static attributes of N synthetic workers, as parallel numpy arrays."""

    gpu: tuple[str, ...]  # class name per worker
    tflops: np.ndarray  # achieved-peak TFLOPS per worker (before MFU)
    vram_bytes: np.ndarray
    bandwidth_bytes_per_s: np.ndarray
    latency_s: np.ndarray
    spot: np.ndarray  # bool
    byzantine: np.ndarray  # bool
    host_bytes: np.ndarray | None = None  # declared free host RAM (None or 0: not declared)

    def __len__(self) -> int:
        return len(self.gpu)


def _mix(spec: PopulationSpec) -> tuple[list[str], np.ndarray]:
    names = [n for n, _ in spec.gpu_mix]
    for n in names:
        if n not in GPU_CLASSES:
            raise ValueError(f"population.gpu_mix: unknown GPU class {n!r}; known: {sorted(GPU_CLASSES)}")
    w = np.array([float(v) for _, v in spec.gpu_mix])
    if len(w) == 0 or np.any(w < 0) or w.sum() <= 0:
        raise ValueError("population.gpu_mix: weights must be non-negative with a positive sum")
    return names, w / w.sum()


def sample_population(spec: PopulationSpec, n: int, rng: np.random.Generator) -> Population:
    """Draw n workers. Deterministic for a given generator state."""
    names, probs = _mix(spec)
    overrides = dict(spec.gpu_tflops)
    for k in overrides:
        if k not in GPU_CLASSES:
            raise ValueError(f"population.gpu_tflops: unknown GPU class {k!r}")
    idx = rng.choice(len(names), size=n, p=probs)
    gpu = tuple(names[i] for i in idx)
    base = np.array([overrides.get(names[i], GPU_CLASSES[names[i]].tflops) for i in idx])
    jitter = np.exp(rng.normal(0.0, spec.throughput_jitter, size=n)) if spec.throughput_jitter > 0 else np.ones(n)
    tflops = base * jitter
    vram = np.array([GPU_CLASSES[names[i]].vram_bytes for i in idx], dtype=np.int64)
    dc = np.array([GPU_CLASSES[names[i]].datacenter for i in idx], dtype=bool)
    L = spec.links
    home = (
        np.clip(
            np.exp(rng.normal(math.log(L.home_mbit_median), L.home_mbit_sigma, size=n)),
            L.home_mbit_min,
            L.home_mbit_max,
        )
        * 1e6
        / 8
    )
    dcbw = (
        np.clip(np.exp(rng.normal(math.log(L.dc_gbit_median), L.dc_gbit_sigma, size=n)), L.dc_gbit_min, L.dc_gbit_max)
        * 1e9
        / 8
    )
    bw = np.where(dc, dcbw, home)
    lat = (
        np.where(
            dc,
            rng.uniform(L.dc_latency_ms_min, L.dc_latency_ms_max, size=n),
            rng.uniform(L.home_latency_ms_min, L.home_latency_ms_max, size=n),
        )
        / 1000.0
    )
    spot = rng.random(n) < spec.availability.spot_fraction
    byz = rng.random(n) < spec.byzantine_fraction
    host = None
    if spec.host_ram_gb_home or spec.host_ram_gb_datacenter:
        host = np.where(
            dc,
            _draw_gib(spec.host_ram_gb_datacenter, "host_ram_gb_datacenter", n, rng),
            _draw_gib(spec.host_ram_gb_home, "host_ram_gb_home", n, rng),
        )
    return Population(gpu, tflops, vram, bw, lat, spot, byz, host)


def _draw_gib(mix: tuple[tuple[str, float], ...], name: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """n draws (bytes) from a {GiB: weight} mix; zeros for an empty one (not declared)."""
    if not mix:
        return np.zeros(n, dtype=np.int64)
    try:
        sizes = [float(k) for k, _ in mix]
    except ValueError:
        raise ValueError(f"population.{name}: keys are sizes in GiB, e.g. {{ 32 = 0.5, 64 = 0.5 }}") from None
    w = np.array([float(v) for _, v in mix])
    if any(s <= 0 for s in sizes) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"population.{name}: positive sizes, weights non-negative with a positive sum")
    gib = np.array([int(s * GIB) for s in sizes], dtype=np.int64)
    return gib[rng.choice(len(sizes), size=n, p=w / w.sum())]


# ---------------------------------------------------------------- availability


def diurnal_acceptance(av: AvailabilitySpec, t_s: float) -> float:
    """Relative arrival intensity in (0, 1] at virtual time t (peak = 1 at diurnal_peak_h)."""
    phase = 2.0 * math.pi * ((t_s / 3600.0) - av.diurnal_peak_h) / 24.0
    return 1.0 - av.diurnal_amplitude * (1.0 - math.cos(phase)) / 2.0


def draw_session_s(av: AvailabilitySpec, spot: bool, rng: np.random.Generator) -> tuple[float, bool]:
    """(length of the next online session in seconds, whether it ends in a preemption)."""
    session = av.session_weibull_scale_h * 3600.0 * float(rng.weibull(av.session_weibull_shape))
    if spot and av.spot_preemption_per_h > 0:
        pre = float(rng.exponential(3600.0 / av.spot_preemption_per_h))
        if pre < session:
            return pre, True
    return session, False


def draw_offline_s(av: AvailabilitySpec, now_s: float, rng: np.random.Generator) -> float:
    """Length of the next offline gap: exponential, thinned by the diurnal curve (Lewis-Shedler)."""
    mean = av.offline_mean_h * 3600.0
    t = 0.0
    for _ in range(1000):
        t += float(rng.exponential(mean))
        if rng.random() <= diurnal_acceptance(av, now_s + t):
            return t
    return t


def graceful(av: AvailabilitySpec, rng: np.random.Generator) -> bool:
    return bool(rng.random() < av.graceful_leave_fraction)
