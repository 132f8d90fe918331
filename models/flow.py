"""Rectified flow: the training objective, t-sampling, timestep ranges and ODE samplers.

Pure core: no I/O, no clock, no global RNG. Every random draw takes a
`torch.Generator` argument, so a worker, a test and the coordinator's audit can replay
exactly the same noise.

Conventions (rectified flow, Liu et al. 2022; cloneofsimo/minRF `rf.py`):
    x_t = (1 - t) * x0 + t * eps,     t in [0, 1],  t = 0 is data, t = 1 is noise,
    v   = d x_t / d t = eps - x0      (the velocity a model is trained to predict).
Sampling integrates dx/dt = v from t = 1 down to t = 0.

Training t follows SD3's logit-normal density, t = sigmoid(N(mean, std)) (Esser et al.
2024, "Scaling Rectified Flow Transformers"), truncated to one cell's widened timestep
range. Ranges split [0, 1] at equal-probability quantiles of that density, so each range
expert sees the same share of training signal (eDiff-I's expert denoisers, Balaji et al.
2022, split by noise level the same way).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

Velocity = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# 1 - t (or t) below this is treated as this, so eps->v and x0->v conversions stay finite.
_CONVERSION_FLOOR = 1e-4


def _check_range(lo: float, hi: float) -> None:
    if not (0.0 <= lo < hi <= 1.0):
        raise ValueError(f"timestep range must satisfy 0 <= lo < hi <= 1, got [{lo}, {hi}]")


def logit_normal_quantile(p: float, mean: float = 0.0, std: float = 1.0) -> float:
    """t such that P(T <= t) = p for T = sigmoid(N(mean, std))."""
    if not (0.0 <= p <= 1.0):
        raise ValueError(f"quantile level must be in [0, 1], got {p}")
    if p == 0.0:
        return 0.0
    if p == 1.0:
        return 1.0
    z = torch.special.ndtri(torch.tensor(p, dtype=torch.float64)).item()
    return 1.0 / (1.0 + math.exp(-(mean + std * z)))


def logit_normal_cdf(t: float, mean: float = 0.0, std: float = 1.0) -> float:
    """P(T <= t) for T = sigmoid(N(mean, std))."""
    if t <= 0.0:
        return 0.0
    if t >= 1.0:
        return 1.0
    z = (math.log(t) - math.log1p(-t) - mean) / std
    return float(torch.special.ndtr(torch.tensor(z, dtype=torch.float64)).item())


def timestep_ranges(count: int, mean: float = 0.0, std: float = 1.0) -> list[tuple[float, float]]:
    """`count` contiguous ranges covering [0, 1], cut at equal-probability quantiles.

    Range r is [q(r / count), q((r + 1) / count)] for the logit-normal quantile q, so each
    holds 1/count of the training t-mass. Range 0 is the low-noise end (t near 0).
    """
    if count < 1:
        raise ValueError(f"need at least one timestep range, got {count}")
    cuts = [logit_normal_quantile(i / count, mean, std) for i in range(count + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(count)]


def widen(t_range: tuple[float, float], overlap: float) -> tuple[float, float]:
    """[lo - overlap, hi + overlap] clipped to [0, 1]: the range an expert trains on.

    The overlap lets neighbouring experts agree near their shared boundary, so the composed
    sampler does not see a discontinuity when it switches experts.
    """
    if not (0.0 <= overlap < 0.5):
        raise ValueError(f"overlap must be in [0, 0.5), got {overlap}")
    lo, hi = t_range
    _check_range(lo, hi)
    return max(0.0, lo - overlap), min(1.0, hi + overlap)


def range_index(t: float, ranges: Sequence[tuple[float, float]]) -> int:
    """The range whose (unwidened) interval holds t; a boundary belongs to the higher range."""
    for r, (lo, hi) in enumerate(ranges):
        if lo <= t < hi:
            return r
    if ranges and t >= ranges[-1][1]:
        return len(ranges) - 1
    if ranges and t < ranges[0][0]:
        return 0
    raise ValueError("no timestep ranges")


def sample_t(
    n: int,
    generator: torch.Generator,
    lo: float = 0.0,
    hi: float = 1.0,
    mean: float = 0.0,
    std: float = 1.0,
) -> torch.Tensor:
    """n draws of t ~ sigmoid(N(mean, std)) conditioned on lo <= t <= hi (float32, shape [n]).

    Exact inverse-CDF sampling of the truncated normal in logit space: no rejection loop,
    so the number of generator draws is fixed (n uniforms) and replays are exact.
    """
    _check_range(lo, hi)
    if std <= 0:
        raise ValueError(f"std must be positive, got {std}")
    p_lo = logit_normal_cdf(lo, mean, std)
    p_hi = logit_normal_cdf(hi, mean, std)
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    p = p_lo + (p_hi - p_lo) * u
    # keep p strictly inside (0, 1) so ndtri stays finite; clamp t back into the range.
    p = p.clamp(1e-12, 1.0 - 1e-12)
    t = torch.sigmoid(mean + std * torch.special.ndtri(p))
    return t.clamp(lo, hi).to(torch.float32)


def interpolate(x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - t) x0 + t eps, with t of shape [B] broadcast over the image dims."""
    tb = t.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    return (1.0 - tb) * x0 + tb * eps


