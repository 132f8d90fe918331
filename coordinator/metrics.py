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
- `bagel_watches_held`                           gauge: `WatchInstruction` long polls held now
- `bagel_event_loop_lag_seconds`                 histogram: how late the tick timer fired
  (the event loop was busy or stalled that long: every request waits behind it)
- `bagel_gc_pause_seconds{generation}`           histogram: cyclic GC passes (`watch_gc`)

What the run is doing (`RunBook` derives them from the workers' round reports and the
core's records; every label set is bounded by the spec: `cell` by its cells, `worker_class`
by its `[cost]` table plus "cpu" and "other", `phase` and `kind` by the lists below; no
worker id is ever a label):
- `bagel_info{run_id,spec_hash,version}`                  gauge 1
- `bagel_step_seconds_total{cell,worker_class,phase}`     counter: where members' round time went
  (phase: data, forward_backward, optimizer, encode, exchange, outer_step, waiting)
- `bagel_trained_samples_total{cell,worker_class}`        counter: samples members reported
- `bagel_denoising_samples_per_second{cell,worker_class}` gauge: one member's training
  throughput (reported samples / training seconds), averaged over the class's recent reports
- `bagel_worker_memory_bytes{worker_class,kind}`          gauge over the class's recent reports:
  kind cuda_free_min (the tightest VRAM headroom), cuda_peak_allocated_max, rss_max
- `bagel_round_open_to_freeze_seconds{cell}`              histogram: a round's open -> freeze
- `bagel_standby_workers`, `bagel_cells_without_members`  gauges: queueing
- `bagel_rpc_latency_p99_seconds{method}`                 gauge: p99 of the recent handler latencies
- `bagel_exchange_p99_seconds{cell}`                      gauge: p99 of members' recent exchange times
- `bagel_exchange_reports_total{cell,outcome}`            counter: members' exchanges, ok or failed
- `bagel_rounds_attempted_total{cell}`                    counter: attempts that ended (commit or abort)
- `bagel_slo_round_success_objective`                     gauge: `[slo] round_success`
- `bagel_slo_round_success_ratio{cell}`                   gauge: committed / attempted, last window
- `bagel_slo_burn_rate{cell}`                             gauge: (1 - ratio) / (1 - objective)
- `bagel_cost_total{worker_class}`                        counter: device-hours x `[cost]` price
- `bagel_cost_per_committed_sample{cell}`                 gauge: spend / committed samples (this process)
- `bagel_heldout_loss{cell}`                              gauge: the committed state's median held-out loss
- `bagel_loss_spikes_total{cell}`                         gauge: attempts the commit guard refused (a jump)
- `bagel_rollbacks_total{cell}`                           gauge: times the cell fell back to its checkpoint
- `bagel_committed_samples{cell}`                         gauge: samples in the cell's committed rounds
"""

from __future__ import annotations

import collections
import gc
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import start_http_server

from bagel.coordinator.core.records import CellRecord, CommitRecord, Record, RoundRecord, RoundState, Snapshot
from bagel.protocol.messages import Profile
from bagel.protocol.runspec import CostSection, RunSpec

# RPC latencies of a healthy coordinator are sub-millisecond to tens of ms; round
# durations are seconds to hours.
_RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
_ROUND_BUCKETS = (1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200)
_PAUSE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_FREEZE_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
# the phases of a member's round, as the report's `<phase>_ms` fields name them
PHASES = ("data", "forward_backward", "optimizer", "encode", "exchange", "outer_step", "waiting")
MEMORY_KINDS = ("cuda_free_min", "cuda_peak_allocated_max", "rss_max")
RECENT_RPCS = 1024  # latencies kept per method for the p99 gauge
RECENT_REPORTS = 256  # reports kept per cell or class for the p99 / memory / throughput gauges
SEEN_REPORTS = 8192  # (worker, cell, round, reduce attempt) remembered so a re-report is not counted twice


def version() -> str:
    """Bagel's installed version ("unknown" when run from a tree that was never installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("bagel")
    except PackageNotFoundError:
        return "unknown"


def worker_class(profile: Profile, cost: CostSection) -> str:
    """The `worker_class` label of a worker: "cpu", the first `[cost] gpu_hour` class named
    in its device name, or "other". Bounded by the spec, whatever a worker claims."""
    if profile.device_kind == "cpu":
        return "cpu"
    name = profile.device_name.lower()
    for cls, _price in cost.gpu_hour:
        if cls.lower() in name:
            return cls
    return "other"


