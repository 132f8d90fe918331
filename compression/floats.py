"""Plain floating-point codecs: ``fp32`` (identity), ``fp16`` and ``bf16`` (round to nearest even).

Body: ``numel`` values of the target format, little-endian. ``count`` = ``numel``, ``block`` = 0.

Non-finite input, and values beyond the format's largest finite value (fp16: +-65504;
bf16: +-3.3895e38), raise ``NonFiniteError``. The decoder refuses a body holding NaN/inf with ``CodecError``, so
a decoded tensor is always finite.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Codec, NonFiniteError, flat_fp32, register, require_finite
from .wire import MAX_NDIM, CodecError, CodecId, Header, join, pack_header

_FORMATS: dict[CodecId, tuple[str, torch.dtype, int]] = {
    CodecId.FP32: ("fp32", torch.float32, 4),
    CodecId.FP16: ("fp16", torch.float16, 2),
    CodecId.BF16: ("bf16", torch.bfloat16, 2),
}
# Largest accepted magnitude (the format's largest finite value).
_LIMITS: dict[CodecId, float] = {
    CodecId.FP32: 3.4028234663852886e38,
    CodecId.FP16: 65504.0,
    CodecId.BF16: 3.3895313892515355e38,
}
# (relative half-ulp of normal numbers, absolute half-spacing of subnormals) per format.
_ROUNDING: dict[CodecId, tuple[float, float]] = {
    CodecId.FP32: (0.0, 0.0),
    CodecId.FP16: (2.0**-11, 2.0**-25),
    CodecId.BF16: (2.0**-8, 2.0**-134),
}


class _FloatCodec(Codec):
    codec_id: ClassVar[CodecId]

    @property
    def name(self) -> str:
        return _FORMATS[self.codec_id][0]

    def _layout(self, numel: int) -> tuple[int, int, int]:
        return 0, numel, numel * _FORMATS[self.codec_id][2]

    def _encode_body(self, x: torch.Tensor, count: int, body: torch.Tensor, generator: torch.Generator | None) -> int:
        _, dtype, _ = _FORMATS[self.codec_id]
        lo, hi = _extremes(x)
        limit = _LIMITS[self.codec_id]
        if not (-limit <= lo and hi <= limit):  # false for NaN
            require_finite(x)  # names the NaN/inf if the input has one
            raise NonFiniteError(f"input has values beyond the {self.name} range +-{limit:g} (min {lo}, max {hi})")
        body.view(dtype).copy_(x)  # one pass, round to nearest even
        return 0

    @classmethod
    def check_header(cls, h: Header) -> None:
        width = _FORMATS[cls.codec_id][2]
        if h.block != 0:
            raise CodecError(f"{_FORMATS[cls.codec_id][0]}: block must be 0, got {h.block}")
        if h.count != h.numel:
            raise CodecError(f"{_FORMATS[cls.codec_id][0]}: count {h.count} != numel {h.numel}")
        if h.body_nbytes != h.numel * width:
            raise CodecError(f"{_FORMATS[cls.codec_id][0]}: body of {h.body_nbytes} bytes, expected {h.numel * width}")

    @classmethod
    def decode_body(cls, h: Header, body: torch.Tensor, out: torch.Tensor) -> None:
        _, dtype, _ = _FORMATS[cls.codec_id]
        out.copy_(body.view(dtype))  # a copy even for fp32: the body aliases the caller's buffer
        lo, hi = _extremes(out)
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise CodecError(f"{_FORMATS[cls.codec_id][0]} body holds non-finite values")

    def error_bound(self, t: torch.Tensor) -> float:
        rel, sub = _ROUNDING[self.codec_id]
        if t.numel() == 0:
            return 0.0
        return float(t.detach().abs().max()) * rel + sub

    def nominal_rel_error(self) -> float:
        # Round-to-nearest with relative spacing 2*rel: error uniform in +-rel*|x| over the
        # binade, which gives rms ~ rel * 2/sqrt(12) * ~0.75 (mantissa-weighted); 0.5*rel is a fair
        # closed-form summary checked in tests to within a factor of two.
        return _ROUNDING[self.codec_id][0] * 0.5


def _extremes(v: torch.Tensor) -> tuple[float, float]:
    """(min, max) of a float32 tensor; NaN if it holds one, (0, 0) if empty. amax and amin
    are vectorized one-pass reductions (``aminmax`` and ``isfinite().all()`` are not)."""
    if v.numel() == 0:
        return 0.0, 0.0
    return float(torch.amin(v)), float(torch.amax(v))


@dataclass(frozen=True)
class Fp32Codec(_FloatCodec):
    codec_id: ClassVar[CodecId] = CodecId.FP32

    def encode(self, t: torch.Tensor, *, generator: torch.Generator | None = None) -> bytes:
        """Same bytes as the generic path, but the body is the input's own memory, so the
        output is the only full-size allocation (one copy instead of two)."""
        x = flat_fp32(t)
        shape = tuple(t.shape)
        if len(shape) > MAX_NDIM:
            raise ValueError(f"tensors of at most {MAX_NDIM} dimensions can be encoded, got {len(shape)}")
        require_finite(x)
        n = x.numel()
        header = pack_header(Header(self.codec_id, 0, t.dtype, shape, 0, n, n, 4 * n))
        return join(header, x.numpy().data.cast("B"))  # .data: the memoryview of the array


@dataclass(frozen=True)
class Fp16Codec(_FloatCodec):
    codec_id: ClassVar[CodecId] = CodecId.FP16


@dataclass(frozen=True)
class Bf16Codec(_FloatCodec):
    codec_id: ClassVar[CodecId] = CodecId.BF16


def _no_options(cls: type[_FloatCodec], kind: str) -> Callable[[list[str]], Codec]:
    def parse(opts: list[str]) -> Codec:
        if opts:
            raise ValueError(f"codec {kind!r} takes no options, got {':'.join(opts)!r}")
        return cls()

    return parse


register("fp32", Fp32Codec, _no_options(Fp32Codec, "fp32"))
register("fp16", Fp16Codec, _no_options(Fp16Codec, "fp16"))
register("bf16", Bf16Codec, _no_options(Bf16Codec, "bf16"))
