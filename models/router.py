"""The router: a small convolutional classifier p(k | x_t, t [, y]) over data clusters.

Decentralized Diffusion Models (McAllister et al. 2025) train a router to predict which
cluster's expert should denoise a noisy input x_t at time t; at sampling time the top-1
cluster picks the expert. Ours optionally also sees the class label y (with label dropout
in training, so y = None still works): for class-conditional sampling the prior p(k | y)
is what makes the choice at t = 1, where x_t carries no information yet.

Each stage is GroupNorm -> FiLM(t, y) -> SiLU -> 3x3 conv with a residual connection, then
2x average pooling while the map is larger than 2x2; the head pools globally.
`param_count` is the closed form, used to size the router cell without building it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from bagel.models.dit import timestep_embedding

T_FREQ = 64

# name -> (width, stages)
PRESETS: dict[str, tuple[int, int]] = {"tiny": (32, 3), "small": (64, 3), "base": (128, 4)}


@dataclass(frozen=True)
class RouterConfig:
    clusters: int = 2
    image_size: int = 8
    channels: int = 1
    width: int = 32
    stages: int = 3
    num_classes: int = 10  # 0 = the router does not see labels

    def __post_init__(self) -> None:
        if self.clusters < 1 or self.width < 8 or self.width % 8 or self.stages < 1:
            raise ValueError(f"invalid router config {self}")


def preset_config(preset: str, clusters: int, image_size: int, channels: int, num_classes: int) -> RouterConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown router preset {preset!r}; known: {sorted(PRESETS)}")
    width, stages = PRESETS[preset]
    return RouterConfig(clusters, image_size, channels, width, stages, num_classes)


def param_count(cfg: RouterConfig) -> int:
    w, c = cfg.width, cfg.channels
    t_embed = T_FREQ * w + w + w * w + w
    y_embed = (cfg.num_classes + 1) * w if cfg.num_classes > 0 else 0
    stem = c * 9 * w + w
    stage = 2 * w + (w * 2 * w + 2 * w) + (9 * w * w + w)
    head = 2 * w + w * cfg.clusters + cfg.clusters
    return t_embed + y_embed + stem + cfg.stages * stage + head


class _Stage(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(8, width)
        self.film = nn.Linear(width, 2 * width)
        self.conv = nn.Conv2d(width, width, 3, padding=1)

    def forward(self, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        scale, shift = self.film(c).chunk(2, dim=1)
        z = self.norm(h) * (1 + scale[:, :, None, None]) + shift[:, :, None, None]
        return h + self.conv(F.silu(z))


class Router(nn.Module):
    """forward(x_t [B,C,H,W], t [B], y [B] or None) -> cluster logits [B, clusters]."""

    def __init__(self, cfg: RouterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        w = cfg.width
        self.t_embed = nn.Sequential(nn.Linear(T_FREQ, w), nn.SiLU(), nn.Linear(w, w))
        self.y_embed = nn.Embedding(cfg.num_classes + 1, w) if cfg.num_classes > 0 else None
        self.stem = nn.Conv2d(cfg.channels, w, 3, padding=1)
        self.stages = nn.ModuleList(_Stage(w) for _ in range(cfg.stages))
        self.head_norm = nn.GroupNorm(8, w)
        self.head = nn.Linear(w, cfg.clusters)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        cfg = self.cfg
        if x.dim() != 4 or x.shape[1] != cfg.channels:
            raise ValueError(f"expected input [B, {cfg.channels}, H, W], got {list(x.shape)}")
        c = self.t_embed(timestep_embedding(t.reshape(x.shape[0]).to(x.device), T_FREQ))
        if self.y_embed is not None:
            if y is None:
                y = torch.full((x.shape[0],), cfg.num_classes, dtype=torch.long, device=x.device)
            c = c + self.y_embed(y)
        c = F.silu(c)
        h = self.stem(x)
        for stage in self.stages:
            h = stage(h, c)
            if h.shape[-1] > 2:
                h = F.avg_pool2d(h, 2)
        h = F.silu(self.head_norm(h)).mean(dim=(2, 3))
        return self.head(h)
