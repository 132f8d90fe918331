"""Coordinator process lifecycle: open the data dir, restore the core, serve, publish, stop.

`start_coordinator(...)` is the in-process API (tests start a real coordinator on port 0
with it); `serve(...)` is the process (`bagel-coordinator serve`): it runs
`start_coordinator` on uvloop, prints `listening: HOST:PORT`, `tls: sha256 <hex>` (or
`tls: off (plaintext)`), `dashboard: URL` (with `--dashboard-listen`) and `join: <string>`
once serving, and waits for SIGTERM/SIGINT
(`bagel.protocol.shutdown.StopSignals`: the first sets an event and arms a watchdog of
`stop_bound_s(grace_s)`, a second exits at once); the daemon then leaves through
`finally: handle.stop()` (torchrun and hivemind's run_dht do the same):

1. health goes NOT_SERVING (load balancers and probes stop sending);
2. held `WatchInstruction` long polls answer at once; the gRPC server stops accepting and
   gives in-flight calls `grace_s` to finish;
3. the tick task and the event log's task stop, the dashboard (if served) closes, the
   store writer drains (every acknowledged change is already durable; this flushes and
   closes SQLite);
4. the DHT record publisher stops and the DHT node (a child process) shuts down;
5. any descendant still running is terminated; exit 0.

The data dir holds: `coordinator.sqlite3` (the store), `coordinator.key` (Ed25519, mode
0600, created on first start), `tls.crt` and `tls.key` (the self-signed TLS certificate,
key mode 0600, created on the first start that serves TLS without `--tls-cert`, then
reused so its fingerprint stays stable; see `bagel.protocol.tls`), `dht.key` (the DHT
node's libp2p key, created on the first start with a DHT: its peer id, and with a fixed
DHT port the whole join string, stays the same across restarts; see
`bagel.protocol.dhtaddress`), `checkpoints/`, `datashards/` (the data shards served to
workers without the dataset, built on demand), and `coordinator.lock`, an advisory lock so
two daemons never share a data dir. A data dir bound to another run spec is refused.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import gc
import logging
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from bagel.coordinator import sizing
from bagel.coordinator.app import CoordinatorApp
from bagel.coordinator.checkpoints import CheckpointStore, Schema
from bagel.coordinator.core.records import CellConfig
from bagel.coordinator.core.state import CoordinatorState
from bagel.coordinator.dashboard import start_dashboard
from bagel.coordinator.datashards import DataShardStore
from bagel.coordinator.eventfeed import DEFAULT_HEALTH_PERIOD_S, log_loop
from bagel.coordinator.interceptor import SERVICE_NAME, ErrorInterceptor
from bagel.coordinator.metrics import Metrics
from bagel.coordinator.servicer import CoordinatorServicer
from bagel.coordinator.store import STARTED_KEY, Store, StoreError
from bagel.coordinator.writer import AsyncWriter
from bagel.models import initfrom
from bagel.models.experts import cell_state_schema
from bagel.models.export import cell_metadata
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol import bagel_pb2_grpc as pb_grpc
from bagel.protocol.dhtaddress import (
    DHT_KEY_FILE,
    host_of,
    join_peers,
    load_or_create_identity,
    loopback_only,
    node_id_for,
    port_of,
)
from bagel.protocol.envelope import wall_clock_ms
from bagel.protocol.grpc_options import server_options
from bagel.protocol.identity import Identity
from bagel.protocol.runspec import RunSpec
from bagel.protocol.shutdown import StopSignals, descendants, end_descendants
from bagel.protocol.tls import ServerCertificate, TLSError, load_or_create_self_signed, load_server_certificate

log = logging.getLogger(__name__)

KEY_FILE = "coordinator.key"
LOCK_FILE = "coordinator.lock"
CELL_CONFIGS_KEY = "cell_configs"
DEFAULT_TICK_MS = 250
DEFAULT_GRACE_S = 5.0
DEFAULT_DHT_LISTEN = "/ip4/127.0.0.1/tcp/0"
LOOPBACK_WARNING = (
    "the join string names only loopback addresses: workers on other machines cannot join "
    "(serve with --listen 0.0.0.0:7070, or --announce /ip4/PUBLIC_IP/tcp/7071)"
)
# A stop on SIGTERM/SIGINT takes at most --grace-s for in-flight calls plus this much for the
# rest (the writer's drain, the DHT child's shutdown, which hivemind bounds by 3 s); past
# that the process exits anyway (`bagel.protocol.shutdown`).
STOP_MARGIN_S = 10.0


def stop_bound_s(grace_s: float) -> float:
    """The documented bound of a graceful stop: `grace_s` plus `STOP_MARGIN_S`."""
    return grace_s + STOP_MARGIN_S


class DataDirLocked(StoreError):
    """Another coordinator process holds this data dir."""


def _lock_data_dir(data_dir: Path) -> int:
    fd = os.open(data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DataDirLocked(f"another coordinator is running on {data_dir} (it holds {LOCK_FILE})") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    from bagel.protocol.shutdown import close_in_children

    close_in_children(fd)  # a forked DHT child must not keep the lock
    return fd


def _unlock_data_dir(fd: int) -> None:
    from bagel.protocol.shutdown import keep_in_children

    keep_in_children(fd)
    os.close(fd)  # releases the flock


def _advertised(listen: str, port: int, advertise: str | None, dht_peers: Sequence[str] = ()) -> str:
    """The gRPC endpoint the DHT record names: `advertise`, else the listen host; for a
    wildcard listen, the host of the join string's first own peer (an announced or routable
    address, so the record and the join string agree), else the host name's address."""
    if advertise:
        return advertise
    host = listen.rsplit(":", 1)[0].strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = host_of(dht_peers[0]) if dht_peers else ""
        host = host or socket.gethostbyname(socket.gethostname())
    return f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"


