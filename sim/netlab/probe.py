"""TCP probes run inside the bed's namespaces: a sink that counts what it receives, a sender
that pushes bytes for a while, and a connect check. Each prints one JSON line.

    python -m bagel.sim.netlab.probe sink --port 9000 [--once]
    python -m bagel.sim.netlab.probe send --to 198.51.100.10:9000 --seconds 1.5
    python -m bagel.sim.netlab.probe connect --to 192.168.1.11:9000 --timeout 2
    python -m bagel.sim.netlab.probe source --port 9001 --seconds 1.5
    python -m bagel.sim.netlab.probe fetch --to 198.51.100.10:9001
    python -m bagel.sim.netlab.probe udp-sink --port 9100 --quiet-s 1.5
    python -m bagel.sim.netlab.probe udp-send --to 198.51.100.10:9100 --count 2000

The sink answers each connection, after the sender's end of stream, with the number of
bytes it received and the source address it saw, so the sender learns what was really
delivered (not what its socket buffer accepted) and which address the far side saw (the
NAT's public address, for a host behind a home router).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time

CHUNK = 64 * 1024
SO_RCVBUFFORCE = 33  # Linux's value; the socket module does not export it
MAX_REPLY = 256


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def sink(port: int, once: bool, idle_timeout_s: float) -> int:
    """Accept connections; for each, read to EOF and answer `<bytes> <peer-ip>`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("0.0.0.0", port))
        srv.listen(16)
        print(json.dumps({"listening": srv.getsockname()[1]}), flush=True)
        while True:
            conn, peer = srv.accept()
            with conn:
                conn.settimeout(idle_timeout_s)
                got = 0
                try:
                    while data := conn.recv(CHUNK):
                        got += len(data)
                    conn.sendall(f"{got} {peer[0]}\n".encode())
                except OSError:
                    pass
                print(json.dumps({"received": got, "peer": peer[0]}), flush=True)
            if once:
                return 0


def send(to: str, seconds: float, timeout_s: float) -> int:
    """Send for `seconds` (or until the link refuses), close the sending side, read the count."""
    payload = b"\0" * CHUNK
    started = time.monotonic()
    try:
        with socket.create_connection(_addr(to), timeout=timeout_s) as s:
            sent = 0
            while time.monotonic() - started < seconds:
                sent += s.send(payload)
            s.shutdown(socket.SHUT_WR)
            reply = b""
            while len(reply) < MAX_REPLY and b"\n" not in reply:
                data = s.recv(MAX_REPLY)
                if not data:
                    break
                reply += data
        elapsed = time.monotonic() - started
    except OSError as e:
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return 1
    count, _, peer = reply.decode(errors="replace").strip().partition(" ")
    delivered = int(count) if count.isdigit() else -1
    print(
        json.dumps(
            {"sent": sent, "delivered": delivered, "seen_as": peer, "elapsed_s": elapsed,
             "mbit_s": delivered * 8 / elapsed / 1e6 if elapsed > 0 else 0.0}
        ),
        flush=True,
    )  # fmt: skip
    return 0 if delivered >= 0 else 1


def source(port: int, seconds: float) -> int:
    """Accept connections; send to each for `seconds`, then close (the download direction)."""
    payload = b"\0" * CHUNK
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("0.0.0.0", port))
        srv.listen(16)
        print(json.dumps({"listening": srv.getsockname()[1]}), flush=True)
        while True:
            conn, _ = srv.accept()
            with conn:
                conn.settimeout(30.0)
                started = time.monotonic()
                try:
                    while time.monotonic() - started < seconds:
                        conn.sendall(payload)
                except OSError:
                    pass


def fetch(to: str, timeout_s: float) -> int:
    """Read from a `source` until it closes; the rate is received bytes over the elapsed time."""
    started = time.monotonic()
    got = 0
    try:
        with socket.create_connection(_addr(to), timeout=timeout_s) as s:
            while data := s.recv(CHUNK):
                got += len(data)
    except OSError as e:
        print(json.dumps({"error": f"{type(e).__name__}: {e}", "received": got}), flush=True)
        return 1
    elapsed = time.monotonic() - started
    print(json.dumps({"received": got, "elapsed_s": elapsed, "mbit_s": got * 8 / elapsed / 1e6}), flush=True)
    return 0


def connect(to: str, timeout_s: float) -> int:
    """Exit 0 if a TCP connection to `to` opens within the timeout, else 1 with the reason."""
    try:
        with socket.create_connection(_addr(to), timeout=timeout_s):
            pass
    except OSError as e:
        print(json.dumps({"connected": False, "error": f"{type(e).__name__}: {e}"}), flush=True)
        return 1
    print(json.dumps({"connected": True}), flush=True)
    return 0


def udp_sink(port: int, quiet_s: float, timeout_s: float) -> int:
    """Count datagrams until none came for `quiet_s` (after the first) or `timeout_s` passed."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        # a deep receive queue, so a sink descheduled for a while on a busy machine loses
        # nothing itself and every drop counted is the link's (FORCE: root, past rmem_max)
        try:
            s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 16 << 20)
        except OSError:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
        s.bind(("0.0.0.0", port))
        print(json.dumps({"listening": s.getsockname()[1]}), flush=True)
        got = 0
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            s.settimeout(min(left, quiet_s) if got else left)
            try:
                s.recv(CHUNK)
            except TimeoutError:
                break
            got += 1
    print(json.dumps({"received": got}), flush=True)
    return 0


def udp_send(to: str, count: int, size: int) -> int:
    """Send `count` datagrams of `size` bytes, paced so no local queue overflows."""
    payload = b"d" * size
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for i in range(count):
            s.sendto(payload, _addr(to))
            if i % 50 == 49:
                time.sleep(0.002)
    print(json.dumps({"sent": count}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bagel.sim.netlab.probe", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sink")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--once", action="store_true")
    s.add_argument("--idle-timeout", type=float, default=30.0)
    t = sub.add_parser("send")
    t.add_argument("--to", required=True)
    t.add_argument("--seconds", type=float, default=1.0)
    t.add_argument("--timeout", type=float, default=10.0)
    c = sub.add_parser("connect")
    c.add_argument("--to", required=True)
    c.add_argument("--timeout", type=float, default=2.0)
    o = sub.add_parser("source")
    o.add_argument("--port", type=int, required=True)
    o.add_argument("--seconds", type=float, default=1.0)
    f = sub.add_parser("fetch")
    f.add_argument("--to", required=True)
    f.add_argument("--timeout", type=float, default=10.0)
    u = sub.add_parser("udp-sink")
    u.add_argument("--port", type=int, required=True)
    u.add_argument("--quiet-s", type=float, default=1.5)
    u.add_argument("--timeout", type=float, default=30.0)
    v = sub.add_parser("udp-send")
    v.add_argument("--to", required=True)
    v.add_argument("--count", type=int, default=1000)
    v.add_argument("--size", type=int, default=200)
    a = p.parse_args(argv)
    if a.cmd == "source":
        return source(a.port, a.seconds)
    if a.cmd == "fetch":
        return fetch(a.to, a.timeout)
    if a.cmd == "udp-sink":
        return udp_sink(a.port, a.quiet_s, a.timeout)
    if a.cmd == "udp-send":
        return udp_send(a.to, a.count, a.size)
    if a.cmd == "sink":
        return sink(a.port, a.once, a.idle_timeout)
    if a.cmd == "send":
        return send(a.to, a.seconds, a.timeout)
    return connect(a.to, a.timeout)


if __name__ == "__main__":
    sys.exit(main())
