"""Canonical hash of a cell's state (weights + outer momentum), shared by workers and coordinator.

A round commits when a quorum of members reports the same hash, so every party must
hash the same way in every process: tensors in sorted name order, each as its name,
dtype, shape and raw little-endian bytes. bf16 has no numpy dtype, so its bits are
hashed as uint16. The hash never depends on file layout, so a safetensors checkpoint
and an in-memory state dict of the same tensors hash identically.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np


def _as_bytes(value: Any) -> tuple[str, tuple[int, ...], bytes]:
    try:  # torch tensors, without importing torch in processes that never use it
        import torch

        if isinstance(value, torch.Tensor):
            t = value.detach().to("cpu").contiguous()
            dtype = str(t.dtype).removeprefix("torch.")
            if t.dtype == torch.bfloat16:
                arr = t.view(torch.int16).numpy()
            else:
                arr = t.numpy()
            return dtype, tuple(t.shape), arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
    except ImportError:  # pragma: no cover
        pass
    arr = np.ascontiguousarray(value)
    return str(arr.dtype), tuple(arr.shape), arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()


def state_hash(tensors: Mapping[str, Any]) -> str:
    """Hex sha256 of a name -> tensor mapping (torch tensors or numpy arrays)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        dtype, shape, raw = _as_bytes(tensors[name])
        header = f"{name}\0{dtype}\0{','.join(map(str, shape))}\0".encode()
        h.update(struct.pack("<I", len(header)))
        h.update(header)
        h.update(struct.pack("<Q", len(raw)))
        h.update(raw)
    return h.hexdigest()
