"""`UploadPacer`: the volunteer's upload cap (`bagel-worker join --max-upload-mbps X`).

A token bucket over the bytes this process sends on its data plane: every frame of the
pseudo-gradient exchange, of a reducer's answers and of the state it serves to joiners goes
through `framing.write_frame`, which takes tokens here before each piece it hands to the
libp2p stream; checkpoint uploads to the coordinator take them before each gRPC chunk. The
bucket may go into debt (and counts each byte with `WIRE_OVERHEAD`, what the link carries
for it): a sender takes what it writes and then sleeps the debt away, so
concurrent senders share the rate and the average over any window is at most the rate plus
one burst. Pieces are small (`PIECE_BYTES`), so the burst a link sees is small too.

`UploadPacer.take` reads the monotonic clock through an injectable `clock`, and `debt_s`
is the arithmetic alone (tests drive it with a fake clock). One pacer per process,
installed by the agent (`install`); without one nothing is paced.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable

PIECE_BYTES = 16 << 10  # what write_frame hands the stream between two takes
PACED_SOCKET_BUFFER = 32 << 10  # SO_SNDBUF of a paced stream's socket to the libp2p daemon
# What a byte of ours costs on the link: TCP/IP headers (52 of every ~1500 bytes), libp2p's
# noise tag and yamux frame headers, rounded up. The cap is on the link, so it charges it.
WIRE_OVERHEAD = 1.05
MIN_BURST_S = 0.02  # the bucket holds at least this long a share of the rate


class UploadPacer:
    """A token bucket in bytes; `await take(n)` returns once n bytes may leave."""

    def __init__(
        self, rate_bytes_per_s: float, *, burst_bytes: int | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not rate_bytes_per_s > 0:
            raise ValueError(f"rate must be positive, got {rate_bytes_per_s}")
        self.rate = float(rate_bytes_per_s)
        self.burst = float(burst_bytes if burst_bytes is not None else max(PIECE_BYTES, rate_bytes_per_s * MIN_BURST_S))
        self._clock = clock
        self._tokens = self.burst
        self._at = clock()
        self._lock = threading.Lock()  # takes come from the event loop and from threads
        self.sent = 0  # bytes charged so far (payload x WIRE_OVERHEAD)
        self.waited_s = 0.0  # time senders slept for the cap

    @classmethod
    def from_mbps(cls, mbps: float) -> UploadPacer:
        return cls(mbps * 1e6 / 8)

    def debt_s(self, n: int) -> float:
        """Take n bytes now; the seconds the caller must wait before sending them."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
            self._at = now
            self._tokens -= n
            self.sent += n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
            self.waited_s += wait
            return wait

    async def take(self, n: int) -> None:
        """Wait until n payload bytes (charged with `WIRE_OVERHEAD`) may leave."""
        wait = self.debt_s(math.ceil(n * WIRE_OVERHEAD))
        if wait > 0:
            await asyncio.sleep(wait)


_PACER: UploadPacer | None = None


def install(pacer: UploadPacer | None) -> None:
    """Make `pacer` this process's upload cap (None: no cap)."""
    global _PACER
    _PACER = pacer


def current() -> UploadPacer | None:
    return _PACER


__all__ = ["PIECE_BYTES", "UploadPacer", "current", "install"]