def hourly_price(cls: str, cost: CostSection) -> float:
    if cls == "cpu":
        return cost.cpu_hour
    return dict(cost.gpu_hour).get(cls, cost.other_gpu_hour)


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile by nearest rank (no interpolation); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def commit_rate(commits: Sequence[tuple[int, int]]) -> float:
    """Committed samples per second over (committed_ms, samples) of a cell's recent commits,
    oldest first: the samples after the first commit over the time since it (0 = unknown)."""
    if len(commits) < 2:
        return 0.0
    span_s = (commits[-1][0] - commits[0][0]) / 1000.0
    return sum(s for _, s in commits[1:]) / span_s if span_s > 0 else 0.0


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
        self.watches_held = Gauge("bagel_watches_held", "WatchInstruction long polls held now", registry=r)
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
        self._run_series(r)
        # GC passes seen by the callback, published later by `flush_gc` (see watch_gc)
        self._gc_pauses: collections.deque[tuple[int, float]] = collections.deque(maxlen=4096)
        self._gc_started = 0.0
        self._server: Any = None
        self._thread: Any = None
        # label children cached: `labels()` takes a lock and a dict lookup per call, which
        # shows up on the heartbeat hot path.
        self._latency_children: dict[str, Any] = {}
        self._rpc_children: dict[tuple[str, str], Any] = {}
        self.recent_rpc: dict[str, collections.deque[float]] = {}

    def _run_series(self, r: CollectorRegistry) -> None:
        self.info = Gauge(
            "bagel_info", "Run and software version (value 1)", ["run_id", "spec_hash", "version"], registry=r
        )
        self.step_seconds = Counter(
            "bagel_step_seconds", "Members' round time by phase", ["cell", "worker_class", "phase"], registry=r
        )
        self.trained_samples = Counter(
            "bagel_trained_samples", "Samples members reported training", ["cell", "worker_class"], registry=r
        )
        self.throughput = Gauge(
            "bagel_denoising_samples_per_second",
            "One member's denoising training throughput, mean over the class's recent reports",
            ["cell", "worker_class"],
            registry=r,
        )
        self.memory = Gauge(
            "bagel_worker_memory_bytes",
            "Worker memory over the class's recent reports (CUDA free min, peak allocated max, RSS max)",
            ["worker_class", "kind"],
            registry=r,
        )
        self.open_to_freeze = Histogram(
            "bagel_round_open_to_freeze_seconds",
            "Time from a round's open to the freeze of its contributors",
            ["cell"],
            buckets=_FREEZE_BUCKETS,
            registry=r,
        )
        self.standby = Gauge("bagel_standby_workers", "Active workers without a cell", registry=r)
        self.cells_empty = Gauge("bagel_cells_without_members", "Cells no worker is assigned to", registry=r)
        self.rpc_p99 = Gauge(
            "bagel_rpc_latency_p99_seconds", "p99 of the recent RPC handler latencies", ["method"], registry=r
        )
        self.exchanges = Counter(
            "bagel_exchange_reports",
            "Members' exchange outcomes as reported (all-reduce health): ok or failed",
            ["cell", "outcome"],
            registry=r,
        )
        self.exchange_p99 = Gauge(
            "bagel_exchange_p99_seconds", "p99 of members' recent exchange times", ["cell"], registry=r
        )
        self.attempted = Counter(
            "bagel_rounds_attempted", "Round attempts that ended, committed or aborted", ["cell"], registry=r
        )
        self.slo_objective = Gauge(
            "bagel_slo_round_success_objective",
            "[slo] round_success: the fraction of attempts that should commit",
            registry=r,
        )
        self.slo_ratio = Gauge(
            "bagel_slo_round_success_ratio",
            "Committed / attempted over the last [slo] window_rounds",
            ["cell"],
            registry=r,
        )
        self.slo_burn = Gauge(
            "bagel_slo_burn_rate", "Error-budget burn rate: (1 - ratio) / (1 - objective)", ["cell"], registry=r
        )
        self.cost = Counter(
            "bagel_cost", "Spend: members' device-hours x the [cost] price of their class", ["worker_class"], registry=r
        )
        self.cost_per_sample = Gauge(
            "bagel_cost_per_committed_sample",
            "Spend on the cell / samples it committed, since this process started",
            ["cell"],
            registry=r,
        )
        self.heldout = Gauge("bagel_heldout_loss", "Median held-out loss of the committed state", ["cell"], registry=r)
        self.loss_spikes = Gauge(
            "bagel_loss_spikes_total",
            "Attempts the commit guard refused for a held-out loss jump",
            ["cell"],
            registry=r,
        )
        self.committed_samples = Gauge(
            "bagel_committed_samples", "Samples in the cell's committed rounds", ["cell"], registry=r
        )
        self.rollbacks = Gauge(
            "bagel_rollbacks_total",
            "Times the cell fell back to its checkpoint (no live worker held its committed state)",
            ["cell"],
            registry=r,
        )

    def observe_rpc(self, method: str, seconds: float, code: str) -> None:
        child = self._latency_children.get(method)
        if child is None:
            child = self._latency_children[method] = self.rpc_latency.labels(method)
        child.observe(seconds)
        recent = self.recent_rpc.get(method)
        if recent is None:
            recent = self.recent_rpc[method] = collections.deque(maxlen=RECENT_RPCS)
        recent.append(seconds)
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


