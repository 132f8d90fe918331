"""The live dashboard: a read-only page and one JSON document, served by the daemon itself.

`bagel-coordinator serve --dashboard-listen HOST:PORT` (off by default) serves:

- `/` the page, `/static/dashboard.js`, `/static/dashboard.css`: hand-written files shipped
  in the package (`bagel/coordinator/static/`, package data), read once at start; nothing
  comes from anywhere else (the page's Content-Security-Policy allows only its own origin);
- `/api/state`: the run as JSON (`DashboardState.build`): cells, workers, recent events,
  the throughput/goodput series. The page polls it once a second and redraws in place.

The HTTP side is the standard library's `http.server` on its own thread, as the metrics
endpoint is prometheus-client's: the request parsing is the library's, bounded by its
line and header limits, a socket timeout per connection and at most `MAX_CONNECTIONS`
handler threads (more are answered 503 at once). Only GET and HEAD of the four paths
exist. The thread never touches the core: `/api/state` asks the event loop for the
document (`run_coroutine_threadsafe`), which the loop rebuilds at most once per
`REFRESH_S` (or ten times what the last build cost, if more) however many pages poll, and
only while somebody polls.

Access: no authentication. The document lists every worker's id, name and cell (what the
signed GetStatus keeps to the operator), so the listener must be loopback (127.0.0.0/8,
::1, localhost) unless `--dashboard-public` says otherwise; reach it from elsewhere
through an SSH tunnel (`ssh -L 8080:127.0.0.1:8080 host`) or an authenticating proxy.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import TYPE_CHECKING, Any

from bagel.coordinator.core.errors import CoordinatorError
from bagel.coordinator.core.records import WorkerState
from bagel.protocol.runspec import parse_cell

if TYPE_CHECKING:
    from bagel.coordinator.app import CoordinatorApp

log = logging.getLogger(__name__)

REFRESH_S = 1.0  # the document is rebuilt at most this often
HOLD_FACTOR = 10.0  # ... and held at least this many times what building it cost
MAX_CONNECTIONS = 16  # concurrent handler threads; more get 503
SOCKET_TIMEOUT_S = 5.0  # a client that sends nothing for this long is dropped
BUILD_TIMEOUT_S = 5.0  # how long a request waits for the event loop to build the document
WORKERS_SHOWN = 200  # workers listed (active first); the counts cover all of them
EVENTS_SHOWN = 100

_STATIC = {
    "/": ("dashboard.html", "text/html; charset=utf-8"),
    "/index.html": ("dashboard.html", "text/html; charset=utf-8"),
    "/static/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/static/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}
_SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
_STATE_ORDER = {WorkerState.ACTIVE: 0, WorkerState.LOST: 1, WorkerState.LEFT: 2, WorkerState.BANNED: 3}


class DashboardAddressError(ValueError):
    """`--dashboard-listen` is malformed, or not loopback without `--dashboard-public`."""


def is_loopback(host: str) -> bool:
    """True for localhost, 127.0.0.0/8 and ::1; ValueError if `host` is no IP address."""
    return host == "localhost" or ipaddress.ip_address(host).is_loopback


def parse_listen(listen: str, *, public: bool = False) -> tuple[str, int]:
    """HOST:PORT ([V6]:PORT) -> (host, port); refuses a non-loopback host unless `public`."""
    host, sep, port_s = listen.rpartition(":")
    if not sep or not port_s.isdigit() or not 0 <= int(port_s) <= 65535:
        raise DashboardAddressError(f"--dashboard-listen {listen!r}: expected HOST:PORT, e.g. 127.0.0.1:8080")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host:
        raise DashboardAddressError(f"--dashboard-listen {listen!r}: give a host, e.g. 127.0.0.1:{port_s}")
    try:
        loopback = is_loopback(host)
    except ValueError:
        raise DashboardAddressError(
            f"--dashboard-listen {listen!r}: the host must be an IP address or localhost"
        ) from None
    if not loopback and not public:
        raise DashboardAddressError(
            f"--dashboard-listen {listen!r} is not loopback: the dashboard has no authentication and lists every "
            "worker; use 127.0.0.1 with an SSH tunnel, or add --dashboard-public to serve it there anyway"
        )
    return host, int(port_s)


def _static_files() -> dict[str, tuple[bytes, str]]:
    root = resources.files("bagel.coordinator") / "static"
    return {path: (root.joinpath(name).read_bytes(), ctype) for path, (name, ctype) in _STATIC.items()}


class DashboardState:
    """Builds the `/api/state` document from the app on the event loop, cached."""

    def __init__(self, app: CoordinatorApp, *, started_ms: int) -> None:
        self.app = app
        self.started_ms = started_ms
        self._cached: tuple[float, bytes, float] | None = None  # (at, body, hold_s)

    def body(self) -> bytes:
        now = time.monotonic()
        if self._cached is not None and now - self._cached[0] < self._cached[2]:
            return self._cached[1]
        body = json.dumps(self.build(), separators=(",", ":"), allow_nan=False).encode()
        took = time.monotonic() - now
        self._cached = (now, body, max(REFRESH_S, HOLD_FACTOR * took))
        return body

    def build(self) -> dict[str, Any]:
        app = self.app
        st, spec = app.state, app.spec
        now = app.clock()
        lease_ms = int(spec.schedule.lease_s * 1000)
        snap = st.snapshot()
        ordered = sorted(snap.workers, key=lambda w: (_STATE_ORDER.get(w.state, 9), w.cell_id, w.worker_id))
        names = {w.worker_id: w.profile.name for w in snap.workers}
        workers = []
        for w in ordered[:WORKERS_SHOWN]:
            phase, heartbeat_age = "", None
            if w.state is WorkerState.ACTIVE:
                try:
                    p, _round, _step, _loss, lease_expires = st.worker_phase(w.worker_id)
                except CoordinatorError:
                    pass
                else:
                    phase = p.name.lower()
                    # every heartbeat renews the lease to now + lease_s
                    heartbeat_age = max(0.0, (now - (lease_expires - lease_ms)) / 1000.0)
            workers.append(
                {
                    "worker_id": w.worker_id,
                    "name": w.profile.name[:64],
                    "state": w.state.value,
                    "reason": w.reason[:200],
                    "phase": phase,
                    "cell_id": w.cell_id,
                    "samples_per_s": float(w.throughput.get(w.cell_id, 0.0)) if w.cell_id else 0.0,
                    "heartbeat_age_s": heartbeat_age,
                    "reputation": w.reputation,
                    "device": w.profile.device_name[:64] or w.profile.device_kind,
                    # reported by workers that probe how they are reached (direct, relayed, ...)
                    "reachability": str(getattr(w.profile, "reachability", "") or "")[:64],
                    "rounds_contributed": w.rounds_contributed,
                }
            )
        cells = []
        for cell_id in spec.cell_ids:
            rec, rnd, members = st.cell_view(cell_id)
            curve = app.history.curve(cell_id)
            last = curve[-1] if curve else None
            cells.append(
                {
                    "cell_id": cell_id,
                    "kind": "router" if parse_cell(cell_id) is None else "expert",
                    "committed_round": rec.committed_round,
                    "round": rnd.round if rnd else 0,
                    "round_state": rnd.state.value if rnd else "none",
                    "members": [names.get(m, "")[:32] or m for m in sorted(members)[:32]],
                    "member_count": len(members),
                    "samples_committed": rec.samples_committed,
                    "rollbacks": rec.rollbacks,
                    "last_commit_age_s": None if last is None else max(0.0, (now - last.committed_ms) / 1000.0),
                    "bytes_per_round": None if last is None else last.bytes_sent,
                    "heldout_loss": None if rec.heldout_loss < 0 else rec.heldout_loss,
                    "loss": None if rec.committed_round == 0 else rec.last_loss,
                    "curve": [
                        {
                            "round": p.round,
                            "loss": p.loss,
                            "heldout_loss": None if p.heldout_loss < 0 else p.heldout_loss,
                            "bytes": p.bytes_sent,
                        }
                        for p in curve
                    ],
                }
            )
        counts = app.tally.counts()
        return {
            "run_id": spec.run.id,
            "spec_hash": spec.spec_hash,
            "now_ms": now,
            "uptime_s": max(0.0, (now - self.started_ms) / 1000.0),
            "health": {
                "active": counts.get("active", 0),
                "expected": counts.get("active", 0) + counts.get("lost", 0),
                "standby": counts.get("standby", 0),
                "counts": counts,
                "cells": len(spec.cell_ids),
                "unstaffed": app.feed.unstaffed(),
            },
            "cells": cells,
            "workers": workers,
            "workers_total": len(snap.workers),
            "events": [e.to_json() for e in app.feed.recent(EVENTS_SHOWN)],
            "series": app.history.series(now),
            "totals": {"trained": app.history.trained_total, "committed": app.history.committed_total},
        }


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], handler: type[BaseHTTPRequestHandler], dash: DashboardServer) -> None:
        if ":" in addr[0]:
            self.address_family = socket.AF_INET6
        self.dash = dash
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(addr, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            try:
                request.sendall(b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a client that went away mid-answer, a malformed request: the library would print a
        # traceback to stderr; one debug line is enough
        log.debug("dashboard request from %s failed", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = SOCKET_TIMEOUT_S
    protocol_version = "HTTP/1.0"  # one request per connection: a handler thread lives for one answer
    server_version = "bagel-dashboard"
    sys_version = ""

    def do_GET(self) -> None:
        self._answer(send_body=True)

    def do_HEAD(self) -> None:
        self._answer(send_body=False)

    def _answer(self, *, send_body: bool) -> None:
        path = self.path.split("?", 1)[0]
        dash = self.server.dash
        if path == "/api/state":
            try:
                body = dash.state_body()
            except Exception as e:  # the loop is stopping or stuck: say so, never hang
                log.debug("dashboard state unavailable: %s", e)
                self._send(HTTPStatus.SERVICE_UNAVAILABLE, b"", "text/plain", send_body)
                return
            self._send(HTTPStatus.OK, body, "application/json", send_body)
            return
        static = dash.static.get(path)
        if static is None:
            self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain; charset=utf-8", send_body)
            return
        self._send(HTTPStatus.OK, static[0], static[1], send_body)

    def _send(self, code: HTTPStatus, body: bytes, ctype: str, send_body: bool) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for k, v in _SECURITY_HEADERS.items():
            self.send_header(k, v)
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("dashboard %s: " + format, self.address_string(), *args)


class DashboardServer:
    """The dashboard's HTTP server (see the module docstring); `start` binds, `stop` closes."""

    def __init__(self, app: CoordinatorApp, host: str, port: int, *, started_ms: int) -> None:
        self.state = DashboardState(app, started_ms=started_ms)
        self.static = _static_files()
        self.host = host
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server = _Server((host, port), _Handler, self)
        self.port = int(self._server.server_address[1])
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._server.serve_forever, name="bagel-dashboard", daemon=True)
        self._thread.start()

    def state_body(self) -> bytes:
        """From a handler thread: the document, built on the event loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            raise RuntimeError("the coordinator is not running")

        async def build() -> bytes:
            return self.state.body()

        fut: concurrent.futures.Future[bytes] = asyncio.run_coroutine_threadsafe(build(), loop)
        try:
            return fut.result(timeout=BUILD_TIMEOUT_S)
        finally:
            fut.cancel()

    async def stop(self) -> None:
        if self._thread is not None:
            await asyncio.to_thread(self._server.shutdown)
            self._thread = None
        self._server.server_close()


def start_dashboard(app: CoordinatorApp, listen: str, *, public: bool, clock: Callable[[], int]) -> DashboardServer:
    """Bind and start the dashboard on the running loop; raises DashboardAddressError, OSError."""
    host, port = parse_listen(listen, public=public)
    try:
        server = DashboardServer(app, host, port, started_ms=clock())
    except OSError as e:
        raise DashboardAddressError(f"--dashboard-listen {listen}: cannot listen there: {e.strerror or e}") from None
    if not is_loopback(host):
        log.warning("the dashboard on %s is not loopback: anyone who reaches it sees every worker", server.url)
    server.start()
    return server
