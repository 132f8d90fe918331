"""`[model] init_from`: start a run's cells from exported weights instead of a fresh initialisation.

The weights are a `bagel-coordinator export` folder (either layout; each cell starts from
the cell of the same id) or one `.safetensors` file (a model's state dict, or a stored
checkpoint whose `w.*` weights are taken), which starts every cell whose model has the
same tensor names. A cell with no match starts fresh. A tensor of a matching cell whose
shape differs, or a tensor missing from it, is an error naming the tensor; the coordinator
checks it when it starts serving (`check`), and every worker applies the weights when it
builds a cell's round-0 state (`apply`), after checking that they hash to the digest the
spec hash covers (`protocol/runspec.py`'s `weights_digest`), so every replica starts from
the same bits.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from bagel.protocol.runspec import RunSpec


class InitFromError(ValueError):
    """The `model.init_from` weights are missing, changed, or do not fit a cell's model."""


def _path(spec: RunSpec) -> Path:
    return Path(spec.init_path or spec.model.init_from)


@functools.lru_cache(maxsize=2)
def _load(path: str, sha256: str) -> dict[str, dict[str, torch.Tensor]]:
    from bagel.models.export import ExportError, read_weights
    from bagel.protocol.runspec import SpecError, weights_digest

    try:
        got = weights_digest(path)
        if got != sha256:
            raise InitFromError(f"model.init_from: {path} has digest {got[:16]}..., the run's is {sha256[:16]}...")
        return read_weights(path)
    except (ExportError, SpecError, OSError) as e:
        raise InitFromError(f"model.init_from: {e}") from None


def weights(spec: RunSpec) -> dict[str, dict[str, torch.Tensor]]:
    """The init weights by cell id ("*" for a single file), verified against the run's digest."""
    if not spec.init_sha256:
        raise InitFromError("model.init_from: the weights' digest is unknown (load the spec with load_spec)")
    return _load(str(_path(spec)), spec.init_sha256)


def _match(
    table: dict[str, dict[str, torch.Tensor]], cell_id: str, shapes: dict[str, tuple[int, ...]]
) -> dict[str, torch.Tensor] | None:
    """The weights that start `cell_id` (None: it starts fresh); InitFromError naming a misfit tensor."""
    if cell_id in table:
        w = table[cell_id]
    elif "*" in table and set(table["*"]) == set(shapes):
        w = table["*"]
    else:
        return None
    for name, shape in shapes.items():
        if name not in w:
            raise InitFromError(f"model.init_from: cell {cell_id}: tensor {name!r} is missing from the checkpoint")
        if tuple(w[name].shape) != shape:
            raise InitFromError(
                f"model.init_from: cell {cell_id}: tensor {name!r} is {list(w[name].shape)} in the checkpoint, "
                f"the model has {list(shape)}"
            )
    extra = sorted(set(w) - set(shapes))
    if extra:
        raise InitFromError(f"model.init_from: cell {cell_id}: tensor {extra[0]!r} is not in the cell's model")
    return w


def _shapes(spec: RunSpec, cell_id: str) -> dict[str, tuple[int, ...]]:
    from bagel.models.experts import WEIGHT_PREFIX, cell_state_schema

    return {k[len(WEIGHT_PREFIX) :]: s for k, (_dt, s) in cell_state_schema(spec, cell_id).items() if k[:2] == "w."}


def check(spec: RunSpec) -> list[str]:
    """The cells `init_from` starts (InitFromError on any misfit); checked without building a model."""
    table = weights(spec)
    return [c for c in spec.cell_ids if _match(table, c, _shapes(spec, c)) is not None]


def apply(spec: RunSpec, cell_id: str, model: nn.Module) -> bool:
    """Copy the init weights of `cell_id` into `model` (True), or leave it as built (False)."""
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
    w = _match(weights(spec), cell_id, shapes)
    if w is None:
        return False
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in shapes:
                p.copy_(w[name].to(p.dtype))
    return True
