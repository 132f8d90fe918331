"""The chaos TCP fault proxy against a local echo server: latency, bandwidth, reset, hang, close.

No wall-clock equality: latency and bandwidth are checked with generous lower bounds on
elapsed time (a loaded machine only makes them slower) or by counting bytes.
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from bagel.sim.chaos.proxy import FaultProxy, ProxyError


class EchoServer:
    """Echoes every byte; records how many bytes it received and whether its peer reset."""

    def __init__(self) -> None:
        self.received = 0
        self.errors: list[BaseException] = []
        self.closed = asyncio.Event()
        self.server: asyncio.Server | None = None
        self.port = 0
        self.echo = True

    async def start(self) -> EchoServer:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(65536):
                self.received += len(data)
                if self.echo:
                    w.write(data)
                    await w.drain()
        except (ConnectionError, OSError) as e:
            self.errors.append(e)
        finally:
            self.closed.set()
            w.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


@pytest.fixture
async def echo():
    s = await EchoServer().start()
    try:
        yield s
    finally:
        await s.stop()


@pytest.fixture
async def proxy(echo):
    p = await FaultProxy("127.0.0.1", echo.port).start()
    try:
        yield p
    finally:
        await p.close()


async def roundtrip(port: int, payload: bytes = b"ping") -> float:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        t0 = time.monotonic()
        w.write(payload)
        await w.drain()
        got = await asyncio.wait_for(r.readexactly(len(payload)), 30)
        assert got == payload
        return time.monotonic() - t0
    finally:
        w.close()


async def test_forwards_both_directions(proxy, echo):
    payload = bytes(range(256)) * 1000
    r, w = await asyncio.open_connection("127.0.0.1", proxy.port)
    w.write(payload)
    await w.drain()
    assert await asyncio.wait_for(r.readexactly(len(payload)), 30) == payload
    w.close()
    assert proxy.stats.bytes_up == len(payload) and proxy.stats.bytes_down == len(payload)


async def test_latency_added_each_direction(proxy, echo):
    proxy.set_latency(250)
    t = await roundtrip(proxy.port)
    assert t >= 0.45  # 2 x 250 ms, minus timer slack
    proxy.set_latency(0)
    # once removed, a round trip is no longer delayed by 0.5 s (generous: 0.45 s of slack)
    fast = min([await roundtrip(proxy.port) for _ in range(3)])
    assert fast < t


async def test_latency_pipelines_chunks(proxy, echo):
    """Latency delays each chunk; it does not serialise them (10 chunks != 10 x latency)."""
    proxy.set_latency(300)
    r, w = await asyncio.open_connection("127.0.0.1", proxy.port)
    t0 = time.monotonic()
    for _ in range(10):
        w.write(b"x" * 100)
        await w.drain()
        await asyncio.sleep(0.01)
    await asyncio.wait_for(r.readexactly(1000), 30)
    elapsed = time.monotonic() - t0
    w.close()
    assert elapsed >= 0.55
    assert elapsed < 10 * 0.6  # serialised delivery would need >= 6 s


async def test_bandwidth_cap_counts_bytes(proxy, echo):
    rate = 64 * 1024
    proxy.set_bandwidth(rate)
    echo.echo = False
    r, w = await asyncio.open_connection("127.0.0.1", proxy.port)
    t0 = time.monotonic()
    w.write(b"y" * (rate * 4))
    # sample the server's count a few times: never more than the cap allows so far
    for _ in range(5):
        await asyncio.sleep(0.2)
        elapsed = time.monotonic() - t0
        assert echo.received <= rate * elapsed + rate * 0.05 + 1
    await asyncio.wait_for(w.drain(), 30)
    w.close()
    await asyncio.wait_for(echo.closed.wait(), 30)
    assert echo.received == rate * 4
    assert time.monotonic() - t0 >= 3.5  # 4 x rate bytes at rate bytes/s


async def test_reset_closes_both_sides(proxy, echo):
    r, w = await asyncio.open_connection("127.0.0.1", proxy.port)
    w.write(b"hello")
    await w.drain()
    assert await asyncio.wait_for(r.readexactly(5), 30) == b"hello"
    assert proxy.open_connections == 1
    assert proxy.reset() == 1
    # client: RST or EOF
    try:
        data = await asyncio.wait_for(r.read(10), 30)
        assert data == b""
    except ConnectionResetError:
        pass
    # server: its connection ended too
    await asyncio.wait_for(echo.closed.wait(), 30)
    assert proxy.stats.resets == 1
    # the proxy still accepts new connections after a reset
    await roundtrip(proxy.port)
    w.close()


async def test_hang_stops_forwarding_then_resume_delivers(proxy, echo):
    r, w = await asyncio.open_connection("127.0.0.1", proxy.port)
    await roundtrip(proxy.port)
    proxy.hang()
    assert proxy.hung
    w.write(b"held")
    await w.drain()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(r.readexactly(4), 0.5)
    assert echo.received == 4  # only the earlier round trip's bytes reached the server
    proxy.resume()
    assert await asyncio.wait_for(r.readexactly(4), 30) == b"held"
    w.close()


async def test_hang_holds_new_connections_until_resume(proxy, echo):
    proxy.hang()
    task = asyncio.create_task(roundtrip(proxy.port))
    await asyncio.sleep(0.4)
    assert not task.done()
    assert echo.received == 0
    proxy.resume()
    await asyncio.wait_for(task, 30)


async def test_hang_buffers_are_bounded(echo):
    p = await FaultProxy("127.0.0.1", echo.port, max_buffer_bytes=64 * 1024).start()
    try:
        r, w = await asyncio.open_connection("127.0.0.1", p.port)
        await roundtrip(p.port)
        p.hang()
        w.write(b"z" * (8 << 20))  # far more than the buffer and the kernel's socket buffers
        drained = asyncio.create_task(w.drain())
        await asyncio.sleep(0.5)
        assert p.buffered_bytes() <= 64 * 1024 + 16 * 1024
        assert not drained.done()  # the sender is back-pressured
        p.resume()
        await asyncio.wait_for(r.readexactly(8 << 20), 60)
        await drained
        w.close()
    finally:
        await p.close()


async def test_close_closes_connections_and_frees_port(echo):
    p = await FaultProxy("127.0.0.1", echo.port).start()
    port = p.port
    r, w = await asyncio.open_connection("127.0.0.1", port)
    await roundtrip(port)
    await p.close()
    try:
        assert await asyncio.wait_for(r.read(10), 30) == b""
    except ConnectionResetError:
        pass
    w.close()
    with socket.socket() as s:  # the port is free again
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
    await p.close()  # idempotent


async def test_unreachable_target_resets_client():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # bound, not listening: connections are refused
        p = await FaultProxy("127.0.0.1", dead).start()
        try:
            r, w = await asyncio.open_connection("127.0.0.1", p.port)
            try:
                assert await asyncio.wait_for(r.read(10), 30) == b""
            except ConnectionResetError:
                pass
            w.close()
        finally:
            await p.close()


def test_rejects_non_loopback_and_bad_settings():
    with pytest.raises(ProxyError, match="loopback"):
        FaultProxy("127.0.0.1", 80, listen_host="0.0.0.0")
    with pytest.raises(ProxyError, match="target_port"):
        FaultProxy("127.0.0.1", 0)
    p = FaultProxy("127.0.0.1", 80)
    with pytest.raises(ProxyError, match="latency_ms"):
        p.set_latency(-1)
    with pytest.raises(ProxyError, match="bandwidth"):
        p.set_bandwidth(-5)
