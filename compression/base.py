"""Codec interface, registry, name parsing and the one module-level ``decode``.

A codec turns a float tensor into self-describing bytes (``wire.py``) and back. The design
follows hivemind's ``compression/base.py`` (a small ABC, one object per strategy) with two
differences that the data plane needs: the bytes carry their own header, so ``decode`` needs
no out-of-band description, and the decoder is written for hostile input (every count is
checked before any allocation; see ``wire.parse_header`` and each codec's ``check_header``).

Codecs are pure: no I/O, no clock, no global RNG. Stochastic rounding takes an explicit
``torch.Generator`` so a caller that seeds it gets the same bytes every time.

Names (``get_codec``): ``fp32``, ``fp16``, ``bf16``, ``int8``, ``int4`` with options
``block=N`` and ``stochastic`` (``int4:block=64:stochastic``), and ``topk:FRACTION``
(``topk:0.01``). ``Codec.name`` is the canonical spelling, and ``get_codec(c.name) == c``.
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import torch

from .wire import (
    DEFAULT_MAX_ELEMENTS,
    DTYPE_CODES,
    MAX_NDIM,
    CodecError,
    CodecId,
    Header,
    check_crc,
    finish,
    header_nbytes,
    pack_header,
    parse_header,
    total_nbytes,
)

# decode() views the body of an immutable ``bytes`` object in place (no copy) and only ever
# reads it. torch warns about non-writable buffers once per process (TORCH_WARN_ONCE), so
# spend that one warning here, silenced, instead of on a caller's first decode.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    torch.frombuffer(b"\0", dtype=torch.uint8)


class NonFiniteError(ValueError):
    """``encode`` was given NaN or +-inf (or a value the target format cannot represent).

    Every codec rejects such input instead of encoding it: a non-finite pseudo-gradient is
    a bug or an attack upstream, and averaging it would poison every peer."""


def flat_fp32(t: torch.Tensor) -> torch.Tensor:
    """The tensor as a contiguous 1-D float32 CPU tensor (no copy when it already is one)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in DTYPE_CODES:
        raise TypeError(f"codecs encode float32/float16/bfloat16/float64 tensors, got {t.dtype}")
    x = t.detach()
    if x.device.type != "cpu":
        x = x.cpu()
    x = x.reshape(-1)
    if x.dtype != torch.float32:
        x = x.to(torch.float32)
    return x.contiguous()


def require_finite(x: torch.Tensor, what: str = "input") -> None:
    """Raise ``NonFiniteError`` unless every element of ``x`` is finite.

    Fast path: a finite float32 sum proves there is no NaN/inf (they propagate through a
    sum); only when the sum is not finite (a NaN, an inf, or a real overflow) do we look
    element by element, to tell the caller exactly what is wrong."""
    if x.numel() == 0:
        return
    if math.isfinite(float(torch.sum(x, dtype=torch.float32))):
        return
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise NonFiniteError(f"{what} has {int(bad.sum())} non-finite values (first at flat index {i}: {float(x[i])})")


class Codec(ABC):
    """One compression strategy. Subclasses are frozen dataclasses (hashable, comparable)."""

    codec_id: ClassVar[CodecId]

    @property
    @abstractmethod
    def name(self) -> str:
        """Canonical name; ``get_codec(self.name) == self``."""

    @abstractmethod
    def _layout(self, numel: int) -> tuple[int, int, int]:
        """(block, count, body_nbytes) for a tensor of ``numel`` elements."""

    @abstractmethod
    def _encode_body(self, x: torch.Tensor, count: int, body: torch.Tensor, generator: torch.Generator | None) -> int:
        """Fill the uint8 tensor ``body`` from the flat float32 ``x``; return header flags.
        Raises ``NonFiniteError`` for non-finite input."""

    @classmethod
    @abstractmethod
    def check_header(cls, h: Header) -> None:
        """Raise ``CodecError`` unless block, count and body size agree with numel exactly."""

    @classmethod
    @abstractmethod
    def decode_body(cls, h: Header, body: torch.Tensor, out: torch.Tensor) -> None:
        """Write the ``h.numel`` values of the (length-checked) uint8 body into the flat
        float32 tensor ``out``. Raises ``CodecError`` for a body whose contents are invalid
        (e.g. a NaN scale)."""

    @abstractmethod
    def error_bound(self, t: torch.Tensor) -> float:
        """Declared bound: ``max |decode(encode(t)) - t.float()| <= error_bound(t)`` for any
        finite ``t`` this codec accepts (and any generator, for stochastic modes)."""

    @abstractmethod
    def nominal_rel_error(self) -> float:
        """Expected relative L2 error ``||x - decode(encode(x))|| / ||x||`` on i.i.d.
        Gaussian data, from a closed-form model (documented per codec, checked in tests).
        Used by ``choose_codec`` to compare codecs without encoding anything."""

    @property
    def stochastic(self) -> bool:
        return False

    def encode(self, t: torch.Tensor, *, generator: torch.Generator | None = None) -> bytes:
        """Encode ``t`` (any shape; float32/16, bfloat16, float64; any device) to bytes."""
        if self.stochastic and generator is None:
            raise ValueError(f"{self.name} rounds stochastically: pass a seeded torch.Generator")
        x = flat_fp32(t)
        shape = tuple(t.shape)
        if len(shape) > MAX_NDIM:
            raise ValueError(f"tensors of at most {MAX_NDIM} dimensions can be encoded, got {len(shape)}")
        n = x.numel()
        block, count, body_nbytes = self._layout(n)
        hdr = header_nbytes(len(shape))
        out = torch.empty(total_nbytes(len(shape), body_nbytes), dtype=torch.uint8)
        flags = self._encode_body(x, count, out[hdr : hdr + body_nbytes], generator)
        header = Header(self.codec_id, flags, t.dtype, shape, block, n, count, body_nbytes)
        return finish(out, pack_header(header))

    def encoded_nbytes(self, numel: int, ndim: int = 1) -> int:
        """Exact length of ``encode(t)`` for a tensor of ``numel`` elements and ``ndim`` dims."""
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        return total_nbytes(ndim, self._layout(numel)[2])

    def bytes_per_value(self, numel: int) -> float:
        return self.encoded_nbytes(numel) / max(numel, 1)

    def __str__(self) -> str:
        return self.name


