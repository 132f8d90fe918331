"""A TCP fault proxy: put it between a client and a server, then degrade the link at run time.

`bagel-sim chaos` puts one in front of the coordinator's gRPC port (workers are given the
proxy's address, see `sim/chaos.py`), and switches its faults on a schedule:

- **latency** — every chunk is delivered `latency_s` after it was read, in each direction
  (so +200 ms makes a round trip 400 ms longer). Chunks stay pipelined: latency delays,
  it does not serialise.
- **bandwidth** — at most `bandwidth_bytes_per_s` per direction per connection (each
  connection stands for one worker's link), paced per piece so bursts stay small.
- **reset** — every open connection is aborted with SO_LINGER 0 on both sides, so both
  peers see a TCP RST (or EOF), as when a NAT drops the flow.
- **hang** — forwarding stops (bytes are read until the bounded buffer is full, then the
  sender is back-pressured); nothing is lost, and `resume()` delivers it in order. New
  connections are accepted but not connected upstream until resumed. This is the fault
  that timeouts and leases, not connection errors, must catch.

The faults are plain attributes and methods of `FaultProxy`, so the chaos driver (same
process and event loop) switches them directly. Buffers are bounded (`max_buffer_bytes`
per direction per connection), the proxy binds loopback only, and `close()` closes the
listener and every connection. The same ideas as toxiproxy's latency/bandwidth/
reset_peer/timeout toxics (Shopify/toxiproxy), written here for asyncio.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import struct
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

READ_CHUNK = 16 * 1024
DEFAULT_MAX_BUFFER_BYTES = 1 << 20
PACE_PIECE_S = 0.02  # bandwidth pacing granularity: pieces worth at most this much time


class ProxyError(ValueError):
    """A proxy setting is invalid (the message names it)."""


def _check_loopback(host: str) -> None:
    try:
        ok = ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = host == "localhost"
    if not ok:
        raise ProxyError(f"the fault proxy binds loopback only, not {host!r}")


@dataclass
class ProxyStats:
    connections: int = 0  # accepted so far
    resets: int = 0  # connections aborted by reset()
    bytes_up: int = 0  # client -> target, delivered
    bytes_down: int = 0  # target -> client, delivered


class _Pipe:
    """One direction of one connection: a reader task fills a bounded queue, a writer task
    drains it with the proxy's current latency, bandwidth and hang state."""

    def __init__(self, proxy: FaultProxy, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: bool) -> None:
        self.proxy = proxy
        self.reader = reader
        self.writer = writer
        self.up = up
        self.buffered = 0
        self._space = asyncio.Condition()
        self._queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        self._next_free = 0.0  # bandwidth pacing: when the link is free for the next byte

    async def pump_in(self) -> None:
        try:
            while True:
                data = await self.reader.read(READ_CHUNK)
                if not data:
                    break
                async with self._space:  # bounded buffer: back-pressure the sender
                    n = len(data)

                    def has_room(n: int = n) -> bool:
                        return self.buffered + n <= self.proxy.max_buffer_bytes or self.buffered == 0

                    await self._space.wait_for(has_room)
                    self.buffered += len(data)
                self._queue.put_nowait((time.monotonic(), data))
        finally:
            self._queue.put_nowait(None)

    async def pump_out(self) -> None:
        while True:
            item = await self._queue.get()
            if item is None:
                break
            read_at, data = item
            await self.proxy._flowing.wait()
            delay = read_at + self.proxy.latency_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await self._send(data)
            async with self._space:
                self.buffered -= len(data)
                self._space.notify_all()
        with contextlib.suppress(OSError, RuntimeError):
            if self.writer.can_write_eof():
                self.writer.write_eof()  # half-close: the other direction may still flow

    async def _send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            await self.proxy._flowing.wait()  # a hang stops mid-chunk too
            rate = self.proxy.bandwidth_bytes_per_s
            if rate > 0:
                piece = view[: max(1, int(rate * PACE_PIECE_S))]
                now = time.monotonic()
                start = max(now, self._next_free)
                if start > now:
                    await asyncio.sleep(start - now)
                self._next_free = start + len(piece) / rate
            else:
                piece = view
            self.writer.write(piece)
            await self.writer.drain()
            if self.up:
                self.proxy.stats.bytes_up += len(piece)
            else:
                self.proxy.stats.bytes_down += len(piece)
            view = view[len(piece) :]


class _Conn:
    def __init__(self, client_w: asyncio.StreamWriter) -> None:
        self.client_w = client_w
        self.target_w: asyncio.StreamWriter | None = None
        self.pipes: list[_Pipe] = []
        self.task: asyncio.Task[None] | None = None

    def writers(self) -> list[asyncio.StreamWriter]:
        return [w for w in (self.client_w, self.target_w) if w is not None]

    def abort(self) -> None:
        """RST both sides: SO_LINGER {on, 0} then close without flushing."""
        for w in self.writers():
            sock = w.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            w.transport.abort()