def load_cell_configs(spec: RunSpec, store: Store) -> list[CellConfig]:
    """Cell configs bound to the run: computed on the first start, then read from the store."""
    stored = store.get_kv(CELL_CONFIGS_KEY)
    if stored is not None:
        return sizing.configs_from_json(spec, stored)
    configs = sizing.cell_configs(spec)
    store.put_kv(CELL_CONFIGS_KEY, sizing.configs_to_json(configs))
    return configs


@dataclass
class CoordinatorHandle:
    """A running coordinator (in this process)."""

    spec: RunSpec
    data_dir: Path
    port: int
    endpoint: str
    identity: Identity
    app: CoordinatorApp
    store: Store
    server: grpc.aio.Server
    health: Any
    metrics: Metrics
    metrics_port: int | None = None
    tls_fingerprint: str = ""  # sha256 of the served certificate; "" = plaintext
    dht: Any = None
    join: str | None = None
    join_peers: tuple[str, ...] = ()  # the join string's DHT peers
    publisher: Any = None
    own_dht: bool = False
    dashboard: Any = None  # the DashboardServer, with `--dashboard-listen`
    datashards: DataShardStore | None = None  # the data shards served to workers without the dataset
    _tick_task: asyncio.Task[None] | None = None
    _story_task: asyncio.Task[None] | None = None
    _lock_fd: int | None = None
    _stopped: bool = False
    fatal: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def state(self) -> CoordinatorState:
        return self.app.state

    async def stop(self, grace_s: float = DEFAULT_GRACE_S) -> None:
        """Graceful shutdown (see the module docstring); idempotent."""
        if self._stopped:
            return
        self._stopped = True
        try:
            await self.health.enter_graceful_shutdown()
            self.app.watchers.close()  # held long polls answer now, not at the grace's end
            await self.server.stop(grace_s)
        finally:
            self.app.accepting = False
            tasks = [t for t in (self._tick_task, self._story_task) if t is not None]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.dashboard is not None:
                await self.dashboard.stop()
            try:
                await self.app.writer.close()
            finally:
                self.store.close()
                if self.publisher is not None:
                    await self.publisher.stop()
                if self.dht is not None and self.own_dht:
                    await asyncio.to_thread(self.dht.shutdown)
                self.metrics.stop()
                if self._lock_fd is not None:
                    _unlock_data_dir(self._lock_fd)


