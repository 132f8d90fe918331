"""`bagel-coordinator sample`: images from the latest committed state of a run, with a manifest.

The composed sampler (`models/compose.py`) runs over every cell's verified committed
weights (`coordinator/committed.py`: the average of the committed weights where the run
keeps one, `[ema]`), so it reads a live data dir without disturbing the daemon. Output, in `--out`:

- `grid.png`: one row per class (labelled on the left), and a caption naming every
  substituted cell when `--allow-partial` filled a gap;
- `samples.npy` (float32 [N, C, H, W] in [-1, 1]) and `labels.npy` (int64 [N], -1 when the
  model is unconditional);
- `manifest.json`: the run, its spec hash, for every cell used its checkpoint round,
  committed round, state hash, file sha256 and which weights (`ema` or `committed`), the
  cells missing and why, what stood in for each missing cell, the seed and every other
  sampling parameter.

A cell the sampler needs (every expert cell, and the router unless `--routing prior`,
which routes by the cluster manifest alone) that has no verified committed state makes the
command refuse, naming the cell; with `--allow-partial` the composed sampler's fallbacks
stand in (the same cluster's nearest timestep range, else the router renormalised over the
clusters that have a cell; for a missing router, the cluster prior p(k | y)), and the
manifest and the grid say so.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bagel.coordinator.committed import CommittedRun, load_committed
from bagel.models import compose, flow
from bagel.protocol.atomicfile import atomic_write
from bagel.protocol.runspec import ROUTER_CELL, RunSpec, parse_cell

MAX_SAMPLES = 4096
MAX_STEPS = 1000


class SampleError(Exception):
    """The request cannot be served as asked (a needed cell missing, a bad class list)."""


@dataclass(frozen=True)
class SampleRequest:
    n: int = 8  # per class (conditional) or in all (unconditional)
    classes: tuple[int, ...] | None = None  # None: every class
    steps: int = 32
    guidance: float = 1.0
    seed: int = 0
    routing: compose.Routing = "top1"
    allow_partial: bool = False


def needed_cells(spec: RunSpec, routing: str) -> list[str]:
    """The cells the composed sampler asks for: every expert, and the router unless routing is "prior"."""
    need = list(spec.expert_cells)
    if spec.cells.router and routing != "prior":
        need.append(ROUTER_CELL)
    return need


def substitutions(spec: RunSpec, present: set[str], missing: list[str]) -> dict[str, str]:
    """What stands in for each missing cell, in the composed sampler's fallback order."""
    out: dict[str, str] = {}
    ranges = flow.timestep_ranges(spec.cells.timestep_ranges, spec.cells.t_mean, spec.cells.t_std)
    for cell in missing:
        if cell == ROUTER_CELL:
            out[cell] = "the cluster prior p(k | y) from the cluster manifest (no router)"
            continue
        parsed = parse_cell(cell)
        assert parsed is not None
        k, r = parsed
        lo, hi = ranges[r]
        mid = (lo + hi) / 2
        same = [parse_cell(c) for c in present if c != ROUTER_CELL and c.startswith(f"k{k}.")]
        have = [rr for (_kk, rr) in (p for p in same if p is not None)]
        if have:
            near = min(have, key=lambda rr: (_gap(ranges[rr], mid), rr))
            out[cell] = f"k{k}.r{near} (the same cluster's nearest timestep range)"
        else:
            out[cell] = "another cluster's cell, chosen by the router renormalised over the clusters that have one"
    return out


def _gap(r: tuple[float, float], t: float) -> float:
    """Distance of t from a timestep range (0 inside), as the composed sampler measures it."""
    lo, hi = r
    return 0.0 if lo <= t <= hi else min(abs(t - lo), abs(t - hi))


def run_sample(data_dir: str | Path, out: str | Path, req: SampleRequest) -> dict[str, Any]:
    """Sample and write grid, arrays and manifest into `out`; returns the manifest."""
    if not 1 <= req.n <= MAX_SAMPLES:
        raise SampleError(f"--n must be between 1 and {MAX_SAMPLES}")
    if not 1 <= req.steps <= MAX_STEPS:
        raise SampleError(f"--steps must be between 1 and {MAX_STEPS}")
    if req.routing not in compose.ROUTING_RULES:
        raise SampleError(f"--routing must be one of {', '.join(compose.ROUTING_RULES)}")
    run = load_committed(data_dir)
    return sample_run(run, Path(out), req)


