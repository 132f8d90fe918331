"""Pseudo-gradient compression for Bagel's data plane.

Public API::

    codec = get_codec("int8:block=256")      # fp32 fp16 bf16 int8 int4 [block=N] [stochastic] topk:F
    buf = codec.encode(t, generator=g)      # bytes with a self-describing header + CRC32
    x = decode(buf, max_elements=2**28)     # float32 tensor of the encoded shape; CodecError if bad
    decode(buf, out=reused)                 # same, into a caller's float32 buffer
    codec.encoded_nbytes(numel)             # exact wire size
    codec.error_bound(t)                    # declared max abs round-trip error for this input
    ErrorFeedback().compensate(key, t) / .update(key, compensated, decoded)
    choose_codec(numel, link_bytes_per_s, compute_s)   # bandwidth-aware pick (choice.py)

The hivemind adapter is imported on demand (it imports hivemind):
``from bagel.compression.hivemind_adapter import BagelCompression, install``.

Modules: ``wire`` (header, limits, CRC), ``base`` (ABC, registry, decode), ``floats``,
``blockwise`` (int8/int4), ``topk``, ``feedback``, ``choice`` (bandwidth-aware pick),
``hivemind_adapter`` (plug into hivemind's averager).
"""

from . import blockwise as _blockwise  # noqa: F401  (registers int8/int4)
from . import floats as _floats  # noqa: F401  (registers fp32/fp16/bf16)
from . import topk as _topk  # noqa: F401  (registers topk)
from .base import Codec, NonFiniteError, decode, get_codec, peek_header, registered_kinds
from .blockwise import Int4Codec, Int8Codec
from .choice import CodecChoice, choose_codec
from .feedback import ErrorFeedback
from .floats import Bf16Codec, Fp16Codec, Fp32Codec
from .topk import TopKCodec
from .wire import DEFAULT_MAX_ELEMENTS, CodecError, CodecId, Header

__all__ = [
    "DEFAULT_MAX_ELEMENTS",
    "Bf16Codec",
    "Codec",
    "CodecChoice",
    "CodecError",
    "CodecId",
    "ErrorFeedback",
    "Fp16Codec",
    "Fp32Codec",
    "Header",
    "Int4Codec",
    "Int8Codec",
    "NonFiniteError",
    "TopKCodec",
    "choose_codec",
    "decode",
    "get_codec",
    "peek_header",
    "registered_kinds",
]