async def start_coordinator(
    spec: RunSpec,
    data_dir: str | Path,
    *,
    listen: str = "127.0.0.1:0",
    dht: Any = None,
    dht_listen: str = DEFAULT_DHT_LISTEN,
    announce: Sequence[str] = (),
    initial_peers: Sequence[str] = (),
    advertise: str | None = None,
    metrics_listen: str | None = None,
    tick_ms: int = DEFAULT_TICK_MS,
    cells: Sequence[CellConfig] | None = None,
    clock: Callable[[], int] = wall_clock_ms,
    tls: bool = False,
    tls_cert: str | Path | None = None,
    tls_key: str | Path | None = None,
    checkpoint_schema: Callable[[str], Schema] | None = None,
    max_workers: int | None = None,
    dashboard_listen: str | None = None,
    dashboard_public: bool = False,
    health_log_s: float = DEFAULT_HEALTH_PERIOD_S,
) -> CoordinatorHandle:
    """Start a coordinator in this event loop.

    dht: None = no DHT (tests that only need gRPC), True = start a hivemind DHT node on
    `dht_listen` bootstrapped from `initial_peers` (owned: shut down by `stop`), or an
    existing `hivemind.DHT` (not owned). With a DHT, the signed coordinator record is
    published and refreshed, and `handle.join` is the join string. An owned node's peer id
    is the data dir's `dht.key` (created on the first start) and it announces `announce`
    (public multiaddrs with explicit ports) if given, so with a fixed port the join string
    is byte-identical across restarts (`bagel.protocol.dhtaddress`).
    cells: CellConfigs to use instead of the stored/computed ones (tests; first start only).
    tls: serve gRPC over TLS with `tls_cert`/`tls_key` (PEM files), or without them with
    the data dir's self-signed certificate (generated on the first start, then reused);
    the fingerprint goes into the DHT record and the join string. Off by default here (the
    in-process API the tests use); `bagel-coordinator serve` turns it on unless `--insecure`.
    Our own DHT node validates the coordinator record (`CoordinatorRecordValidator`).
    checkpoint_schema: the tensors a cell's checkpoint must hold; None = the cell's model as
    the run spec builds it (`cell_state_schema`). Tests whose simulated workers train a
    stand-in state pass that state's schema.
    max_workers: refuse a Register (RESOURCE_EXHAUSTED) once this many workers are active.
    dashboard_listen: serve the live dashboard there (`bagel.coordinator.dashboard`; loopback
    only unless `dashboard_public`). health_log_s: the period of the one-line health summary
    in the log (`bagel.coordinator.eventfeed`); 0 = none (the per-minute commit summary stays).
    """
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    lock_fd = _lock_data_dir(data_dir)
    store: Store | None = None
    server: grpc.aio.Server | None = None
    handle: CoordinatorHandle | None = None
    own_dht = None
    try:
        if (tls_cert is None) != (tls_key is None):
            raise TLSError("give both a TLS certificate and its key, or neither")
        if spec.model.init_from:  # a checkpoint that does not fit is refused before anything starts
            started = await asyncio.to_thread(initfrom.check, spec)
            log.info("model.init_from %s starts cells %s", spec.init_path or spec.model.init_from, started)
        certificate: ServerCertificate | None = None
        if tls_cert is not None and tls_key is not None:
            certificate = load_server_certificate(Path(tls_cert), Path(tls_key))
        elif tls:
            certificate = load_or_create_self_signed(data_dir)
        identity = Identity.load_or_create(data_dir / KEY_FILE)
        if dht is True:
            # before any gRPC server thread exists: hivemind forks its DHT process
            from bagel.protocol.discovery import CoordinatorRecordValidator, start_dht, start_relay_dht
            from bagel.protocol.relay import RelayPlan, host_ip, install_p2pd_args, is_loopback

            # the coordinator's DHT node is a circuit relay for volunteers behind NATs; one that
            # listens on loopback only serves this host, where nobody needs a relay
            install_p2pd_args()
            listen_ip = host_ip(dht_listen)
            own_dht = dht = await asyncio.to_thread(
                start_dht if listen_ip is not None and is_loopback(listen_ip) else start_relay_dht,
                host_maddrs=[dht_listen],
                initial_peers=list(initial_peers),
                record_validators=[CoordinatorRecordValidator(spec.run.id, identity.public_key)],
                **_stable_dht_kwargs(data_dir, announce),
                **RelayPlan(serve=True).dht_kwargs(),
            )
        store = Store.open(data_dir)
        now = clock()
        store.bind_spec(spec.run.id, spec.spec_hash, spec.source, now)
        store.put_kv(STARTED_KEY, now)  # `status --data-dir` shows the uptime since this start
        if cells is not None and store.get_kv(CELL_CONFIGS_KEY) is None:
            store.put_kv(CELL_CONFIGS_KEY, sizing.configs_to_json(cells))
        configs = await asyncio.to_thread(load_cell_configs, spec, store)
        snap = store.load()
        if snap.workers or snap.cells:
            state = CoordinatorState.restore(
                spec,
                configs,
                workers=snap.workers,
                cell_records=snap.cells,
                rounds=snap.rounds,
                commits=snap.commits,
                now_ms=now,
                max_workers=max_workers,
            )
            log.info(
                "restored %d workers, %d cells, %d open rounds", len(snap.workers), len(snap.cells), len(snap.rounds)
            )
        else:
            state = CoordinatorState(spec, configs, now_ms=now, max_workers=max_workers)
            first = state.snapshot()
            store.write([*first.cells, *first.workers, *first.rounds, *first.commits], now)
        checkpoints = CheckpointStore(
            data_dir / "checkpoints",
            store,
            keep=spec.checkpoint.keep,
            max_bytes=spec.checkpoint.max_bytes,
            schema=checkpoint_schema or functools.lru_cache(maxsize=None)(functools.partial(cell_state_schema, spec)),
            # stored checkpoints carry their model config (not for the tests' stand-in tensors)
            describe=functools.partial(cell_metadata, spec) if checkpoint_schema is None else None,
        )
        metrics = Metrics()
        metrics_port = None
        if metrics_listen:
            host, _, port_s = metrics_listen.rpartition(":")
            metrics_port = metrics.serve(host or "127.0.0.1", int(port_s))
        writer = AsyncWriter(store)
        fatal = asyncio.Event()
        app = CoordinatorApp(spec, state, writer, checkpoints, metrics, clock=clock, on_fatal=lambda e: fatal.set())

        app.started_ms = now  # the same start time GetStatus and the store's STARTED_KEY give
        app.status_keys.add(identity.public_key)  # `bagel-coordinator status --target --key DIR/coordinator.key`
        interceptor = ErrorInterceptor(metrics, limit_peer=app.admission.limit_peer)
        server = grpc.aio.server(interceptors=[interceptor], options=server_options())
        datashards = DataShardStore(data_dir / "datashards", spec)
        pb_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(app, datashards=datashards), server)
        health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        reflection.enable_server_reflection(
            [
                pb.DESCRIPTOR.services_by_name["Coordinator"].full_name,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ],
            server,
        )
        if certificate is None:
            port = server.add_insecure_port(listen)
        else:
            port = server.add_secure_port(listen, certificate.server_credentials())
        if port == 0:
            raise OSError(f"cannot listen on {listen}")
        await server.start()
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        peers: tuple[str, ...] = ()
        if dht is not None and dht is not False:
            peers = join_peers(
                str(dht.peer_id.to_base58()),
                [str(m) for m in dht.get_visible_maddrs()],
                announce=announce,
                listen_port=port_of(dht_listen) if own_dht is not None else 0,
                extra=[str(p) for p in initial_peers],
            )
        endpoint = _advertised(listen, port, advertise, peers[:1] if own_dht is not None else ())
        handle = CoordinatorHandle(
            spec=spec,
            data_dir=data_dir,
            port=port,
            endpoint=endpoint,
            identity=identity,
            app=app,
            store=store,
            server=server,
            health=health,
            metrics=metrics,
            metrics_port=metrics_port,
            tls_fingerprint="" if certificate is None else certificate.fingerprint,
            join_peers=peers,
            _lock_fd=lock_fd,
            fatal=fatal,
            datashards=datashards,
        )
        handle._tick_task = asyncio.create_task(app.tick_loop(tick_ms), name="bagel-coordinator-tick")
        handle._story_task = asyncio.create_task(
            log_loop(app.feed, app.tally.counts, clock, health_period_s=health_log_s or None),
            name="bagel-coordinator-story",
        )
        if dashboard_listen:
            handle.dashboard = start_dashboard(app, dashboard_listen, public=dashboard_public, clock=clock)
        if dht is not None and dht is not False:
            handle.dht, handle.own_dht = dht, own_dht is not None
            await _publish(handle)
        return handle
    except BaseException:
        if handle is not None:
            await handle.stop(0)
        else:
            if server is not None:
                await server.stop(0)
            if store is not None:
                store.close()
            if own_dht is not None:
                await asyncio.to_thread(own_dht.shutdown)
            _unlock_data_dir(lock_fd)
        raise


