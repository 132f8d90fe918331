"""Blockwise absmax quantization: ``int8`` (levels -127..127) and ``int4`` (-7..7, two per byte).

The flat tensor is cut into blocks of ``block`` values (the last one may be shorter). Each
block stores one float32 scale ``s = max(absmax / Q, 2**-126)`` and its values as integers
``q = round(x * (1 / s))`` (half to even) with ``|q| <= Q`` (Q = 127 or 7). This is the
absmax scheme of Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (ICLR
2022), without the dynamic (non-linear) code book: a linear code keeps decode a single
multiply, which is exact in IEEE arithmetic and therefore bit-identical on every machine.

Stochastic mode (``:stochastic``) rounds ``q = floor(x * (1 / s) + u)`` with ``u`` uniform
on a 2**-16 grid in (0, 1), drawn from the caller's generator, so ``E[q * s] = x`` to
within 2**-17 * s (unbiased rounding as in QSGD, Alistarh et al. 2017).

Body layout: ``count`` float32 scales, then the codes: ``numel`` int8 bytes (int8), or
``ceil(numel / 2)`` bytes for int4 with element ``2i`` in the low nibble and ``2i+1`` in the
high nibble, each nibble holding ``q + 8`` (1..15; 8 is zero, and 0 never occurs).

Error bound (declared, tested): ``|x - x'| <= s * (0.5 + 2e-4)`` per block, ``s * (1 + 2e-4)``
stochastic; the slack covers float32 rounding in ``x * (1/s)``. Over the whole tensor this is
``max(absmax / Q, 2**-126) * (0.5 or 1 + 2e-4)``.

Speed: encode and decode walk the tensor in chunks of whole blocks (``CHUNK`` values), so
the scaled copy is a cache-resident scratch buffer instead of a full-size temporary (whose
page faults would cost more than the arithmetic); every step is one vectorized torch op
(amax, amin, mul, round, cast), and each is a single IEEE-754 operation per element, so
the bytes do not depend on SIMD width or thread count. The chunk is large (1M values)
because each torch op is a parallel region whose threads must all be scheduled to finish:
on an oversubscribed CPU, many small regions stall (measured: 256K-value chunks were 10x
slower than 1M ones with 2 threads on a machine loaded 5x over its cores).
The decoder accepts the codes the encoder never writes (int8 -128, int4 nibble 0 = -8):
they decode to a finite ``-128 * s`` / ``-8 * s``, and refusing them would cost a pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Codec, register, require_finite
from .wire import FLAG_STOCHASTIC, CodecError, CodecId, Header

MIN_SCALE = 2.0**-126  # smallest normal float32: keeps 1/s finite for tiny or all-zero blocks
MAX_SCALE = 3.4028234663852886e38 / 128  # decoder limit: |q * s| stays finite for any int8 q
MAX_BLOCK = 1 << 20
CHUNK = 1 << 20  # values per pass: a 4 MiB float32 scratch, cache-resident (L3)
_SLACK = 2e-4


@dataclass(frozen=True)
class _Blockwise(Codec):
    block: int = 256
    stochastic_rounding: bool = False

    codec_id: ClassVar[CodecId]
    qmax: ClassVar[int]
    kind: ClassVar[str]

    def __post_init__(self) -> None:
        if not isinstance(self.block, int) or not 1 <= self.block <= MAX_BLOCK:
            raise ValueError(f"{self.kind}: block must be an integer in [1, {MAX_BLOCK}], got {self.block!r}")

    @property
    def stochastic(self) -> bool:
        return self.stochastic_rounding

    @property
    def name(self) -> str:
        return f"{self.kind}:block={self.block}" + (":stochastic" if self.stochastic_rounding else "")

    @classmethod
    def _codes_nbytes(cls, numel: int) -> int:
        raise NotImplementedError

    def _layout(self, numel: int) -> tuple[int, int, int]:
        nblocks = -(-numel // self.block)
        return self.block, nblocks, 4 * nblocks + self._codes_nbytes(numel)

    def _quantize(
        self,
        x: torch.Tensor,
        nblocks: int,
        scales: torch.Tensor,
        generator: torch.Generator | None,
        emit: Callable[[int, torch.Tensor], None],
    ) -> None:
        """Compute every block's scale into ``scales`` and call ``emit(start, y)`` with the
        rounded integers ``y`` (float32, exact) of each chunk of whole blocks, in order.

        Works chunk by chunk (about ``CHUNK`` values) so the scaled copy stays in cache and
        no full-size temporary is allocated; the chunking depends only on ``block``, so the
        bytes (and the stochastic draws) do not depend on the thread count."""
        n, b = x.numel(), self.block
        full = n // b
        step = max(1, CHUNK // (2 * b)) * 2 * b  # whole blocks, an even number of values
        scratch = torch.empty(min(step, max(n, 1)), dtype=torch.float32)
        mins = torch.empty(step // b, dtype=torch.float32)
        for s in range(0, full * b, step):
            e = min(s + step, full * b)
            nb = (e - s) // b
            xs = x[s:e].view(nb, b)
            sc = scales[s // b : s // b + nb]
            torch.amax(xs, 1, out=sc)  # amax/amin vectorize along rows; aminmax does not
            mn = torch.amin(xs, 1, out=mins[:nb]).neg_()
            torch.maximum(sc, mn, out=sc)
            y = scratch[: e - s]
            self._round_rows(xs, sc, y.view(nb, b), generator)
            emit(s, y)
        if full < nblocks:
            xs = x[full * b :].view(1, n - full * b)
            sc = scales[full:]
            torch.amax(xs, 1, out=sc)
            torch.maximum(sc, torch.amin(xs, 1).neg_(), out=sc)
            y = scratch[: n - full * b]
            self._round_rows(xs, sc, y.view(1, -1), generator)
            emit(full * b, y)
        # amax/amin propagate NaN and inf, so this nblocks-sized check covers the whole input.
        if nblocks and not bool(torch.isfinite(scales).all()):
            require_finite(x)

    def _round_rows(
        self, xs: torch.Tensor, sc: torch.Tensor, y: torch.Tensor, generator: torch.Generator | None
    ) -> None:
        """Turn the absmax ``sc`` of each row into its scale, in place, and write the
        row's integers ``round(x / s)`` (or the stochastic rounding) into ``y``."""
        sc.div_(self.qmax).clamp_(min=MIN_SCALE)
        torch.mul(xs, torch.reciprocal(sc)[:, None], out=y)
        if self.stochastic_rounding:
            y.add_(_uniform16(y.numel(), generator).view_as(y))
            # |x / s| may exceed qmax by an ulp, and floor(qmax + u) would then be qmax + 1.
            y.floor_().clamp_(-self.qmax, self.qmax)
        else:
            y.round_()  # half to even, like every IEEE conversion; |y| <= qmax

    def error_bound(self, t: torch.Tensor) -> float:
        if t.numel() == 0:
            return 0.0
        s = max(float(t.detach().abs().max()) / self.qmax, MIN_SCALE)
        return s * ((1.0 if self.stochastic_rounding else 0.5) + _SLACK)

    def nominal_rel_error(self) -> float:
        # Gaussian data, block of B values: s = E[absmax]/Q with E[absmax] ~ sqrt(2 ln B)
        # (extreme-value approximation, sigma = 1). Nearest rounding leaves uniform error of
        # rms s/sqrt(12); stochastic rounding of a uniform fractional part has rms s/sqrt(6).
        absmax = math.sqrt(2.0 * math.log(max(self.block, 2)))
        return absmax / self.qmax / math.sqrt(6.0 if self.stochastic_rounding else 12.0)

    @classmethod
    def check_header(cls, h: Header) -> None:
        if not 1 <= h.block <= MAX_BLOCK:
            raise CodecError(f"{cls.kind}: block {h.block} outside [1, {MAX_BLOCK}]")
        nblocks = -(-h.numel // h.block)
        if h.count != nblocks:
            raise CodecError(f"{cls.kind}: {h.count} blocks declared, {nblocks} expected for {h.numel} values")
        expected = 4 * nblocks + cls._codes_nbytes(h.numel)
        if h.body_nbytes != expected:
            raise CodecError(f"{cls.kind}: body of {h.body_nbytes} bytes, expected {expected}")

    @classmethod
    def _scales(cls, h: Header, body: torch.Tensor) -> torch.Tensor:
        scales = body[: 4 * h.count].view(torch.float32)
        # NaN fails both comparisons; the upper limit keeps every q * s finite.
        if h.count and not bool(((scales >= 0) & (scales <= MAX_SCALE)).all()):
            raise CodecError(f"{cls.kind}: scale outside [0, {MAX_SCALE:.3g}] or NaN")
        return scales


@dataclass(frozen=True)
class Int8Codec(_Blockwise):
    block: int = 256
    codec_id: ClassVar[CodecId] = CodecId.INT8
    qmax: ClassVar[int] = 127
    kind: ClassVar[str] = "int8"

    @classmethod
    def _codes_nbytes(cls, numel: int) -> int:
        return numel

    def _encode_body(self, x: torch.Tensor, count: int, body: torch.Tensor, generator: torch.Generator | None) -> int:
        codes = body[4 * count :].view(torch.int8)

        def emit(start: int, y: torch.Tensor) -> None:
            codes[start : start + y.numel()].copy_(y)  # exact: y holds integers in [-127, 127]

        self._quantize(x, count, body[: 4 * count].view(torch.float32), generator, emit)
        return FLAG_STOCHASTIC if self.stochastic_rounding else 0

    @classmethod
    def decode_body(cls, h: Header, body: torch.Tensor, out: torch.Tensor) -> None:
        scales = cls._scales(h, body)
        codes = body[4 * h.count :].view(torch.int8)
        for s, e, rows in _chunks(h.numel, h.block):
            chunk = out[s:e]
            chunk.copy_(codes[s:e])
            chunk.view(rows, -1).mul_(scales[s // h.block : s // h.block + rows, None])


@dataclass(frozen=True)
class Int4Codec(_Blockwise):
    """Two codes per byte; ``block`` must be even so that no byte straddles two blocks."""

    block: int = 128
    codec_id: ClassVar[CodecId] = CodecId.INT4
    qmax: ClassVar[int] = 7
    kind: ClassVar[str] = "int4"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block % 2:
            raise ValueError(f"int4: block must be even (two codes per byte), got {self.block}")

    @classmethod
    def _codes_nbytes(cls, numel: int) -> int:
        return (numel + 1) // 2

    def _encode_body(self, x: torch.Tensor, count: int, body: torch.Tensor, generator: torch.Generator | None) -> int:
        n = x.numel()
        packed = body[4 * count :]
        pair = torch.empty(min(CHUNK, n + 1) // 2 + 1, dtype=torch.float32)

        def emit(start: int, y: torch.Tensor) -> None:
            m = y.numel()
            if m % 2:  # only the very last chunk of an odd-length tensor: pad with a zero code
                y = torch.cat([y, y.new_zeros(1)])
            p = pair[: (m + 1) // 2]
            # low nibble q0 + 8, high nibble q1 + 8: (q0 + 8) + 16 * (q1 + 8), exact in float32.
            torch.add(y[0::2], y[1::2], alpha=16, out=p).add_(136.0)
            packed[start // 2 : start // 2 + p.numel()].copy_(p)

        self._quantize(x, count, body[: 4 * count].view(torch.float32), generator, emit)
        return FLAG_STOCHASTIC if self.stochastic_rounding else 0

    @classmethod
    def check_header(cls, h: Header) -> None:
        super().check_header(h)
        if h.block % 2:
            raise CodecError(f"int4: block {h.block} is odd")

    @classmethod
    def decode_body(cls, h: Header, body: torch.Tensor, out: torch.Tensor) -> None:
        scales = cls._scales(h, body)
        n = h.numel
        packed = body[4 * h.count :]
        if n % 2 and int(packed[-1]) >> 4 != 8:
            raise CodecError("int4: the padding nibble of an odd-length tensor is not zero (8)")
        pairs = torch.empty(min(CHUNK, n + 1) // 2 + 1, 2, dtype=torch.uint8)
        for s, e, rows in _chunks(n, h.block):
            p = packed[s // 2 : (e + 1) // 2]
            pr = pairs[: p.numel()]
            torch.bitwise_and(p, 15, out=pr[:, 0])
            torch.bitwise_right_shift(p, 4, out=pr[:, 1])
            pr.sub_(8)  # uint8 arithmetic wraps, so viewed as int8 this is nibble - 8
            chunk = out[s:e]
            chunk.copy_(pr.view(-1)[: e - s].view(torch.int8))
            chunk.view(rows, -1).mul_(scales[s // h.block : s // h.block + rows, None])


def _uniform16(m: int, generator: torch.Generator | None) -> torch.Tensor:
    """``m`` draws of ``u = (k + 0.5) / 2**16``, k uniform in 0..65535, from ``generator``.

    Sixteen bits per draw, four draws per 64-bit word: three times faster than
    ``uniform_`` (one Mersenne-Twister call per float). Rounding ``floor(y + u)`` with this
    grid is unbiased to within 2**-17 of a quantization step."""
    words = torch.empty((m + 3) // 4, dtype=torch.int64)
    words.random_(-(2**63), 2**63 - 1, generator=generator)
    u = torch.empty(m, dtype=torch.float32)
    u.copy_(words.view(torch.int16)[:m])  # k - 32768, exact
    return u.mul_(2.0**-16).add_(0.5 + 2.0**-17)


def _chunks(n: int, block: int) -> list[tuple[int, int, int]]:
    """(start, end, rows) of the chunks of whole blocks that encode used, then the tail block."""
    full = n // block
    step = max(1, CHUNK // (2 * block)) * 2 * block
    out = [
        (s, min(s + step, full * block), (min(s + step, full * block) - s) // block)
        for s in range(0, full * block, step)
    ]
    if full * block < n:
        out.append((full * block, n, 1))
    return out


def _parse(cls: type[_Blockwise]) -> Callable[[list[str]], Codec]:
    def parse(opts: list[str]) -> Codec:
        block, stochastic = cls.block, False
        for opt in opts:
            key, _, value = opt.partition("=")
            if key == "stochastic" and not value:
                stochastic = True
            elif key == "block" and value:
                try:
                    block = int(value)
                except ValueError:
                    raise ValueError(f"{cls.kind}: block must be an integer, got {value!r}") from None
            else:
                raise ValueError(f"{cls.kind}: unknown option {opt!r} (known: block=N, stochastic)")
        return cls(block=block, stochastic_rounding=stochastic)

    return parse


register("int8", Int8Codec, _parse(Int8Codec))
register("int4", Int4Codec, _parse(Int4Codec))

__all__ = ["MAX_SCALE", "MIN_SCALE", "Int4Codec", "Int8Codec"]
