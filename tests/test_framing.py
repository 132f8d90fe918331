"""Frames on an in-memory stream: limits before bodies, and dropping an unread frame."""

from __future__ import annotations

import asyncio
import struct

import pytest

from bagel.worker.framing import FrameError, discard_frame, read_frame


def reader_with(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    r = asyncio.StreamReader()
    r.feed_data(data)
    if eof:
        r.feed_eof()
    return r


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


async def test_read_frame_checks_the_limit_before_the_body() -> None:
    assert await read_frame(reader_with(frame(b"abc")), 3) == b"abc"
    with pytest.raises(FrameError, match="over the 2-byte limit"):
        await read_frame(reader_with(frame(b"abc")), 2)
    with pytest.raises(FrameError, match="after 1 of 3"):
        await read_frame(reader_with(frame(b"abc")[:-2]), 3)


async def test_discard_frame_reads_exactly_one_frame() -> None:
    r = reader_with(frame(b"x" * 300_000) + frame(b"next"))
    assert await discard_frame(r, 1 << 20, timeout_s=5)
    assert await read_frame(r, 10) == b"next"  # nothing past the dropped frame was taken


async def test_discard_frame_gives_up_on_oversize_short_streams_and_silence() -> None:
    assert not await discard_frame(reader_with(frame(b"x" * 100)), 99, timeout_s=5)
    assert not await discard_frame(reader_with(frame(b"x" * 100)[:50]), 100, timeout_s=5)
    assert not await discard_frame(reader_with(b"", eof=True), 100, timeout_s=5)
    assert not await discard_frame(reader_with(frame(b"x" * 100)[:50], eof=False), 100, timeout_s=0.05)