def _stable_dht_kwargs(data_dir: Path, announce: Sequence[str]) -> dict[str, Any]:
    """hivemind.DHT arguments that keep the node's address across restarts: the data dir's
    libp2p key, the routing id derived from it, the announced multiaddrs."""
    key = data_dir / DHT_KEY_FILE
    peer_id = load_or_create_identity(key)
    # hivemind's check that no other peer uses the identity (with initial peers) starts a
    # second p2p daemon on every start; the data dir's lock already keeps it to one daemon
    kwargs: dict[str, Any] = {
        "identity_path": str(key),
        "check_if_identity_free": False,
        "node_id": node_id_for(peer_id),
    }
    if announce:
        kwargs["announce_maddrs"] = list(announce)
    return kwargs


async def _publish(handle: CoordinatorHandle) -> None:
    """Publish the signed coordinator record (refreshed in the background); set the join string
    (its peers, `handle.join_peers`, in a fixed order: `dhtaddress.join_peers`)."""
    from bagel.protocol.discovery import CoordinatorPublisher
    from bagel.protocol.joinstring import make_join_string

    spec = handle.spec
    handle.publisher = CoordinatorPublisher(
        handle.dht,
        handle.identity,
        run_id=spec.run.id,
        endpoint=handle.endpoint,
        spec_hash=spec.spec_hash,
        tls_sha256=handle.tls_fingerprint,
    )
    await handle.publisher.start()
    handle.join = make_join_string(spec.run.id, handle.identity.public_key, handle.join_peers, handle.tls_fingerprint)