def drop_labels(y: torch.Tensor, null_label: int, p: float, generator: torch.Generator) -> torch.Tensor:
    """Replace each label by `null_label` with probability p (classifier-free guidance
    training, Ho & Salimans 2022; DiT's LabelEmbedder.token_drop, with an explicit generator)."""
    if p <= 0.0:
        return y
    drop = torch.rand(y.shape[0], generator=generator) < p
    return torch.where(drop.to(y.device), torch.full_like(y, null_label), y)


def rf_loss_per_sample(
    model: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],
    x0: torch.Tensor,
    y: torch.Tensor | None,
    t: torch.Tensor,
    eps: torch.Tensor,
) -> torch.Tensor:
    """Mean squared velocity error of each sample, shape [B]."""
    xt = interpolate(x0, eps, t)
    target = eps - x0
    pred = model(xt, t.to(x0.device), y)
    return ((pred.float() - target.float()) ** 2).flatten(1).mean(dim=1)


def rf_loss(
    model: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],
    x0: torch.Tensor,
    y: torch.Tensor | None,
    generator: torch.Generator,
    *,
    t_range: tuple[float, float] = (0.0, 1.0),
    t_mean: float = 0.0,
    t_std: float = 1.0,
    label_dropout: float = 0.0,
    null_label: int = 0,
) -> torch.Tensor:
    """Rectified-flow training loss (scalar) with t from the truncated logit-normal.

    Draw order from `generator` is fixed: t (B uniforms), eps (B x image), label drops.
    """
    b = x0.shape[0]
    t = sample_t(b, generator, t_range[0], t_range[1], t_mean, t_std)
    eps = torch.randn(x0.shape, generator=generator, dtype=x0.dtype).to(x0.device)
    if y is not None and label_dropout > 0.0:
        y = drop_labels(y, null_label, label_dropout, generator)
    return rf_loss_per_sample(model, x0, y, t.to(x0.device), eps).mean()


# --- converting other parameterisations to velocity --------------------------------------


def eps_to_velocity(eps_pred: torch.Tensor, xt: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Velocity from an eps-prediction: with x_t = (1-t) x0 + t eps, v = (eps - x_t) / (1 - t).

    Lets an expert trained to predict noise be composed with velocity experts. Exact for
    t < 1; 1 - t is floored at 1e-4 so t = 1 stays finite.
    """
    tb = t.view(-1, *([1] * (xt.dim() - 1))).to(xt.dtype)
    return (eps_pred - xt) / (1.0 - tb).clamp_min(_CONVERSION_FLOOR)


def x0_to_velocity(x0_pred: torch.Tensor, xt: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Velocity from a data-prediction: v = (x_t - x0) / t (t floored at 1e-4)."""
    tb = t.view(-1, *([1] * (xt.dim() - 1))).to(xt.dtype)
    return (xt - x0_pred) / tb.clamp_min(_CONVERSION_FLOOR)


def velocity_to_eps(v: torch.Tensor, xt: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Inverse of eps_to_velocity: eps = x_t + (1 - t) v."""
    tb = t.view(-1, *([1] * (xt.dim() - 1))).to(xt.dtype)
    return xt + (1.0 - tb) * v


def guided(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance: v_uncond + scale (v_cond - v_uncond); scale 1 = no guidance."""
    return v_uncond + scale * (v_cond - v_uncond)


# --- samplers -----------------------------------------------------------------------------


def time_grid(steps: int, shift: float = 1.0) -> torch.Tensor:
    """steps + 1 times from 1 down to 0. shift > 1 spends more steps at high noise
    (SD3's timestep shift t' = s t / (1 + (s - 1) t))."""
    if steps < 1:
        raise ValueError(f"need at least one sampling step, got {steps}")
    if shift <= 0:
        raise ValueError(f"shift must be positive, got {shift}")
    t = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    t = shift * t / (1.0 + (shift - 1.0) * t)
    return t.to(torch.float32)


def euler_sample(velocity: Velocity, noise: torch.Tensor, steps: int, shift: float = 1.0) -> torch.Tensor:
    """Integrate dx/dt = v(x, t) from t = 1 (x = noise) to t = 0 with Euler steps."""
    ts = time_grid(steps, shift)
    x = noise
    for i in range(steps):
        t, t_next = ts[i], ts[i + 1]
        v = velocity(x, t.expand(x.shape[0]).to(x.device))
        x = x + (t_next - t) * v
    return x


def heun_sample(velocity: Velocity, noise: torch.Tensor, steps: int, shift: float = 1.0) -> torch.Tensor:
    """Heun's second-order method (EDM, Karras et al. 2022, Alg. 1): an Euler predictor and a
    trapezoidal corrector; the last step to t = 0 is plain Euler. 2 * steps - 1 evaluations."""
    ts = time_grid(steps, shift)
    x = noise
    for i in range(steps):
        t, t_next = ts[i], ts[i + 1]
        v = velocity(x, t.expand(x.shape[0]).to(x.device))
        x_pred = x + (t_next - t) * v
        if t_next > 0:
            v_next = velocity(x_pred, t_next.expand(x.shape[0]).to(x.device))
            x = x + (t_next - t) * 0.5 * (v + v_next)
        else:
            x = x_pred
    return x
