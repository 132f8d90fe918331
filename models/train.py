"""A plain single-process training loop for one cell (benchmarks, tests, local sampling).

The distributed inner loop lives in the worker; this is the same objective
(`CellTask.loss`) driven by AdamW on random minibatches, with an optional exponential
moving average of the weights (as DiT and most diffusion models sample from an EMA).
All randomness comes from one seeded generator.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Generator], torch.Tensor]


@dataclass
class FitResult:
    model: nn.Module  # the EMA copy when ema > 0, else the trained model
    raw: nn.Module
    losses: list[float]
    sample_steps: int


def train(
    model: nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    steps: int,
    batch_size: int,
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    ema: float = 0.0,
    warmup: int = 0,
    seed: int = 0,
    log_every: int = 0,
    log: Callable[[str], None] | None = None,
) -> FitResult:
    """`steps` AdamW steps on minibatches drawn with replacement-free epochs from (x, y).

    lr warms up linearly over `warmup` steps, then decays by cosine to lr / 10. With ema > 0
    an exponential moving average of the weights is kept and returned as `model`."""
    if steps < 0 or batch_size < 1 or len(x) == 0:
        raise ValueError("need steps >= 0, batch_size >= 1 and some data")
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    ema_model = copy.deepcopy(model).eval() if ema > 0 else None
    if ema_model is not None:
        ema_model.requires_grad_(False)
    losses: list[float] = []
    order = torch.randperm(len(x), generator=gen)
    pos = 0
    model.train()
    for step in range(steps):
        if pos + batch_size > len(order):
            order = torch.randperm(len(x), generator=gen)
            pos = 0
        idx = order[pos : pos + batch_size]
        pos += batch_size
        scale = min(1.0, (step + 1) / warmup) if warmup else 1.0
        progress = step / max(1, steps - 1)
        scale *= 0.1 + 0.9 * 0.5 * (1.0 + torch.cos(torch.tensor(progress * torch.pi)).item())
        for group in opt.param_groups:
            group["lr"] = lr * scale
        loss = loss_fn(model, x[idx], y[idx], gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if ema_model is not None:
            # warm-up of the decay ((1 + n) / (10 + n), as in TensorFlow's and timm's EMA), so
            # a short run does not sample from weights still close to the initialisation.
            decay = min(ema, (1.0 + step) / (10.0 + step))
            with torch.no_grad():
                torch._foreach_lerp_(list(ema_model.parameters()), list(model.parameters()), 1.0 - decay)
        if log and log_every and (step + 1) % log_every == 0:
            recent = losses[-log_every:]
            log(f"step {step + 1}/{steps} loss {sum(recent) / len(recent):.4f}")
    model.eval()
    return FitResult(ema_model if ema_model is not None else model, model, losses, steps * min(batch_size, len(x)))
