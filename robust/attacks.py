"""Known attacks on robust aggregation, as pure functions of honest updates (benchmarks, tests,
and the worker's `--byzantine alie|ipm` fault modes).

The papers' attackers are omniscient: they see every honest update of the round.
- ALIE, "A Little Is Enough" (Baruch, Baruch & Goldberg, NeurIPS 2019): every attacker sends
  mu - z * sigma, mu and sigma the per-coordinate mean and standard deviation of the honest
  updates. Each coordinate stays within z standard deviations of the honest mean, so
  median- and distance-based rules keep it, while the shift adds up over coordinates.
- IPM, inner-product manipulation (Xie, Koyejo & Gupta, "Fall of Empires: Breaking Byzantine-
  tolerant SGD by Inner Product Manipulation", UAI 2020): every attacker sends -eps * mu, so
  the aggregate's inner product with the honest mean shrinks or turns negative.

A single real worker knows only its own honest update d, so the `_own` variants approximate:
ALIE sends d - z * sigma_of_mu * |d| (sigma per coordinate taken as a fixed fraction of |d|,
since per-coordinate noise in a pseudo-gradient is of the order of the signal), and IPM sends
-eps * d (its own update standing in for the honest mean).

`craft` builds f hostile contributions for a named attack, the papers' two and four crude
ones (each hostile sender's own honest-looking update is `honest[i % n]`):
``alie`` (z = 1.5), ``ipm:EPS``, ``sign-flip-x1000`` (-1000 x its update), ``random-x1000``
(Gaussian noise 1000 x the honest per-coordinate scale), ``finite-1e30`` (every value 1e30,
finite in float32) and ``weight-1e9`` (its update sign-flipped, a norm the screen keeps,
claiming 1e9 samples: only clamping the weight to the sender's budget stops it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

ALIE_Z = 1.5  # Baruch et al.'s z for groups of this size (their z_max for n ~ 20-50 is ~1-1.5)
ALIE_SIGMA_OF_MU = 1.0  # a lone worker's stand-in for the honest per-coordinate std: this x |d|
IPM_EPS = 0.5  # a lone worker's IPM scale: sends -0.5 x its honest update


def alie(honest: Sequence[torch.Tensor], z: float = ALIE_Z) -> torch.Tensor:
    """mu - z sigma over the honest updates, per coordinate (population std), in float32."""
    x = torch.stack([h.to(torch.float64) for h in honest])
    return (x.mean(dim=0) - z * x.std(dim=0, correction=0)).to(torch.float32)


def ipm(honest: Sequence[torch.Tensor], eps: float) -> torch.Tensor:
    """-eps times the mean honest update, in float32."""
    x = torch.stack([h.to(torch.float64) for h in honest])
    return (-eps * x.mean(dim=0)).to(torch.float32)


def alie_own(delta: torch.Tensor, z: float = ALIE_Z, sigma_of_mu: float = ALIE_SIGMA_OF_MU) -> torch.Tensor:
    """A lone worker's ALIE from its own update d: d - z * sigma_of_mu * |d| (same dtype)."""
    return delta - (z * sigma_of_mu) * delta.abs()


def ipm_own(delta: torch.Tensor, eps: float = IPM_EPS) -> torch.Tensor:
    """A lone worker's IPM from its own update d: -eps * d (same dtype)."""
    return delta * -eps


ATTACKS = (
    "alie",
    "ipm:0.1",
    "ipm:0.5",
    "ipm:1",
    "ipm:3",
    "sign-flip-x1000",
    "random-x1000",
    "finite-1e30",
    "weight-1e9",
)


def craft(
    attack: str, honest: Sequence[torch.Tensor], f: int, *, claim: float, generator: torch.Generator
) -> list[tuple[torch.Tensor, float]]:
    """f hostile (part, claimed weight) pairs for `attack` (one of ATTACKS) against `honest`;
    `claim` is the weight an attacker claims unless the attack is about the claim."""
    n = len(honest)
    if attack == "alie":
        v = alie(honest)
        return [(v.clone(), claim) for _ in range(f)]
    if attack.startswith("ipm:"):
        v = ipm(honest, float(attack.partition(":")[2]))
        return [(v.clone(), claim) for _ in range(f)]
    if attack == "sign-flip-x1000":
        return [(honest[i % n] * -1000.0, claim) for i in range(f)]
    if attack == "random-x1000":
        scale = float(torch.stack(list(honest)).std()) * 1000.0
        d = honest[0].numel()
        return [(torch.randn(d, generator=generator) * scale, claim) for _ in range(f)]
    if attack == "finite-1e30":
        return [(torch.full_like(honest[0], 1e30), claim) for _ in range(f)]
    if attack == "weight-1e9":
        return [(-honest[i % n], 1e9) for i in range(f)]
    raise ValueError(f"unknown attack {attack!r}; known: {', '.join(ATTACKS)}")


def honest_group(
    n: int, d: int, *, noise: float, spread: float, generator: torch.Generator
) -> tuple[list[torch.Tensor], list[float]]:
    """n honest updates and sample counts: a common mean mu ~ N(0, I_d) plus per-worker noise of
    `noise` x mu's scale, each scaled by a factor log-uniform in [1/spread, spread] (workers
    with different batches and learning progress); sample counts between half and the full
    budget of 64. Realistic pseudo-gradients of one cell agree in direction only roughly
    (cosine ~0.7 to the mean at noise 1)."""
    mu = torch.randn(d, generator=generator)
    parts, claims = [], []
    for _ in range(n):
        scale = math.exp((2 * float(torch.rand((), generator=generator)) - 1) * math.log(spread))
        parts.append((mu + noise * torch.randn(d, generator=generator)) * scale)
        claims.append(float(32 + int(torch.randint(0, 33, (), generator=generator))))
    return parts, claims


__all__ = [
    "ALIE_SIGMA_OF_MU",
    "ALIE_Z",
    "ATTACKS",
    "IPM_EPS",
    "alie",
    "alie_own",
    "craft",
    "honest_group",
    "ipm",
    "ipm_own",
]