# ---------------------------------------------------------------------------- process

# Full (generation-2) collections, at most this often: see `_tame_gc`.
FULL_GC_PERIOD_S = 600.0
# Automatic full collections effectively off: CPython 3.11 runs one after this many
# generation-1 passes (and only once the old generation grew by a quarter).
_NO_AUTOMATIC_FULL_GC = 1 << 30


def _tame_gc() -> None:
    """Keep the cyclic collector from pausing the event loop for long (the daemon only).

    A full collection walks every tracked object outside the frozen set, holding the GIL:
    nothing else runs meanwhile. Two steps keep that off the request path:

    1. Everything alive after start-up (modules, torch, the restored state) moves out of
       the collector's reach for good (CPython's gc.freeze, made for this by Instagram):
       full collections over it paused the loop for up to 135 ms.
    2. The fleet registers after start-up, so its state (about 4 tracked objects per
       worker) is not frozen, and CPython runs a full collection whenever the old
       generation grew by a quarter: at 2,000 heartbeats/s that was every ~40 s, each
       pass 45-50 ms of CPU over ~60k objects at 10k workers (measured with gc.callbacks
       under bench/coordinator_load.py), the largest stall on the loop by far. Every
       request in flight waits it out, and with the loop ~2/3 busy the queue it leaves
       takes about as long again to drain: one pass in a 30 s window is enough to push
       a few hundred heartbeats past tens of ms. So automatic full collections are off,
       and `_full_gc_every` runs one every FULL_GC_PERIOD_S instead (~40 ms at 10k
       workers, ~41k objects).

    Young collections (generations 0 and 1) still run as usual: they reclaim the
    per-request reference cycles (gRPC calls, tasks) within milliseconds. What escapes to
    the old generation and dies there waits for the next periodic pass (a few MB at most
    at 10k workers), rather than being frozen forever; gc.freeze is not repeated for the
    same reason (it would keep in-flight requests' cycles alive for good).
    """
    gc.collect()
    gc.freeze()
    threshold0, threshold1, _ = gc.get_threshold()
    gc.set_threshold(threshold0, threshold1, _NO_AUTOMATIC_FULL_GC)


