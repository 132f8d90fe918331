"""The committed state's dtype (`[sync] state_dtype`).

fp32 (the default) must be exactly the format it always was: the same safetensors bytes and
the same state hashes, pinned below from a state computed before the key existed.
"""

from __future__ import annotations

import hashlib

import torch

from bagel.worker.diloco import CellState, OuterConfig, outer_step

SHAPES = {"blk.bias": (6,), "blk.weight": (6, 5), "head.weight": (3, 6)}

# sha256 of the canonical state hash and of the safetensors file of `pinned_state()`, before
# and after two outer steps, computed with the code as it was before `state_dtype` existed
PINNED_INITIAL = (
    "26ad870f57dfad149541f4e00f03092884f6300099103d4aceb023c61ce158d5",
    "96d0639803a861b0d755cb7d8c64e3c24c1cdd4177d169f2060cb033c925e97a",
)
PINNED_STEPPED = (
    "2865b468bc70ede1cbbcb72c7a6704c6f6782d68872a7f19e83e26cea6f475a8",
    "201cc97dc9cb1302c905a71dfc659bb4dbb743939513ed828ab9f7e3dc7360b2",
)


def ramp(shape: tuple[int, ...], salt: int) -> torch.Tensor:
    """Fixed float32 values from integer arithmetic and one IEEE multiply (no random generator,
    no transcendental function), so they are the same bytes on any machine."""
    n = 1
    for s in shape:
        n *= s
    i = torch.arange(n, dtype=torch.int64)
    v = ((i * 2654435761 + salt * 40503) % 2**20 - 2**19).to(torch.float32)
    return (v * 3e-7).reshape(shape)


def pinned_weights() -> dict[str, torch.Tensor]:
    return {k: ramp(s, j) for j, (k, s) in enumerate(sorted(SHAPES.items()))}


def pinned_delta(rnd: int) -> dict[str, torch.Tensor]:
    return {k: ramp(s, 10 * rnd + j) * 0.01 for j, (k, s) in enumerate(sorted(SHAPES.items()))}


def fingerprint(state: CellState) -> tuple[str, str]:
    return state.state_hash(), hashlib.sha256(state.to_safetensors()).hexdigest()


def test_fp32_state_keeps_the_hashes_and_bytes_it_had() -> None:
    w = pinned_weights()
    state = CellState(w, None, w)
    assert fingerprint(state) == PINNED_INITIAL
    for rnd in (1, 2):
        outer_step(state, pinned_delta(rnd), OuterConfig(ema_decay=0.9), ema_step=rnd)
    assert fingerprint(state) == PINNED_STEPPED
