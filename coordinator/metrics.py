"""Prometheus metrics of the coordinator daemon (prometheus-client, its own registry).

Its own `CollectorRegistry` instead of the global one, so several coordinators in one test
process never collide and the endpoint exports only Bagel's series. Served over HTTP on
`--metrics-listen` by prometheus-client's own server (a daemon thread).

Series:
- `bagel_workers{state}`                         gauge: workers by state (active, lost, ...)
- `bagel_committed_rounds_total{cell}`           counter: rounds committed, by cell
- `bagel_round_duration_seconds{cell}`           histogram: open -> commit, by cell
- `bagel_rpc_latency_seconds{method}`            histogram: handler latency, by RPC
- `bagel_rpc_total{method,code}`                 counter: RPCs by gRPC status
- `bagel_rejected_messages_total{reason}`        counter: refused requests, by reason
- `bagel_store_writes_total`                     counter: durable SQLite transactions
- `bagel_event_loop_lag_seconds`                 histogram: how late the tick timer fired
  (the event loop was busy or stalled that long: every request waits behind it)
- `bagel_gc_pause_seconds{generation}`           histogram: cyclic GC passes (`watch_gc`)
"""

from __future__ import annotations

import collections
import gc
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import start_http_server

# RPC latencies of a healthy coordinator are sub-millisecond to tens of ms; round
# durations are seconds to hours.
_RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
_ROUND_BUCKETS = (1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200)
_PAUSE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """All coordinator series on one private registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.workers = Gauge("bagel_workers", "Workers by state", ["state"], registry=r)
        self.committed_rounds = Counter("bagel_committed_rounds", "Committed outer rounds", ["cell"], registry=r)
        self.round_duration = Histogram(
            "bagel_round_duration_seconds",
            "Outer round duration from open to commit",
            ["cell"],
            buckets=_ROUND_BUCKETS,
            registry=r,
        )
        self.rpc_latency = Histogram(
            "bagel_rpc_latency_seconds",
            "Coordinator RPC handler latency",
            ["method"],
            buckets=_RPC_BUCKETS,
            registry=r,
        )
        self.rpc_total = Counter("bagel_rpc", "Coordinator RPCs by status", ["method", "code"], registry=r)
        self.rejected = Counter("bagel_rejected_messages", "Requests refused, by reason", ["reason"], registry=r)
        self.store_writes = Counter("bagel_store_writes", "Durable SQLite transactions", registry=r)
        self.loop_lag = Histogram(
            "bagel_event_loop_lag_seconds",
            "How late the coordinator's periodic timer fired (event loop busy or stalled)",
            buckets=_PAUSE_BUCKETS,
            registry=r,
        )
        self.gc_pause = Histogram(
            "bagel_gc_pause_seconds",
            "Cyclic garbage collector passes, by generation (2 = full)",
            ["generation"],
            buckets=_PAUSE_BUCKETS,
            registry=r,
        )
        # GC passes seen by the callback, published later by `flush_gc` (see watch_gc)
        self._gc_pauses: collections.deque[tuple[int, float]] = collections.deque(maxlen=4096)
        self._gc_started = 0.0
        self._server: Any = None
        self._thread: Any = None
        # label children cached: `labels()` takes a lock and a dict lookup per call, which
        # shows up on the heartbeat hot path.
        self._latency_children: dict[str, Any] = {}
        self._rpc_children: dict[tuple[str, str], Any] = {}

    def observe_rpc(self, method: str, seconds: float, code: str) -> None:
        child = self._latency_children.get(method)
        if child is None:
            child = self._latency_children[method] = self.rpc_latency.labels(method)
        child.observe(seconds)
        key = (method, code)
        counter = self._rpc_children.get(key)
        if counter is None:
            counter = self._rpc_children[key] = self.rpc_total.labels(method, code)
        counter.inc()

    def reject(self, reason: str) -> None:
        self.rejected.labels(reason).inc()

    def set_workers(self, counts: dict[str, int]) -> None:
        for state in ("active", "lost", "left", "banned"):
            counts.setdefault(state, 0)
        for state, n in counts.items():
            self.workers.labels(state).set(n)

    def round_committed(self, cell: str, duration_s: float | None) -> None:
        self.committed_rounds.labels(cell).inc()
        if duration_s is not None and duration_s >= 0:
            self.round_duration.labels(cell).observe(duration_s)

    def watch_gc(self) -> Callable[[], None]:
        """Time every cyclic GC pass of this process; returns the function that stops it.

        The callback runs inside the collector, on whichever thread triggered it, so it
        only appends to a deque (no lock: a prometheus observe takes one, and a pass
        triggered while that lock is held would deadlock); `flush_gc`, called from the
        event loop, moves the figures into the histogram.
        """

        def callback(phase: str, info: dict[str, Any]) -> None:
            if phase == "start":
                self._gc_started = time.perf_counter()
            else:
                self._gc_pauses.append((int(info["generation"]), time.perf_counter() - self._gc_started))

        gc.callbacks.append(callback)
        return lambda: gc.callbacks.remove(callback)

    def flush_gc(self) -> None:
        pauses = self._gc_pauses
        while pauses:
            generation, seconds = pauses.popleft()
            self.gc_pause.labels(str(generation)).observe(seconds)

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP endpoint; returns the bound port (port 0 picks one)."""
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        return int(self._server.server_address[1])

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def text(self) -> str:
        return generate_latest(self.registry).decode()
