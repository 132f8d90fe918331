"""Plug our codecs into hivemind's averager: a ``CompressionBase`` that carries our bytes.

hivemind decodes a received ``runtime_pb2.Tensor`` by its ``compression`` field, a fixed
six-value enum, through the module-level dict ``_BASE_COMPRESSION_TYPES`` in
``hivemind/compression/serialization.py``; there is no registry for new codecs. Because our
buffers describe themselves (``wire.py``), one enum slot is enough for all of them:
``install()`` puts a ``BagelCompression`` into that slot, and whatever codec a peer used, the
receiver's ``extract`` reads the header and decodes it.

Which slot: ``BLOCKWISE_8BIT`` by default. hivemind's own codec there needs bitsandbytes,
which Bagel does not install, so nothing usable is displaced. ``UNIFORM_8BIT`` is the other
sensible choice (its extract fails under numpy >= 2.4 anyway). Every peer of a group must
install the same slot.

What the slot is also used for: a reducer compresses the averaged delta it sends back with
``serialize_torch_tensor(delta, <the sender's enum>)``, i.e. with the *installed* object's
codec, not the sender's. So install the codec the group uses (``install(adapter)`` with the
same adapter you pass to the averager). One codec per slot per process.

Processes: ``DecentralizedAverager`` is a ``multiprocessing.Process``. Under the ``fork``
start method (Linux default up to Python 3.13) the child inherits the installed slot, so
call ``install`` before ``averager.start()`` (or before constructing it with
``start=True``). Under ``spawn``/``forkserver`` the averager is pickled into the child;
unpickling a ``BagelCompression`` installs it there too (``__setstate__``).

Bit-identity: hivemind's reducer keeps its own part unencoded while the others receive it
encoded, so peers do not end bit-identical with a lossy codec; the
tests measure the spread. Bagel's own data plane applies identical decoded bytes instead.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from hivemind.compression import serialization as _serialization
from hivemind.compression.base import CompressionBase, CompressionInfo
from hivemind.proto import runtime_pb2

from .base import Codec, decode, get_codec, peek_header
from .wire import DEFAULT_MAX_ELEMENTS, CodecError

DEFAULT_SLOT = "BLOCKWISE_8BIT"

_ORIGINALS: dict[str, CompressionBase] = {}
_LOCK = threading.Lock()


class BagelCompression(CompressionBase):
    """A hivemind compression strategy that encodes with one of our codecs.

    :param codec: a ``Codec`` or a codec name (``"int8"``, ``"int4:stochastic"``, ...)
    :param slot: the hivemind ``CompressionType`` name this adapter occupies (see ``install``)
    :param seed: seed of the generator used by stochastic codecs. hivemind compresses parts
        in a thread pool, so the order of draws (and thus the bytes) is not reproducible
        across runs even with a fixed seed; it only makes the draws independent of torch's
        global RNG.
    :param max_elements: the decoder's element limit for received buffers
    """

    def __init__(
        self,
        codec: Codec | str,
        *,
        slot: str = DEFAULT_SLOT,
        seed: int = 0,
        max_elements: int = DEFAULT_MAX_ELEMENTS,
    ) -> None:
        slots = runtime_pb2.CompressionType.keys()  # an EnumTypeWrapper: no `in` of its own
        if slot not in slots or slot == "NONE":
            raise ValueError(f"slot must be one of {slots[1:]}, got {slot!r}")
        self.codec = get_codec(codec) if isinstance(codec, str) else codec
        self.slot = slot
        self.compression_type = runtime_pb2.CompressionType.Value(slot)
        self.seed = seed
        self.max_elements = max_elements
        self._generator = torch.Generator().manual_seed(seed)
        self._gen_lock = threading.Lock()

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        if self.codec.stochastic:
            with self._gen_lock:  # hivemind calls compress from several executor threads
                buf = self.codec.encode(tensor, generator=self._generator)
        else:
            buf = self.codec.encode(tensor)
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=buf,
            size=tensor.shape,
            dtype=str(tensor.dtype).replace("torch.", ""),
            requires_grad=tensor.requires_grad,
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        """Decode any of our codecs' buffers; ``CodecError`` if it is malformed or its shape
        disagrees with the message's ``size`` field. Returns the sender's dtype."""
        buf = serialized_tensor.buffer
        header = peek_header(buf, max_elements=self.max_elements)
        if tuple(serialized_tensor.size) != header.shape:
            raise CodecError(f"message size {tuple(serialized_tensor.size)} != encoded shape {header.shape}")
        out = decode(buf, max_elements=self.max_elements)
        return out if header.dtype == torch.float32 else out.to(header.dtype)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        numel = info.part_size or info.descriptor.numel()
        itemsize = torch.tensor([], dtype=info.descriptor.dtype).element_size()
        return self.codec.encoded_nbytes(max(numel, 1)) / (max(numel, 1) * itemsize)

    def __getstate__(self) -> dict[str, Any]:
        return {"codec": self.codec.name, "slot": self.slot, "seed": self.seed, "max_elements": self.max_elements}

    def __setstate__(self, state: dict[str, Any]) -> None:
        type(self).__init__(
            self, state["codec"], slot=state["slot"], seed=state["seed"], max_elements=state["max_elements"]
        )
        install(self)  # a spawned averager process re-imports hivemind with the original table

    def __repr__(self) -> str:
        return f"BagelCompression({self.codec.name!r}, slot={self.slot!r})"


def install(adapter: BagelCompression | Codec | str = "int8", *, slot: str = DEFAULT_SLOT) -> BagelCompression:
    """Register ``adapter`` in hivemind's deserializer table under its slot, replacing the
    codec hivemind had there (kept for ``uninstall``); returns the installed adapter.

    Idempotent; installing another adapter in the same slot replaces the previous one.
    Affects this process and averager processes forked after the call."""
    if not isinstance(adapter, BagelCompression):
        adapter = BagelCompression(adapter, slot=slot)
    table = _serialization._BASE_COMPRESSION_TYPES
    with _LOCK:
        current = table[adapter.slot]
        if not isinstance(current, BagelCompression):
            _ORIGINALS[adapter.slot] = current
        table[adapter.slot] = adapter
    return adapter


def uninstall(slot: str = DEFAULT_SLOT) -> None:
    """Put hivemind's own codec back into ``slot`` (no-op if ours is not installed there)."""
    table = _serialization._BASE_COMPRESSION_TYPES
    with _LOCK:
        original = _ORIGINALS.pop(slot, None)
        if original is not None:
            table[slot] = original


def installed(slot: str = DEFAULT_SLOT) -> BagelCompression | None:
    """The adapter currently in ``slot``, if it is ours."""
    current = _serialization._BASE_COMPRESSION_TYPES.get(slot)
    return current if isinstance(current, BagelCompression) else None
