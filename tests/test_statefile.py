"""StateFile: a committed state's safetensors file read from its tensors, byte for byte the
file safetensors itself writes, so donors that serialised whole and donors that read from
tensors serve interchangeable ranges of one file."""

from __future__ import annotations

import hashlib
import json
import random
import struct

import numpy as np
import pytest
import safetensors.torch
import torch

from bagel.worker.diloco import CellState, StateFormatError
from bagel.worker.statefile import StateFile
from bagel.worker.statesync import piece_digests

pytestmark = pytest.mark.timeout(30)


def _state(dtype: torch.dtype, *, ema: bool, seed: int = 0) -> CellState:
    g = torch.Generator().manual_seed(seed)
    # names chosen to sort differently by length, punctuation, case and non-ASCII bytes
    shapes = {
        "blocks.0.attn.weight": (7, 5),
        "blocks.0.attn_bias": (5,),
        "blocks.10.mlp.weight": (3, 4, 2),
        "blocks.1.mlp.weight": (9,),
        "Blocks.upper": (2, 2),
        "emb": (),  # a 0-dim tensor
        "empty": (0, 3),
        "zeta.ü": (4,),
        "a": (1,),
    }
    weights = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    weights["transposed"] = torch.randn(6, 4, generator=g).t()  # not contiguous when given
    momentum = {n: torch.randn(t.shape, generator=g) for n, t in weights.items()}
    return CellState(weights, momentum, weights if ema else None, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ema", [False, True])
def test_the_file_is_the_bytes_safetensors_writes(dtype: torch.dtype, ema: bool) -> None:
    state = _state(dtype, ema=ema)
    want = safetensors.torch.save(state.to_flat())
    f = StateFile(state)
    assert len(f) == f.nbytes == len(want)
    assert bytes(f.read(0, f.nbytes)) == want == state.to_safetensors()
    back = CellState.from_safetensors(bytes(f.read(0, f.nbytes)), dtype=dtype)
    assert back.state_hash() == state.state_hash()


def test_any_range_and_chunking_reads_the_same_bytes() -> None:
    state = _state(torch.float32, ema=True, seed=3)
    want = state.to_safetensors()
    f = StateFile(state)
    rng = random.Random(7)
    for _ in range(300):
        a = rng.randrange(0, len(want) + 1)
        b = rng.randrange(a, len(want) + 1)
        assert bytes(f.read(a, b)) == want[a:b], (a, b)
    for size in (1, 3, 8, 64, 1000, len(want), len(want) + 5):
        chunks = [bytes(c) for c in f.chunks(0, len(want), size)]
        assert b"".join(chunks) == want
        assert all(len(c) == size for c in chunks[:-1]) and 0 < len(chunks[-1]) <= size
    assert b"".join(bytes(c) for c in f.chunks(17, 411, 50)) == want[17:411]
    assert list(f.chunks(5, 5, 50)) == []


def test_a_range_inside_one_tensor_is_a_view_of_the_state_not_a_copy() -> None:
    weights = {"big": torch.arange(1000, dtype=torch.float32), "small": torch.ones(3)}
    state = CellState(weights)
    f = StateFile(state)
    data = state.to_safetensors()
    (n,) = struct.unpack("<Q", data[:8])
    w_big = 8 + n + json.loads(data[8 : 8 + n])["w.big"]["data_offsets"][0]
    view = f.read(w_big + 40, w_big + 80)
    assert isinstance(view, memoryview) and view.readonly
    assert np.shares_memory(np.asarray(view), state.weights["big"].numpy())
    assert np.frombuffer(view, dtype=np.float32).tolist() == list(range(10, 20))


def test_digests_are_the_sha256_of_the_file_and_of_its_pieces() -> None:
    state = _state(torch.bfloat16, ema=True, seed=5)
    data = state.to_safetensors()
    f = StateFile(state)
    for piece in (1, 7, 64, 256, len(data), 10 * len(data)):
        sha, pieces = f.digests(piece)
        assert sha == hashlib.sha256(data).hexdigest()
        assert pieces == piece_digests(data, piece)


def test_bad_ranges_and_sizes_are_refused() -> None:
    f = StateFile(_state(torch.float32, ema=False))
    for a, b in ((-1, 4), (5, 4), (0, f.nbytes + 1)):
        with pytest.raises(ValueError):
            f.read(a, b)
    with pytest.raises(ValueError):
        list(f.chunks(0, 10, 0))
    with pytest.raises(ValueError):
        f.digests(0)


def test_a_state_whose_tensor_was_swapped_for_another_dtype_is_refused() -> None:
    state = _state(torch.float32, ema=False)
    state.weights["a"] = state.weights["a"].to(torch.float64)
    with pytest.raises(StateFormatError):
        StateFile(state)
