"""Top-k sparsification: keep the ``k = ceil(fraction * numel)`` largest-magnitude values.

Meant to be used with error feedback (``feedback.ErrorFeedback``; Stich et al., "Sparsified
SGD with Memory", NeurIPS 2018; Lin et al., "Deep Gradient Compression", ICLR 2018): what
is dropped this round is carried into the next one by the worker, not by the codec.

Compact index encoding: the index space is cut into chunks of 2**16 values. The body holds

    k        float32  kept values, in increasing index order
    chunks   uint32   how many kept indices fall in each chunk (chunks = ceil(numel / 65536))
    k        uint16   each kept index's offset inside its chunk
    0..3     zero     padding to a 4-byte boundary

so an index costs 2 bytes plus 4 bytes per 65536 values, instead of 4 or 8. ``count`` = k.

The decoder checks: every chunk count <= its chunk's length, counts summing to k, indices
(chunk * 65536 + offset) strictly increasing (sorted, unique) and < numel, values finite,
padding zero. Kept values are exact; the declared error bound is the largest dropped
magnitude, which is at most the smallest kept one. Ties at the threshold go to the lowest
indices (see ``TopKCodec._select``), so the kept set is a function of the input alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Codec, register, require_finite
from .wire import CodecError, CodecId, Header, align4

CHUNK_BITS = 16
CHUNK = 1 << CHUNK_BITS
_SCAN = 1 << 20  # values per pass of the candidate scan (4 MiB scratch)


@dataclass(frozen=True)
class TopKCodec(Codec):
    fraction: float = 0.01

    codec_id: ClassVar[CodecId] = CodecId.TOPK

    def __post_init__(self) -> None:
        f = self.fraction
        if not isinstance(f, (int, float)) or not math.isfinite(f) or not 0.0 < f <= 1.0:
            raise ValueError(f"topk: fraction must be in (0, 1], got {f!r}")

    @property
    def name(self) -> str:
        return f"topk:{self.fraction!r}"

    def kept(self, numel: int) -> int:
        return min(numel, math.ceil(self.fraction * numel))

    @staticmethod
    def _body_nbytes(numel: int, k: int) -> int:
        return 4 * k + 4 * (-(-numel // CHUNK)) + align4(2 * k)

    def _layout(self, numel: int) -> tuple[int, int, int]:
        k = self.kept(numel)
        return 0, k, self._body_nbytes(numel, k)

    def _select(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """Sorted int64 indices of the canonical top k: every |x| above the k-th largest
        magnitude T, then the lowest-index values equal to T until there are k.

        Defined without reference to ``torch.topk``'s unspecified tie order, so the choice
        (and the bytes) are the same everywhere. Computed on a candidate set: a threshold
        taken from a strided sample of |x| (with a 25% margin) selects a few more than k
        candidates in one masked pass, and the exact selection runs on those only; if the
        sample was unlucky and too few qualify, the threshold is lowered until enough do."""
        n = x.numel()
        if k == n:
            return torch.arange(n, dtype=torch.int64)
        # ~2048 expected top values in the sample: the margin is then > 10 standard deviations.
        stride = max(1, k // 2048)
        sample = x[::stride].abs()
        want = min(sample.numel(), math.ceil(1.25 * k / stride) + 16)
        threshold = float(torch.topk(sample, want, sorted=False).values.min())
        while True:
            cand = _at_least(x, threshold)
            if cand.numel() >= k:
                break
            # The sample under-estimated the tail: lower the threshold (0 admits every index).
            threshold = threshold / 2.0 if threshold > 1e-30 else 0.0
        mags = x[cand].abs()
        c = cand.numel()
        t = float(torch.kthvalue(mags, c - k + 1).values)  # the k-th largest magnitude
        keep = mags > t
        ties = mags == t
        need = k - int(keep.sum())
        keep |= ties & (torch.cumsum(ties, 0) <= need)
        return cand[keep]

    def _encode_body(self, x: torch.Tensor, count: int, body: torch.Tensor, generator: torch.Generator | None) -> int:
        require_finite(x)
        n, k = x.numel(), count
        nchunks = -(-n // CHUNK)
        body.zero_()
        if k == 0:
            return 0
        idx = self._select(x, k)
        torch.index_select(x, 0, idx, out=body[: 4 * k].view(torch.float32))
        counts = torch.bincount(idx >> CHUNK_BITS, minlength=nchunks)
        body[4 * k : 4 * k + 4 * nchunks].view(torch.int32).copy_(counts)
        offsets = (idx & (CHUNK - 1)).to(torch.int32)
        # Low two bytes of each little-endian int32 = the uint16 offset.
        start = 4 * k + 4 * nchunks
        body[start : start + 2 * k].view(k, 2).copy_(offsets.view(torch.uint8).view(k, 4)[:, :2])
        return 0

    @classmethod
    def check_header(cls, h: Header) -> None:
        if h.block != 0:
            raise CodecError(f"topk: block must be 0, got {h.block}")
        if h.count > h.numel:
            raise CodecError(f"topk: {h.count} kept values declared for {h.numel} elements")
        expected = cls._body_nbytes(h.numel, h.count)
        if h.body_nbytes != expected:
            raise CodecError(f"topk: body of {h.body_nbytes} bytes, expected {expected}")

    @classmethod
    def decode_body(cls, h: Header, body: torch.Tensor, out: torch.Tensor) -> None:
        n, k = h.numel, h.count
        nchunks = -(-n // CHUNK)
        values = body[: 4 * k].view(torch.float32)
        counts = body[4 * k : 4 * k + 4 * nchunks].view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        start = 4 * k + 4 * nchunks
        if bool(body[start + 2 * k :].any()):
            raise CodecError("topk: nonzero padding")
        if nchunks:
            limits = torch.full((nchunks,), CHUNK, dtype=torch.int64)
            limits[-1] = n - (nchunks - 1) * CHUNK
            if bool((counts > limits).any()):
                raise CodecError("topk: a chunk declares more kept values than it has elements")
        if int(counts.sum()) != k:
            raise CodecError(f"topk: chunk counts sum to {int(counts.sum())}, header declares {k}")
        if k == 0:
            out.zero_()
            return
        offsets = body[start : start + 2 * k].view(torch.int16).to(torch.int64) & (CHUNK - 1)
        chunk_of = torch.repeat_interleave(torch.arange(nchunks, dtype=torch.int64), counts)
        idx = offsets.add_(chunk_of << CHUNK_BITS)
        if k > 1 and not bool((idx[1:] > idx[:-1]).all()):
            raise CodecError("topk: indices are not strictly increasing (unsorted or duplicated)")
        if int(idx[-1]) >= n:
            raise CodecError(f"topk: index {int(idx[-1])} out of range for {n} elements")
        if not bool(torch.isfinite(values).all()):
            raise CodecError("topk: non-finite value")
        out.zero_()
        out[idx] = values

    def error_bound(self, t: torch.Tensor) -> float:
        n = t.numel()
        k = self.kept(n)
        if k >= n:
            return 0.0
        a = t.detach().reshape(-1).float().abs()
        return float(torch.topk(a, k + 1).values[-1])

    def nominal_rel_error(self) -> float:
        # Standard normal x, c the (1 - f) quantile of |x|: the kept energy is
        # E[x^2; |x| > c] = f + 2 c phi(c), so ||err||^2 / ||x||^2 = 1 - f - 2 c phi(c).
        f = self.fraction
        if f >= 1.0:
            return 0.0
        c = _abs_normal_quantile(1.0 - f)
        phi = math.exp(-0.5 * c * c) / math.sqrt(2 * math.pi)
        kept_energy = f + 2.0 * c * phi  # E[x^2; |x| > c] for a standard normal
        return math.sqrt(max(0.0, 1.0 - kept_energy))


def _at_least(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Sorted indices i with |x[i]| >= threshold, chunk by chunk through a cached scratch."""
    n = x.numel()
    mask = torch.empty(n, dtype=torch.bool)
    scratch = torch.empty(min(n, _SCAN), dtype=torch.float32)
    for s in range(0, n, _SCAN):
        e = min(n, s + _SCAN)
        a = torch.abs(x[s:e], out=scratch[: e - s])
        torch.ge(a, threshold, out=mask[s:e])
    return mask.nonzero().view(-1)


def _abs_normal_quantile(p: float) -> float:
    """c with P(|Z| < c) = p for a standard normal Z (bisection on erf; pure and exact enough)."""
    lo, hi = 0.0, 40.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if math.erf(mid / math.sqrt(2.0)) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _parse(opts: list[str]) -> Codec:
    if len(opts) != 1:
        raise ValueError(f"topk takes exactly one option, the kept fraction (e.g. 'topk:0.01'), got {opts!r}")
    try:
        fraction = float(opts[0])
    except ValueError:
        raise ValueError(f"topk: fraction must be a number, got {opts[0]!r}") from None
    return TopKCodec(fraction=fraction)


register("topk", TopKCodec, _parse)
