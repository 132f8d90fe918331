"""Blockwise absmax quantization: ``int8`` (levels -127..127) and ``int4`` (-7..7, two per byte).

The flat tensor is cut into blocks of ``block`` values (the last one may be shorter). Each
block stores one float32 scale ``s = max(absmax / Q, 2**-126)`` and its values as integers
``q = round(x / s)`` with ``|q| <= Q`` (Q = 127 or 7). This is the absmax scheme of
Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (ICLR 2022), without the
dynamic (non-linear) code book: a linear code keeps decode a single multiply, which is
exact in IEEE arithmetic and therefore bit-identical on every machine.

Stochastic mode (``:stochastic``) rounds ``q = floor(x / s + u)`` with ``u ~ U[0, 1)`` drawn
from the caller's generator, so ``E[q * s] = x`` (unbiased; e.g. QSGD, Alistarh et al. 2017).

Body layout: ``count`` float32 scales, then the codes: ``numel`` int8 bytes (int8), or
``ceil(numel / 2)`` bytes for int4 with element ``2i`` in the low nibble and ``2i+1`` in the
high nibble, each nibble holding ``q + 8`` (1..15; 8 is zero, and 0 never occurs).

Error bound (declared, tested): ``|x - x'| <= s * (0.5 + 2e-4)`` per block, ``s * (1 + 2e-4)``
stochastic; the slack covers float32 rounding in ``x * (1/s)``. Over the whole tensor this is
``max(absmax / Q, 2**-126) * (0.5 or 1 + 2e-4)``.

Fast path: rounding to nearest even is done by adding ``1.5 * 2**23`` in float32; the low
byte of the sum's bit pattern is then the two's-complement integer (the classic
"magic number" float-to-int trick), which saves a pass over the data compared with
``round`` followed by a cast. Every step is a single IEEE operation, so the bytes do not
depend on SIMD width or thread count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Codec, NonFiniteError, register, require_finite
from .wire import FLAG_STOCHASTIC, CodecError, CodecId, Header, align4

MIN_SCALE = 2.0**-126  # smallest normal float32: keeps 1/s finite for tiny or all-zero blocks
MAX_SCALE = 3.4028234663852886e38 / 128  # decoder limit: |q * s| stays finite for any int8 q
MAX_BLOCK = 1 << 20
_MAGIC = 12582912.0  # 1.5 * 2**23: x + MAGIC rounds x to an integer held in the low mantissa bits
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

    def _scaled(self, x: torch.Tensor, nblocks: int, scales: torch.Tensor, generator: torch.Generator | None, pad: int) -> torch.Tensor:
        """Compute the scales (written into ``scales``) and return ``y = round(x / s) + MAGIC``
        as float32 of ``numel + pad`` elements (padding elements encode zero)."""
        n, b = x.numel(), self.block
        full = n // b
        y = torch.empty(n + pad, dtype=torch.float32)
        if pad:
            y[n:] = 0.0
        if full:
            lo, hi = torch.aminmax(x[: full * b].view(full, b), dim=1)
            torch.maximum(hi, lo.neg_(), out=scales[:full])
        if full < nblocks:
            lo, hi = torch.aminmax(x[full * b :])
            scales[full] = torch.maximum(hi, -lo)
        # aminmax propagates NaN and inf, so this one nblocks-sized check covers the input.
        if not bool(torch.isfinite(scales).all()):
            require_finite(x)
            raise NonFiniteError("non-finite input")  # unreachable: require_finite raised
        scales.div_(self.qmax).clamp_(min=MIN_SCALE)
        inv = torch.reciprocal(scales)
        if full:
            torch.mul(x[: full * b].view(full, b), inv[:full, None], out=y[: full * b].view(full, b))
        if full < nblocks:
            torch.mul(x[full * b :], inv[full], out=y[full * b : n])
        if self.stochastic_rounding:
            u = torch.rand(n, generator=generator, dtype=torch.float32)
            yv = y[:n]
            yv.add_(u).floor_().clamp_(-self.qmax, self.qmax)
        y.add_(_MAGIC)
        return y

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

    @classmethod
    def _apply_scales(cls, out: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
        n = out.numel()
        full = n // block
        if full:
            out[: full * block].view(full, block).mul_(scales[:full, None])
        if full * block < n:
            out[full * block :].mul_(scales[full])
        return out


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
        n = x.numel()
        scales = body[: 4 * count].view(torch.float32)
        if n:
            y = self._scaled(x, count, scales, generator, pad=0)
            # Low byte of each float32's bit pattern (little-endian) = the integer mod 256.
            body[4 * count :].copy_(y.view(torch.uint8).view(n, 4)[:, 0])
        return FLAG_STOCHASTIC if self.stochastic_rounding else 0

    @classmethod
    def decode_body(cls, h: Header, body: torch.Tensor) -> torch.Tensor:
        scales = cls._scales(h, body)
        out = torch.empty(h.numel, dtype=torch.float32)
        out.copy_(body[4 * h.count :].view(torch.int8))
        return cls._apply_scales(out, scales, h.block)


@dataclass(frozen=True)
class Int4Codec(_Blockwise):
    block: int = 128
    codec_id: ClassVar[CodecId] = CodecId.INT4
    qmax: ClassVar[int] = 7
    kind: ClassVar[str] = "int4"

    @classmethod
    def _codes_nbytes(cls, numel: int) -> int:
        return (numel + 1) // 2

    def _encode_body(self, x: torch.Tensor, count: int, body: torch.Tensor, generator: torch.Generator | None) -> int:
        n = x.numel()
        scales = body[: 4 * count].view(torch.float32)
        if n:
            y = self._scaled(x, count, scales, generator, pad=n % 2)
            y.add_(8.0)  # nibble = q + 8 in 1..15, still an exact integer in the low bits
            w = y.view(torch.int32).view(-1, 2)
            # low nibble | high nibble << 4; the garbage above bit 7 is dropped by the uint8 cast.
            packed = torch.bitwise_left_shift(w[:, 1], 4).add_(w[:, 0])
            body[4 * count :].copy_(packed)
        return FLAG_STOCHASTIC if self.stochastic_rounding else 0

    @classmethod
    def decode_body(cls, h: Header, body: torch.Tensor) -> torch.Tensor:
        scales = cls._scales(h, body)
        n = h.numel
        packed = body[4 * h.count :]
        pairs = torch.empty(packed.numel(), 2, dtype=torch.uint8)
        torch.bitwise_and(packed, 15, out=pairs[:, 0])
        torch.bitwise_right_shift(packed, 4, out=pairs[:, 1])
        out = torch.empty(n, dtype=torch.float32)
        out.copy_(pairs.view(-1)[:n])
        out.sub_(8.0)
        return cls._apply_scales(out, scales, h.block)


def _parse(cls: type[_Blockwise]):
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

__all__ = ["Int8Codec", "Int4Codec", "MIN_SCALE", "MAX_SCALE", "align4"]