_DECODERS: dict[CodecId, type[Codec]] = {}
_PARSERS: dict[str, Callable[[list[str]], Codec]] = {}


def register(kind: str, cls: type[Codec], parse: Callable[[list[str]], Codec]) -> None:
    """Register a codec class for decoding (by its id) and a name parser (by ``kind``)."""
    if cls.codec_id in _DECODERS and _DECODERS[cls.codec_id] is not cls:
        raise RuntimeError(f"codec id {cls.codec_id!r} registered twice")
    _DECODERS[cls.codec_id] = cls
    _PARSERS[kind] = parse


def get_codec(name: str) -> Codec:
    """Build a codec from its name, e.g. ``"int8"``, ``"int4:block=64:stochastic"``, ``"topk:0.01"``.

    Raises ``ValueError`` naming the unknown kind or option."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"codec name must be a non-empty string, got {name!r}")
    kind, *opts = name.strip().split(":")
    parse = _PARSERS.get(kind.lower())
    if parse is None:
        raise ValueError(f"unknown codec {kind!r} in {name!r}; known: {sorted(_PARSERS)}")
    return parse(opts)


def registered_kinds() -> list[str]:
    return sorted(_PARSERS)


def peek_header(buf: bytes | bytearray | memoryview, *, max_elements: int = DEFAULT_MAX_ELEMENTS) -> Header:
    """Checked header of an encoded buffer (no checksum or body validation)."""
    mv = _as_bytes_view(buf)
    h = parse_header(mv, max_elements)
    _DECODERS[h.codec].check_header(h)
    return h


def decode(
    buf: bytes | bytearray | memoryview,
    *,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode any codec's bytes to a float32 tensor of the encoded shape.

    Order of checks: header fields and exact lengths (``wire.parse_header``), the codec's
    own counts (``check_header``), the CRC32, then the body's contents. Nothing sized by
    the buffer's claims is allocated before the lengths are proven consistent with the
    actual buffer and with ``max_elements``, which therefore bounds the output (a sparse
    top-k buffer is small but may legitimately declare up to ``max_elements`` values).
    Any malformed buffer raises ``CodecError``.

    ``out``: an optional contiguous float32 CPU tensor with the encoded number of elements,
    written in place and returned reshaped; reusing one saves allocating (and page-faulting)
    a fresh output per call. If decoding fails, its contents are unspecified."""
    mv = _as_bytes_view(buf)
    h = parse_header(mv, max_elements)
    cls = _DECODERS[h.codec]
    cls.check_header(h)
    check_crc(mv)
    if out is None:
        flat = torch.empty(h.numel, dtype=torch.float32)
    else:
        if out.dtype != torch.float32 or out.device.type != "cpu" or not out.is_contiguous() or out.numel() != h.numel:
            raise ValueError(
                f"out must be a contiguous float32 CPU tensor of {h.numel} elements,"
                f" got {out.dtype} {tuple(out.shape)} on {out.device}"
            )
        flat = out.view(-1)
    if h.body_nbytes:
        body = torch.frombuffer(mv, dtype=torch.uint8, count=h.body_nbytes, offset=h.nbytes)
    else:
        body = torch.empty(0, dtype=torch.uint8)
    cls.decode_body(h, body, flat)
    return flat.view(h.shape)


def _as_bytes_view(buf: bytes | bytearray | memoryview) -> memoryview:
    if not isinstance(buf, (bytes, bytearray, memoryview)):
        raise TypeError(f"decode expects bytes-like input, got {type(buf).__name__}")
    mv = memoryview(buf)
    if mv.ndim != 1 or mv.itemsize != 1 or mv.format not in ("B", "b", "c"):
        if not mv.c_contiguous:
            raise CodecError("buffer is not contiguous")
        mv = mv.cast("B")
    return mv
