"""TCP probes run inside the bed's namespaces: a sink that counts what it receives, a sender
that pushes bytes for a while, and a connect check. Each prints one JSON line.

    python -m bagel.sim.netlab.probe sink --port 9000 [--once]
    python -m bagel.sim.netlab.probe send --to 198.51.100.10:9000 --seconds 1.5
    python -m bagel.sim.netlab.probe connect --to 192.168.1.11:9000 --timeout 2

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
    a = p.parse_args(argv)
    if a.cmd == "sink":
        return sink(a.port, a.once, a.idle_timeout)
    if a.cmd == "send":
        return send(a.to, a.seconds, a.timeout)
    return connect(a.to, a.timeout)


if __name__ == "__main__":
    sys.exit(main())