async def _full_gc_every(period_s: float) -> None:
    while True:
        await asyncio.sleep(period_s)
        gc.collect()


async def _serve(
    spec: RunSpec,
    data_dir: Path,
    *,
    grace_s: float,
    out: Callable[[str], None],
    on_serving: Callable[[], None] = lambda: None,
    **kwargs: Any,
) -> int:
    stop = asyncio.Event()
    signals = StopSignals("bagel-coordinator", lambda _name: stop.set(), stop_bound_s(grace_s))
    signals.install()
    handle: CoordinatorHandle | None = None
    full_gc: asyncio.Task[None] | None = None
    stop_gc_watch: Callable[[], None] | None = None
    try:
        handle = await start_coordinator(spec, data_dir, **kwargs)
        on_serving()
        _tame_gc()
        stop_gc_watch = handle.metrics.watch_gc()
        full_gc = asyncio.create_task(_full_gc_every(FULL_GC_PERIOD_S), name="bagel-coordinator-full-gc")
        out(f"listening: {handle.endpoint}")
        out(f"tls: sha256 {handle.tls_fingerprint}" if handle.tls_fingerprint else "tls: off (plaintext)")
        if handle.metrics_port is not None:
            host = kwargs.get("metrics_listen", "").rpartition(":")[0] or "127.0.0.1"
            out(f"metrics: http://{host}:{handle.metrics_port}/metrics")
        if handle.dashboard is not None:
            out(f"dashboard: {handle.dashboard.url}")
        if handle.join is not None:
            out(f"join: {handle.join}")
            if loopback_only(handle.join_peers):
                log.warning(LOOPBACK_WARNING)
        waiters = [asyncio.create_task(stop.wait()), asyncio.create_task(handle.fatal.wait())]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for w in waiters:
            w.cancel()
        if handle.fatal.is_set():
            log.critical("stopping after a fatal error: %s", handle.app.fatal)
            return 1
        log.info("signal received: draining and shutting down")
        return 0
    finally:
        if full_gc is not None:
            full_gc.cancel()
        if stop_gc_watch is not None:
            stop_gc_watch()
        if handle is not None:
            await handle.stop(grace_s)
        signals.remove()


def serve(spec: RunSpec, data_dir: str | Path, *, grace_s: float = DEFAULT_GRACE_S, **kwargs: Any) -> int:
    """Run the daemon until SIGTERM/SIGINT; returns the exit status (0 on a clean stop).

    `on_serving()` (a keyword argument) is called once the daemon serves: a caller that
    removes a data dir it created when the start fails must not remove one that served."""
    import uvloop

    def out(line: str) -> None:
        print(line, flush=True)

    already = set(descendants())  # the caller's own children (serve called in-process) are not ours
    try:
        return uvloop.run(_serve(spec, Path(data_dir), grace_s=grace_s, out=out, **kwargs))
    finally:
        end_descendants(spare=already)  # no child of the daemon outlives it


__all__ = ["CoordinatorHandle", "DataDirLocked", "serve", "start_coordinator"]
