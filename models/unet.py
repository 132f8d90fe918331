"""A small U-Net denoiser, the convolutional alternative to the DiT for a cell.

The layout is a trimmed ADM U-Net (Dhariwal & Nichol 2021, openai/guided-diffusion
`unet.py`): residual blocks with GroupNorm and a scale-shift from the (time + label)
embedding, one residual block per level, strided-conv downsampling, nearest upsampling,
and a middle of ResBlock - self-attention - ResBlock. The output conv and the second conv
of every residual block start at zero, so the network starts as (almost) the identity on
its skips, the same idea as DiT's adaLN-Zero.

forward(x, t, y) has the same contract as the DiT: velocity out, y = None is "no label".
`param_count(cfg)` is the closed form, checked against built models by a test.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from bagel.models.dit import timestep_embedding

GROUPS = 8

# name -> (base width, channel multipliers per level)
PRESETS: dict[str, tuple[int, tuple[int, ...]]] = {
    "tiny": (32, (1, 2)),
    "small": (64, (1, 2, 2)),
    "base": (128, (1, 2, 2, 2)),
}


@dataclass(frozen=True)
class UNetConfig:
    image_size: int = 8
    channels: int = 1
    base: int = 32
    mults: tuple[int, ...] = (1, 2)
    num_classes: int = 10

    def __post_init__(self) -> None:
        if self.base < GROUPS or self.base % GROUPS or not self.mults or min(self.mults) < 1:
            raise ValueError(f"invalid U-Net config {self}")
        if self.image_size % (2 ** (len(self.mults) - 1)):
            raise ValueError(f"image_size {self.image_size} not divisible by 2^{len(self.mults) - 1}")
        if self.num_classes < 0 or self.channels < 1:
            raise ValueError(f"invalid U-Net config {self}")

    @property
    def emb(self) -> int:
        return 4 * self.base


def preset_config(preset: str, image_size: int = 8, channels: int = 1, num_classes: int = 10) -> UNetConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown U-Net preset {preset!r}; known: {sorted(PRESETS)}")
    base, mults = PRESETS[preset]
    # drop levels the image is too small for (a 8x8 image supports at most 3 levels to 2x2)
    while len(mults) > 1 and (image_size % 2 ** (len(mults) - 1) or image_size // 2 ** (len(mults) - 1) < 2):
        mults = mults[:-1]
    return UNetConfig(image_size, channels, base, mults, num_classes)


def _res_params(cin: int, cout: int, emb: int) -> int:
    p = 2 * cin + 9 * cin * cout + cout  # norm1, conv1
    p += emb * 2 * cout + 2 * cout  # scale-shift projection
    p += 2 * cout + 9 * cout * cout + cout  # norm2, conv2
    if cin != cout:
        p += cin * cout + cout  # 1x1 skip
    return p


def param_count(cfg: UNetConfig) -> int:
    b, e = cfg.base, cfg.emb
    chans = [b * m for m in cfg.mults]
    p = b * e + e + e * e + e  # time MLP
    p += (cfg.num_classes + 1) * e if cfg.num_classes > 0 else 0
    p += cfg.channels * 9 * b + b  # stem
    prev = b
    for i, ch in enumerate(chans):
        p += _res_params(prev, ch, e)
        if i < len(chans) - 1:
            p += 9 * ch * ch + ch
        prev = ch
    mid = chans[-1]
    p += 2 * _res_params(mid, mid, e) + 2 * mid + 3 * mid * mid + 3 * mid + mid * mid + mid
    prev = mid
    for i in reversed(range(len(chans))):
        p += _res_params(prev + chans[i], chans[i], e)
        if i > 0:
            p += 9 * chans[i] * chans[i] + chans[i]
        prev = chans[i]
    p += 2 * b + 9 * b * cfg.channels + cfg.channels  # out norm, out conv
    return p


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, emb: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(GROUPS, cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.emb = nn.Linear(emb, 2 * cout)
        self.norm2 = nn.GroupNorm(GROUPS, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()
        nn.init.zeros_(self.conv2.weight)
        assert self.conv2.bias is not None  # built with one
        nn.init.zeros_(self.conv2.bias)

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        scale, shift = self.emb(e).chunk(2, dim=1)
        h = self.norm2(h) * (1 + scale[:, :, None, None]) + shift[:, :, None, None]
        return self.skip(x) + self.conv2(F.silu(h))


class SelfAttention(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(GROUPS, ch)
        self.qkv = nn.Conv2d(ch, 3 * ch, 1)
        self.proj = nn.Conv2d(ch, ch, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, 3, c, h * w).transpose(2, 3).unbind(1)
        out = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None])[:, 0]
        return x + self.proj(out.transpose(1, 2).reshape(b, c, h, w))


class UNet(nn.Module):
    """forward(x [B,C,H,W], t [B] in [0,1], y [B] or None) -> velocity [B,C,H,W]."""

    def __init__(self, cfg: UNetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        b, e = cfg.base, cfg.emb
        chans = [b * m for m in cfg.mults]
        self.t_embed = nn.Sequential(nn.Linear(b, e), nn.SiLU(), nn.Linear(e, e))
        self.y_embed = nn.Embedding(cfg.num_classes + 1, e) if cfg.num_classes > 0 else None
        self.stem = nn.Conv2d(cfg.channels, b, 3, padding=1)
        self.down = nn.ModuleList()
        self.downsample = nn.ModuleList()
        prev = b
        for i, ch in enumerate(chans):
            self.down.append(ResBlock(prev, ch, e))
            if i < len(chans) - 1:
                self.downsample.append(nn.Conv2d(ch, ch, 3, stride=2, padding=1))
            prev = ch
        self.mid1 = ResBlock(prev, prev, e)
        self.mid_attn = SelfAttention(prev)
        self.mid2 = ResBlock(prev, prev, e)
        self.up = nn.ModuleList()
        self.upsample = nn.ModuleList()
        for i in reversed(range(len(chans))):
            self.up.append(ResBlock(prev + chans[i], chans[i], e))
            if i > 0:
                self.upsample.append(nn.Conv2d(chans[i], chans[i], 3, padding=1))
            prev = chans[i]
        self.out_norm = nn.GroupNorm(GROUPS, b)
        self.out = nn.Conv2d(b, cfg.channels, 3, padding=1)
        nn.init.zeros_(self.out.weight)
        assert self.out.bias is not None  # built with one
        nn.init.zeros_(self.out.bias)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        cfg = self.cfg
        if x.dim() != 4 or x.shape[1:] != (cfg.channels, cfg.image_size, cfg.image_size):
            raise ValueError(
                f"expected input [B, {cfg.channels}, {cfg.image_size}, {cfg.image_size}], got {list(x.shape)}"
            )
        e = self.t_embed(timestep_embedding(t.reshape(x.shape[0]).to(x.device), cfg.base))
        if self.y_embed is not None:
            if y is None:
                y = torch.full((x.shape[0],), cfg.num_classes, dtype=torch.long, device=x.device)
            e = e + self.y_embed(y)
        e = F.silu(e)
        h = self.stem(x)
        skips = []
        for i, block in enumerate(self.down):
            h = block(h, e)
            skips.append(h)
            if i < len(self.downsample):
                h = self.downsample[i](h)
        h = self.mid2(self.mid_attn(self.mid1(h, e)), e)
        for j, block in enumerate(self.up):
            h = block(torch.cat([h, skips.pop()], dim=1), e)
            if j < len(self.upsample):
                h = self.upsample[j](F.interpolate(h, scale_factor=2.0, mode="nearest"))
        return self.out(F.silu(self.out_norm(h)))