class FaultProxy:
    """asyncio TCP proxy from `listen_host:listen_port` (loopback) to `target_host:target_port`.

    Start with `await proxy.start()` (then `proxy.port` is bound), stop with
    `await proxy.close()`; or `async with FaultProxy(...) as proxy:`.
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        max_buffer_bytes: int = DEFAULT_MAX_BUFFER_BYTES,
        connect_timeout_s: float = 5.0,
    ) -> None:
        _check_loopback(listen_host)
        if not (0 < target_port < 65536):
            raise ProxyError(f"target_port: {target_port} is not a TCP port")
        if not (0 <= listen_port < 65536):
            raise ProxyError(f"listen_port: {listen_port} is not a TCP port")
        if max_buffer_bytes < READ_CHUNK:
            raise ProxyError(f"max_buffer_bytes: at least {READ_CHUNK}")
        self.target_host = target_host
        self.target_port = target_port
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.max_buffer_bytes = max_buffer_bytes
        self.connect_timeout_s = connect_timeout_s
        self.latency_s = 0.0
        self.bandwidth_bytes_per_s = 0.0  # 0 = unlimited
        self.stats = ProxyStats()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._conns: set[_Conn] = set()
        self.port = 0

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> FaultProxy:
        self._server = await asyncio.start_server(self._handle, self.listen_host, self.listen_port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def address(self) -> str:
        return f"{self.listen_host}:{self.port}"

    async def close(self) -> None:
        """Stop listening and close every connection (idempotent)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        self._flowing.set()
        conns = list(self._conns)
        for c in conns:
            for w in c.writers():
                w.transport.abort()
        # the pumps see the closed transports and end; handlers are only cancelled if they
        # do not (asyncio 3.11's stream callback logs an error for a cancelled handler task)
        tasks = [c.task for c in conns if c.task is not None and not c.task.done()]
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=5.0)
            for t in stuck:
                t.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)

    async def __aenter__(self) -> FaultProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ faults

    def set_latency(self, latency_ms: float) -> None:
        """Added one-way delay in milliseconds, each direction (0 = none)."""
        if latency_ms < 0:
            raise ProxyError("latency_ms: must be >= 0")
        self.latency_s = latency_ms / 1000.0

    def set_bandwidth(self, bytes_per_s: float) -> None:
        """Cap per direction per connection in bytes/s (0 = unlimited)."""
        if bytes_per_s < 0:
            raise ProxyError("bandwidth_bytes_per_s: must be >= 0")
        self.bandwidth_bytes_per_s = float(bytes_per_s)

    def hang(self) -> None:
        """Stop forwarding (connections stay open; bounded buffers back-pressure senders)."""
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    @property
    def hung(self) -> bool:
        return not self._flowing.is_set()

    def reset(self) -> int:
        """Abort every open connection (TCP RST to both peers); returns how many."""
        conns = list(self._conns)
        for c in conns:
            c.abort()
        self.stats.resets += len(conns)
        return len(conns)

    def clear(self) -> None:
        """Remove every fault (latency, bandwidth, hang)."""
        self.latency_s = 0.0
        self.bandwidth_bytes_per_s = 0.0
        self.resume()

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    def buffered_bytes(self) -> int:
        """Bytes read but not yet delivered, over all connections and directions."""
        return sum(p.buffered for c in self._conns for p in c.pipes)

    # ------------------------------------------------------------------ forwarding

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        conn = _Conn(client_w)
        conn.task = asyncio.current_task()
        self._conns.add(conn)
        self.stats.connections += 1
        try:
            await self._flowing.wait()  # a hung proxy accepts but does not connect upstream
            try:
                target_r, target_w = await asyncio.wait_for(
                    asyncio.open_connection(self.target_host, self.target_port), self.connect_timeout_s
                )
            except (TimeoutError, OSError) as e:
                log.debug(
                    "proxy %s: upstream %s:%d unreachable: %r", self.address, self.target_host, self.target_port, e
                )
                conn.abort()  # the client sees a reset, as it would without the proxy
                return
            conn.target_w = target_w
            up = _Pipe(self, client_r, target_w, up=True)
            down = _Pipe(self, target_r, client_w, up=False)
            conn.pipes = [up, down]
            tasks = [
                asyncio.create_task(coro) for coro in (up.pump_in(), up.pump_out(), down.pump_in(), down.pump_out())
            ]
            try:
                # any error (reset by a peer, by reset()) ends the whole connection
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                if any(t.exception() is not None for t in done if not t.cancelled()):
                    conn.abort()
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        except asyncio.CancelledError:
            conn.abort()
            raise
        finally:
            self._conns.discard(conn)
            for w in conn.writers():
                w.close()


__all__ = ["FaultProxy", "ProxyError", "ProxyStats"]
