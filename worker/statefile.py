"""A committed cell state as the bytes of its safetensors file, read straight from its tensors.

A donor serves its committed state to joiners as a safetensors file (`worker/statesync.py`).
Serialising it up front (`CellState.to_safetensors`) copies every tensor into one bytes
object: the weights, the outer momentum and the average, three float32 copies of the
cell's parameters for each state served, and a donor keeps its last two. Measured on a
CPU worker of a 32.5 M-parameter cell, that was 6 of the 56 to 60 copies it held
(`bench/worker_memory.py`).

`StateFile` holds the state's tensors (a committed state is never changed in place: every
outer step works on a clone) and the file's small header, and reads any byte range of the
file from them: a range inside one tensor is a view of that tensor's memory, one across
tensors is joined (a copy of at most the range). Its sha256 and per-piece digests are
computed by streaming over the same views.

The bytes are exactly those `safetensors.torch.save(state.to_flat())` writes, so donors of
this and of earlier versions, which serialised with safetensors itself, still serve
interchangeable byte ranges of one file: a state has one dtype, and for one dtype
safetensors (0.4 and later) lays tensors out sorted by name, lists them in that order in a
compact JSON header with no metadata, and pads the header with spaces to a multiple of 8
bytes (`tests/test_statefile.py` checks byte equality against the library). The format:
https://github.com/huggingface/safetensors#format
"""

from __future__ import annotations

import bisect
import hashlib
import json
import struct
import sys
from collections.abc import Iterator

import torch

from bagel.worker.diloco import CellState, StateFormatError

_DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_HEADER_ALIGN = 8


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """A read-only byte view of a CPU tensor's elements in memory order (no copy when contiguous)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data.toreadonly()


class StateFile:
    """The safetensors file of a `CellState`, as views of its tensors plus a header.

    The state must not be changed in place while its file is served (committed states
    never are); the tensors are held, so the file stays valid as long as this object."""

    def __init__(self, state: CellState) -> None:
        if sys.byteorder != "little":  # safetensors stores little-endian; a view would not be
            raise StateFormatError("a state file is served only from a little-endian host")
        dtype_name = _DTYPE_NAMES.get(state.dtype)
        if dtype_name is None:
            raise StateFormatError(f"no safetensors name for state dtype {state.dtype}")
        flat = state.to_flat()
        header: dict[str, dict[str, object]] = {}
        views: list[memoryview] = []
        at = 0
        for name in sorted(flat):  # code-point order is UTF-8 byte order, as the Rust sort
            t = flat[name]
            if t.dtype != state.dtype or t.device.type != "cpu":
                raise StateFormatError(f"state tensor {name!r} is not a CPU tensor of the state's dtype")
            v = _tensor_bytes(t)
            header[name] = {"dtype": dtype_name, "shape": list(t.shape), "data_offsets": [at, at + v.nbytes]}
            views.append(v)
            at += v.nbytes
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        text += b" " * (-len(text) % _HEADER_ALIGN)
        head = memoryview(struct.pack("<Q", len(text)) + text)
        self._segments = [head, *views]
        self._starts: list[int] = []
        pos = 0
        for seg in self._segments:
            self._starts.append(pos)
            pos += seg.nbytes
        self.nbytes = pos

    def __len__(self) -> int:
        return self.nbytes

    def slices(self, start: int, end: int) -> Iterator[memoryview]:
        """Views covering bytes [start, end) of the file, in order (empty ones skipped)."""
        if not 0 <= start <= end <= self.nbytes:
            raise ValueError(f"range [{start}, {end}) is outside the {self.nbytes}-byte file")
        i = bisect.bisect_right(self._starts, start) - 1
        while start < end:
            seg, seg_start = self._segments[i], self._starts[i]
            a = start - seg_start
            b = min(seg.nbytes, end - seg_start)
            if b > a:
                yield seg[a:b]
                start += b - a
            i += 1

    def read(self, start: int, end: int) -> bytes | memoryview:
        """Bytes [start, end): a view when they lie in one tensor (or the header), else joined."""
        parts = list(self.slices(start, end))
        if len(parts) == 1:
            return parts[0]
        return b"".join(parts)

    def chunks(self, start: int, end: int, chunk_nbytes: int) -> Iterator[bytes | memoryview]:
        """Bytes [start, end) in consecutive chunks of `chunk_nbytes` (the last may be shorter)."""
        if chunk_nbytes <= 0:
            raise ValueError("chunk_nbytes must be positive")
        for at in range(start, end, chunk_nbytes):
            yield self.read(at, min(end, at + chunk_nbytes))

    def digests(self, piece_nbytes: int) -> tuple[str, bytes]:
        """(the file's sha256 in hex, the concatenated sha256 digests of its consecutive
        `piece_nbytes` pieces), in one pass over the tensors and without copying them."""
        if piece_nbytes <= 0:
            raise ValueError("piece_nbytes must be positive")
        whole = hashlib.sha256()
        pieces = bytearray()
        for at in range(0, self.nbytes, piece_nbytes):
            piece = hashlib.sha256()
            for s in self.slices(at, min(self.nbytes, at + piece_nbytes)):
                whole.update(s)
                piece.update(s)
            pieces += piece.digest()
        return whole.hexdigest(), bytes(pieces)