class RunBook:
    """Derives the run series from round reports and the core's records (the app feeds it).

    Reports count only from a member of the cell's open round with that round number, once
    per (worker, cell, round, reduce attempt); the samples are capped at the member's budget
    and the billed time at the time the round has been open, so a lying worker moves the
    throughput of its own class at most and the spend by no more than it was present.
    """

    def __init__(self, spec: RunSpec, metrics: Metrics, snapshot: Snapshot, started_ms: int) -> None:
        self.spec = spec
        self.m = metrics
        self.started_ms = started_ms
        metrics.info.labels(spec.run.id, spec.spec_hash, version()).set(1)
        metrics.slo_objective.set(spec.slo.round_success)
        self._outcomes: dict[str, collections.deque[bool]] = {}
        self._ended: dict[str, tuple[int, int]] = {}  # cell -> (round, attempt) last counted as ended
        self._frozen: dict[str, tuple[int, int, int]] = {}  # cell -> (round, attempt, reduce_attempt) timed
        self._seen: collections.OrderedDict[tuple[str, str, int, int], None] = collections.OrderedDict()
        self._exchange: dict[str, collections.deque[float]] = {}
        self._rates: dict[tuple[str, str], collections.deque[float]] = {}
        self._memory: dict[str, dict[str, collections.deque[int]]] = {}
        self._spend: dict[str, float] = {}  # cell -> spend since start
        self._samples: dict[str, int] = {}  # cell -> committed samples since start
        self.commits: dict[str, collections.deque[tuple[int, int]]] = {}  # cell -> (committed_ms, samples)
        for rec in snapshot.cells:
            self._cell(rec)
        for c in snapshot.commits:
            self.commits.setdefault(c.cell_id, collections.deque(maxlen=16)).append((c.committed_ms, c.samples))

    # ------------------------------------------------------------------ reports

    def report(
        self, cls: str, num_devices: int, req: Any, rnd: RoundRecord | None, worker_id: str, now_ms: int
    ) -> bool:
        """Account one validated ReportRound of `worker_id` (class `cls`); False if not counted."""
        if rnd is None or rnd.round != req.round:
            return False
        plan = next((p for p in (*rnd.members, *rnd.late) if p.worker_id == worker_id), None)
        if plan is None:
            return False
        key = (worker_id, req.cell_id, req.round, req.reduce_attempt)
        if key in self._seen:
            return False
        self._seen[key] = None
        while len(self._seen) > SEEN_REPORTS:
            self._seen.popitem(last=False)
        m, cell = self.m, req.cell_id
        m.exchanges.labels(cell, "failed" if req.failed else "ok").inc()
        if req.failed:
            return True
        span_s = max(0.0, (now_ms - rnd.opened_ms) / 1000.0)
        phases = [getattr(req, f"{p}_ms") / 1000.0 for p in PHASES]
        for p, sec in zip(PHASES, phases, strict=True):
            m.step_seconds.labels(cell, cls, p).inc(sec)
        samples = min(req.samples, plan.max_samples)
        m.trained_samples.labels(cell, cls).inc(samples)
        train_s = phases[0] + phases[1] + phases[2] or req.compute_ms / 1000.0
        if train_s > 0 and samples > 0:
            rates = self._rates.setdefault((cell, cls), collections.deque(maxlen=RECENT_REPORTS))
            rates.append(samples / train_s)
            m.throughput.labels(cell, cls).set(sum(rates) / len(rates))
        if req.exchange_ms > 0:
            ex = self._exchange.setdefault(cell, collections.deque(maxlen=RECENT_REPORTS))
            ex.append(req.exchange_ms / 1000.0)
        mem = self._memory.setdefault(cls, {k: collections.deque(maxlen=RECENT_REPORTS) for k in MEMORY_KINDS})
        for kind, value in zip(
            MEMORY_KINDS, (req.cuda_free_bytes, req.cuda_peak_allocated_bytes, req.rss_bytes), strict=True
        ):
            if value > 0:
                mem[kind].append(value)
        billed_s = min(sum(phases) or (req.compute_ms + req.comm_ms) / 1000.0, span_s)
        spend = billed_s / 3600.0 * max(1, num_devices) * hourly_price(cls, self.spec.cost)
        m.cost.labels(cls).inc(spend)
        self._spend[cell] = self._spend.get(cell, 0.0) + spend
        self._cost_per_sample(cell)
        return True

    def _cost_per_sample(self, cell: str) -> None:
        n = self._samples.get(cell, 0)
        if n > 0:
            self.m.cost_per_sample.labels(cell).set(self._spend.get(cell, 0.0) / n)

    # ------------------------------------------------------------------ records

    def records(self, effects: Iterable[Record]) -> None:
        for rec in effects:
            if isinstance(rec, RoundRecord):
                self._round(rec)
            elif isinstance(rec, CellRecord):
                self._cell(rec)
            elif isinstance(rec, CommitRecord):
                self._samples[rec.cell_id] = self._samples.get(rec.cell_id, 0) + rec.samples
                self.commits.setdefault(rec.cell_id, collections.deque(maxlen=16)).append(
                    (rec.committed_ms, rec.samples)
                )
                self._cost_per_sample(rec.cell_id)

    def _round(self, r: RoundRecord) -> None:
        m = self.m
        if r.frozen_ms and r.reduce_attempt and r.reduce_attempt == r.first_reduce_attempt:
            key = (r.round, r.attempt, r.reduce_attempt)
            if self._frozen.get(r.cell_id) != key:
                self._frozen[r.cell_id] = key
                m.open_to_freeze.labels(r.cell_id).observe(max(0.0, (r.frozen_ms - r.opened_ms) / 1000.0))
        if r.state.terminal and self._ended.get(r.cell_id) != (r.round, r.attempt):
            self._ended[r.cell_id] = (r.round, r.attempt)
            m.attempted.labels(r.cell_id).inc()
            out = self._outcomes.setdefault(r.cell_id, collections.deque(maxlen=self.spec.slo.window_rounds))
            out.append(r.state is RoundState.COMMITTED)
            ratio = sum(out) / len(out)
            m.slo_ratio.labels(r.cell_id).set(ratio)
            m.slo_burn.labels(r.cell_id).set((1.0 - ratio) / (1.0 - self.spec.slo.round_success))

    def _cell(self, c: CellRecord) -> None:
        m = self.m
        m.committed_samples.labels(c.cell_id).set(c.samples_committed)
        m.loss_spikes.labels(c.cell_id).set(c.guard_refusals)
        m.rollbacks.labels(c.cell_id).set(c.rollbacks)
        if c.heldout_loss >= 0:
            m.heldout.labels(c.cell_id).set(c.heldout_loss)

    # ------------------------------------------------------------------ once a second

    def publish(self, standby: int, cells_without_members: int) -> None:
        m = self.m
        m.standby.set(standby)
        m.cells_empty.set(cells_without_members)
        for method, recent in m.recent_rpc.items():
            m.rpc_p99.labels(method).set(quantile(list(recent), 0.99))
        for cell, ex in self._exchange.items():
            m.exchange_p99.labels(cell).set(quantile(list(ex), 0.99))
        for cls, kinds in self._memory.items():
            free, peak, rss = (kinds[k] for k in MEMORY_KINDS)
            if free:
                m.memory.labels(cls, "cuda_free_min").set(min(free))
            if peak:
                m.memory.labels(cls, "cuda_peak_allocated_max").set(max(peak))
            if rss:
                m.memory.labels(cls, "rss_max").set(max(rss))