def sample_run(run: CommittedRun, out: Path, req: SampleRequest) -> dict[str, Any]:
    spec = run.spec
    nc = spec.model.num_classes
    if req.classes is not None and nc == 0:
        raise SampleError("--classes: this run's model is unconditional")
    classes = list(req.classes) if req.classes is not None else list(range(nc))
    bad = [c for c in classes if not 0 <= c < nc]
    if bad:
        raise SampleError(f"--classes: {bad} outside the run's classes 0..{nc - 1}")
    need = needed_cells(spec, req.routing)
    missing = [c for c in need if c not in run.cells]
    if missing and not req.allow_partial:
        first = missing[0]
        raise SampleError(
            f"cell {first} has no committed state to sample from ({run.missing.get(first, 'missing')})"
            + (f"; {len(missing) - 1} more cell(s) missing" if len(missing) > 1 else "")
            + "; --allow-partial samples with substitutes"
        )
    if not any(c != ROUTER_CELL for c in run.cells):
        raise SampleError("no expert cell of this run has a committed state yet")
    used = {c: w for c, w in run.cells.items() if c in need}
    subs = substitutions(spec, set(used), missing)
    composed = compose.from_cells(spec, {c: w.model() for c, w in used.items()})
    gen = torch.Generator().manual_seed(req.seed)
    composed.routing = req.routing
    composed.generator = gen
    m, ch = spec.model.image_size, spec.model.channels
    labels = torch.tensor([c for c in classes for _ in range(req.n)], dtype=torch.long) if nc > 0 else None
    count = len(labels) if labels is not None else req.n
    noise = torch.randn(count, ch, m, m, generator=gen)
    images = compose.sample(composed, noise, labels, steps=req.steps, guidance=req.guidance)
    out.mkdir(parents=True, exist_ok=True)
    samples = images.clamp(-1, 1).float().numpy()
    label_arr = labels.numpy() if labels is not None else np.full(count, -1, dtype=np.int64)
    _save_npy(out / "samples.npy", samples)
    _save_npy(out / "labels.npy", label_arr.astype(np.int64))
    caption = [f"substituted {c}: {s}" for c, s in subs.items()]
    rows = [str(c) for c in classes] if nc > 0 else ["-"] * ((count + req.n - 1) // req.n)
    save_labelled_grid(images, rows, req.n if nc > 0 else min(count, 10), out / "grid.png", caption)
    manifest: dict[str, Any] = {
        "run_id": spec.run.id,
        "spec_hash": run.spec_hash,
        "seed": req.seed,
        "n": req.n,
        "classes": classes,
        "steps": req.steps,
        "guidance": req.guidance,
        "routing": req.routing,
        "allow_partial": req.allow_partial,
        "cells": {c: w.manifest() for c, w in sorted(used.items())},
        "missing": {c: run.missing.get(c, "missing") for c in missing},
        "substituted": subs,
        "files": {"grid": "grid.png", "samples": "samples.npy", "labels": "labels.npy"},
    }
    atomic_write(out / "manifest.json", json.dumps(manifest, indent=2, sort_keys=True).encode())
    return manifest


def _save_npy(path: Path, arr: np.ndarray) -> None:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    atomic_write(path, buf.getvalue())


def save_labelled_grid(
    images: torch.Tensor, rows: list[str], per_row: int, path: Path, caption: list[str], scale: int = 4
) -> None:
    """Images in [-1, 1] as a PNG grid, one row per label (written on the left), caption lines below."""
    from PIL import Image, ImageDraw

    x = ((images.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu()
    n, c, h, w = x.shape
    cell_h, cell_w = (h + 1) * scale, (w + 1) * scale
    margin, line = 28, 12
    width = max(margin + per_row * cell_w + scale, 8 + 6 * max((len(s) for s in caption), default=0))
    height = len(rows) * cell_h + scale + line * len(caption) + (4 if caption else 0)
    canvas = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    for i in range(n):
        r, q = divmod(i, per_row)
        arr = x[i].permute(1, 2, 0).numpy()
        tile = Image.fromarray(arr[:, :, 0] if c == 1 else arr, mode="L" if c == 1 else "RGB").convert("RGB")
        tile = tile.resize((w * scale, h * scale), Image.Resampling.NEAREST)
        canvas.paste(tile, (margin + q * cell_w + scale, r * cell_h + scale))
    for r, label in enumerate(rows):
        draw.text((4, r * cell_h + cell_h // 2 - 5), label, fill=(0, 0, 0))
    for j, text in enumerate(caption):
        draw.text((4, len(rows) * cell_h + scale + 2 + j * line), text, fill=(180, 0, 0))
    buf = io.BytesIO()
    canvas.save(buf, format="PNG")
    atomic_write(path, buf.getvalue())
