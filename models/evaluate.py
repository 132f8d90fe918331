"""Offline evaluation of cells and composed models: losses per t-bucket, a digits classifier
for class accuracy, digits-FD and a memorisation check, and PNG sample grids.

No network, no downloaded weights: the "Inception" of digits-FD is a small CNN this module
trains on the run's digits training split in a few seconds, deterministically. The Fréchet
distance (Heusel et al. 2017, FID) is computed on its penultimate features.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from bagel.models import flow

VelocityFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
FEATURES = 32


# --- held-out loss per t-bucket ---------------------------------------------------------


@torch.no_grad()
def loss_per_bucket(
    velocity: VelocityFn,
    x: torch.Tensor,
    y: torch.Tensor | None,
    edges: Sequence[float],
    seed: int = 0,
    batch: int = 512,
) -> list[float]:
    """Held-out flow-matching loss in each [edges[i], edges[i+1]] bucket of t.

    Every sample is scored once per bucket at t uniform in the bucket, with noise from a
    generator seeded by `seed`, so two models are compared on identical (x0, t, eps)."""
    if len(edges) < 2 or any(b <= a for a, b in pairwise(edges)):
        raise ValueError(f"bucket edges must increase, got {list(edges)}")
    gen = torch.Generator().manual_seed(seed)
    out: list[float] = []
    for lo, hi in pairwise(edges):
        total = 0.0
        for i in range(0, len(x), batch):
            x0 = x[i : i + batch]
            yb = y[i : i + batch] if y is not None else None
            t = lo + (hi - lo) * torch.rand(len(x0), generator=gen)
            eps = torch.randn(x0.shape, generator=gen)
            xt = flow.interpolate(x0, eps, t)
            err = (velocity(xt, t, yb) - (eps - x0)) ** 2
            total += float(err.flatten(1).mean(dim=1).sum())
        out.append(total / len(x))
    return out


# --- the digits classifier ----------------------------------------------------------------


class DigitsClassifier(nn.Module):
    """A small CNN for 8x8 digits; `features` is the penultimate layer used by digits-FD."""

    def __init__(self, classes: int = 10, features: int = FEATURES) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 4 * 4, features)
        self.out = nn.Linear(features, classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv1(x))
        h = F.max_pool2d(F.relu(self.conv2(h)), 2)
        return F.relu(self.fc(h.flatten(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.features(x))


def train_classifier(
    x: torch.Tensor, y: torch.Tensor, *, epochs: int = 30, seed: int = 0, classes: int = 10
) -> DigitsClassifier:
    """Train the digits classifier (AdamW, light shift augmentation), deterministically."""
    if x.shape[1:] != (1, 8, 8):
        raise ValueError(f"the digits classifier needs [N, 1, 8, 8] images, got {list(x.shape)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DigitsClassifier(classes)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x), 64):
            idx = perm[i : i + 64]
            xb = x[idx]
            # random 1-pixel shifts (padding with background) make the features less brittle
            dx, dy = torch.randint(-1, 2, (2,), generator=gen).tolist()
            xb = torch.roll(F.pad(xb, (1, 1, 1, 1), value=-1.0), (dy, dx), dims=(2, 3))[:, :, 1:-1, 1:-1]
            loss = F.cross_entropy(model(xb), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.eval()


@torch.no_grad()
def classify(model: DigitsClassifier, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(predicted labels, penultimate features) of images in [-1, 1]."""
    feats = model.features(x.clamp(-1, 1))
    return model.out(feats).argmax(dim=1), feats


def frechet_distance(a: np.ndarray, b: np.ndarray) -> float:
    """||mu_a - mu_b||^2 + Tr(S_a + S_b - 2 (S_a S_b)^(1/2)) between two feature sets.

    Tr((S_a S_b)^(1/2)) is computed as the sum of square roots of the eigenvalues of the
    symmetric S_a^(1/2) S_b S_a^(1/2), which avoids a non-symmetric matrix square root."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1] or min(len(a), len(b)) < 2:
        raise ValueError(f"need two [N>=2, F] feature sets of equal width, got {a.shape} and {b.shape}")
    mu_a, mu_b = a.mean(0), b.mean(0)
    s_a, s_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    w, v = np.linalg.eigh(s_a)
    root_a = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    mid = np.linalg.eigvalsh(root_a @ s_b @ root_a)
    tr_root = float(np.sqrt(np.clip(mid, 0, None)).sum())
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(s_a) + np.trace(s_b) - 2.0 * tr_root)


def nearest_distances(x: torch.Tensor, reference: torch.Tensor, exclude_self: bool = False) -> torch.Tensor:
    """Pixel-space L2 distance from each row of x to its nearest row of `reference`."""
    d = torch.cdist(x.flatten(1).double(), reference.flatten(1).double())
    if exclude_self:
        d.fill_diagonal_(float("inf"))
    return d.min(dim=1).values.float()


@dataclass(frozen=True)
class SampleReport:
    class_acc: float  # fraction of conditional samples the classifier labels as requested
    digits_fd: float  # Fréchet distance to the training split in classifier features
    reference_fd: float  # the same for real held-out images: the floor a perfect model sees
    nn_ratio: float  # median NN distance to train: samples / real held-out (< ~0.5: copying)
    copy_fraction: float  # samples closer to a training image than 1/4 of the held-out median

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


@torch.no_grad()
def evaluate_samples(
    samples: torch.Tensor,
    labels: torch.Tensor | None,
    classifier: DigitsClassifier,
    x_train: torch.Tensor,
    x_heldout: torch.Tensor,
) -> SampleReport:
    """Class accuracy, digits-FD and the memorisation check of generated digits."""
    samples = samples.clamp(-1, 1)
    pred, feats = classify(classifier, samples)
    _, f_train = classify(classifier, x_train)
    _, f_held = classify(classifier, x_heldout)
    acc = float((pred == labels).float().mean()) if labels is not None else float("nan")
    fd = frechet_distance(feats.numpy(), f_train.numpy())
    ref = frechet_distance(f_held.numpy(), f_train.numpy())
    nn_gen = nearest_distances(samples, x_train)
    nn_held = nearest_distances(x_heldout, x_train)
    med_held = float(nn_held.median())
    return SampleReport(
        class_acc=acc,
        digits_fd=fd,
        reference_fd=ref,
        nn_ratio=float(nn_gen.median()) / med_held,
        copy_fraction=float((nn_gen < 0.25 * med_held).float().mean()),
    )


def save_grid(images: torch.Tensor, path: str | Path, nrow: int = 10, scale: int = 4) -> Path:
    """Write images in [-1, 1] ([N, C, H, W]) as one PNG grid, each pixel scale x scale."""
    from PIL import Image

    x = ((images.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu()
    n, c, h, w = x.shape
    rows = (n + nrow - 1) // nrow
    pad = 1
    grid = torch.full((c, rows * (h + pad) + pad, nrow * (w + pad) + pad), 255, dtype=torch.uint8)
    for i in range(n):
        r, q = divmod(i, nrow)
        grid[:, pad + r * (h + pad) : pad + r * (h + pad) + h, pad + q * (w + pad) : pad + q * (w + pad) + w] = x[i]
    arr = grid.permute(1, 2, 0).numpy()
    img = Image.fromarray(arr[:, :, 0] if c == 1 else arr, mode="L" if c == 1 else "RGB")
    img = img.resize((img.width * scale, img.height * scale), Image.Resampling.NEAREST)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path
