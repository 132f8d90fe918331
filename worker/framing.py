"""Length-prefixed frames over a libp2p stream, with a limit checked before any byte is read.

The data plane (`averaging.py`, `statesync.py`) talks over hivemind's raw binary streams
(`P2P.add_binary_stream_handler` / `call_binary_stream_handler`) instead of its protobuf
stream helpers, because those read a peer-declared 8-byte length with no cap. Here every
frame is a 4-byte big-endian length and that many bytes, and the reader refuses a length
above the caller's limit before it reads the body: a hostile peer cannot make us buffer
more than we agreed to take.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from bagel.worker import pacing

_LEN = struct.Struct(">I")
LEN_NBYTES = _LEN.size
MAX_FRAME_NBYTES = (1 << 32) - 1
# protobuf headers are small; a larger one is an attack or a bug.
MAX_HEADER_NBYTES = 64 * 1024
_WRITE_CHUNK = 1 << 20
_SMALL_FRAME = 64 << 10

M = TypeVar("M", bound=Message)


class FrameError(ValueError):
    """The peer sent a malformed or oversized frame, or closed the stream mid-frame."""


def _shrink_buffers(writer: asyncio.StreamWriter) -> None:
    """Under an upload cap, keep what waits below us small: bytes the pacer let go while
    the peer was not reading pile up in the asyncio transport and the socket to the libp2p
    daemon, and would leave as one burst at link speed once it reads again."""
    try:
        writer.transport.set_write_buffer_limits(high=0)  # drain() waits until it is empty
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, pacing.PACED_SOCKET_BUFFER)
    except (AttributeError, OSError, ValueError):  # not a socket transport (tests); the cap still holds on average
        pass


async def write_frame(writer: asyncio.StreamWriter, data: bytes | memoryview) -> int:
    """Write one frame; return the bytes put on the stream (length prefix included).

    Under an upload cap (`pacing.install`) the frame goes out in `pacing.PIECE_BYTES`
    pieces, each after the pacer allowed it."""
    n = len(data)
    if n > MAX_FRAME_NBYTES:
        raise FrameError(f"frame of {n} bytes is over the {MAX_FRAME_NBYTES}-byte limit")
    pacer = pacing.current()
    if pacer is not None:
        _shrink_buffers(writer)
        await pacer.take(LEN_NBYTES + min(n, pacing.PIECE_BYTES))
        writer.write(_LEN.pack(n) + bytes(memoryview(data)[: pacing.PIECE_BYTES]))
        await writer.drain()
        view = memoryview(data)
        for start in range(pacing.PIECE_BYTES, n, pacing.PIECE_BYTES):
            piece = view[start : start + pacing.PIECE_BYTES]
            await pacer.take(len(piece))
            writer.write(piece)
            await writer.drain()
        return LEN_NBYTES + n
    if n <= _SMALL_FRAME:  # one write: the length and a small body never travel apart
        writer.write(_LEN.pack(n) + bytes(data))
        await writer.drain()
        return LEN_NBYTES + n
    writer.write(_LEN.pack(n))
    view = memoryview(data)
    for start in range(0, n, _WRITE_CHUNK):
        writer.write(view[start : start + _WRITE_CHUNK])
        await writer.drain()
    await writer.drain()
    return LEN_NBYTES + n


async def read_frame(reader: asyncio.StreamReader, max_nbytes: int) -> bytes:
    """Read one frame of at most max_nbytes; the length is checked before the body is read."""
    try:
        (n,) = _LEN.unpack(await reader.readexactly(LEN_NBYTES))
    except asyncio.IncompleteReadError as e:
        raise FrameError("stream closed before a frame") from e
    if n > max_nbytes:
        raise FrameError(f"peer declared a {n}-byte frame, over the {max_nbytes}-byte limit")
    try:
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError as e:
        raise FrameError(f"stream closed after {len(e.partial)} of {n} frame bytes") from e


async def discard_frame(reader: asyncio.StreamReader, max_nbytes: int, timeout_s: float) -> bool:
    """Read and drop one frame of at most max_nbytes, within timeout_s; True if all of it came.

    A peer that answers before reading what the other side is still sending must read it
    anyway before closing: closing a libp2p stream with unread bytes can reset it, and the
    reset can cut the answer short on the other side (as TCP answers such a close with RST).
    """

    async def read() -> bool:
        try:
            (n,) = _LEN.unpack(await reader.readexactly(LEN_NBYTES))
        except asyncio.IncompleteReadError:
            return False
        if n > max_nbytes:
            return False
        while n > 0:
            chunk = await reader.read(min(n, _WRITE_CHUNK))
            if not chunk:
                return False
            n -= len(chunk)
        return True

    try:
        return await asyncio.wait_for(read(), timeout_s)
    except (TimeoutError, ConnectionError, OSError):
        return False


async def write_message(writer: asyncio.StreamWriter, msg: Message) -> int:
    return await write_frame(writer, msg.SerializeToString())


async def read_message(
    reader: asyncio.StreamReader, cls: type[M], max_nbytes: int = MAX_HEADER_NBYTES
) -> tuple[M, int]:
    """Read one protobuf frame of type cls; return it and the bytes it took on the stream."""
    raw = await read_frame(reader, max_nbytes)
    msg = cls()
    try:
        msg.ParseFromString(raw)
    except DecodeError as e:
        raise FrameError(f"malformed {cls.__name__}: {e}") from e
    return msg, LEN_NBYTES + len(raw)
