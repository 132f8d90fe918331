"""`bagel-coordinator`: run the coordinator daemon, or inspect a run's state.

    bagel-coordinator serve --run SPEC.toml --data-dir DIR [--listen HOST:PORT]
        [--dht-listen MULTIADDR] [--announce MULTIADDR ...] [--initial-peers MULTIADDR ...] [--metrics-listen HOST:PORT]
        [--tick-ms N] [--grace-s S] [--advertise-endpoint HOST:PORT] [--no-dht] [--max-workers N]
        [--tls-cert FILE --tls-key FILE | --insecure]
        [--dashboard-listen HOST:PORT [--dashboard-public]] [--health-log-s S]
    bagel-coordinator status --data-dir DIR [--json]
    bagel-coordinator status --target HOST:PORT (--tls-fingerprint HEX | --insecure) [--key FILE] [--json]
    bagel-coordinator token keygen --data-dir DIR
    bagel-coordinator token create --data-dir DIR --expires-s S --uses N --name NAME [--operator-key FILE]
    bagel-coordinator token list --data-dir DIR [--json]
    bagel-coordinator token revoke --data-dir DIR NAME|ID
    bagel-coordinator sample --data-dir DIR --out DIR [--n N] [--classes 0,3,7] [--steps S] [--guidance W]
        [--seed S] [--routing top1|sample|mixture|prior] [--allow-partial]
    bagel-coordinator export --data-dir DIR --out DIR --format safetensors|diffusers

`serve` speaks gRPC over TLS by default: with the operator's `--tls-cert/--tls-key`, or
else a self-signed certificate generated into the data dir on the first start and reused
afterwards. It prints the fingerprint (`tls: sha256 HEX`), which the DHT record and the
join string carry, so workers pin it; `--insecure` serves plaintext (loopback tests,
benchmarks, a TLS-terminating proxy in front).

Ports: gRPC on `--listen` (default 127.0.0.1:7070) and the DHT on the same host at the
gRPC port + 1 (7071) unless `--dht-listen` says otherwise. The DHT's peer id lives in
`DIR/dht.key`, so with fixed ports the printed join string is byte-identical across
restarts on the same data dir and flags. `--announce` (repeatable) names the public
multiaddrs the join string carries instead of the listen addresses (behind a port forward,
a DNS name); `serve` warns when the join string names only loopback addresses.

`status` reads the SQLite store read-only, so it works while the daemon runs (WAL readers
never block the writer); `--target` asks a live daemon over gRPC (GetStatus) instead,
which also shows volatile fields (phases, leases). GetStatus is cached and rate-limited,
and it lists workers only for a signed request: `--key DIR/coordinator.key` (the
daemon's own key) or the operator's key; without `--key` it shows the aggregate view
(cells and worker counts).

`token` manages the join tokens of a permissioned run (`security.mode = "permissioned"`).
The operator's private key lives in `DIR/operator.key` (0600; `token keygen` creates it
and prints the public key to put in the spec's `security.operator_public_key`), or in
the file `--operator-key` names (keep it off the coordinator host if you can: only
`token create` needs it). `create` prints the token, and nothing else, on stdout; the
token's uses, its binding to the first worker key that uses it and its revocation live in
the data dir's SQLite store, and all three commands work while the daemon runs (a
revocation takes effect on the next Register at once, and removes a worker that joined
with the token within a second).

Before it writes anything, `serve` checks every flag (HOST:PORT with an explicit port,
multiaddrs, directories, free ports), the spec and everything it names
(`bagel.coordinator.preflight`: codec, data, models, checkpoint.max_bytes, sizing) and an
existing data dir's key and store, read-only; a refused serve leaves no data dir behind
and an existing one unchanged. SIGTERM/SIGINT, to the process or its group, stop it within
`--grace-s` + 10 s; a second one exits at once (`bagel.protocol.shutdown`).

Every failure is one line on stderr (`bagel.protocol.clierrors`). Exit codes: 0 clean stop,
1 a runtime failure (a port in use, a damaged store or key, the store failing while
serving, a stop past its bound), 2 bad usage (a flag, the spec, a path, a data dir of
another run or locked by another daemon), 128 + N a second signal N.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from bagel.protocol.clierrors import (
    EXIT_OK,
    EXIT_RUNTIME,
    EXIT_USAGE,
    OneLineParser,
    RuntimeFailure,
    UsageError,
    check_dir_arg,
    check_host_port,
    check_multiaddr,
    check_port_free,
    guarded,
    version_text,
)

EXIT_FAILED = EXIT_RUNTIME


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="bagel-coordinator", description="Bagel run coordinator.")
    p.add_argument("--version", action="version", version=version_text("bagel-coordinator"))
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the coordinator daemon until SIGTERM/SIGINT")
    s.add_argument(
        "--run", required=True, type=Path, metavar="SPEC.toml", help="run spec (TOML); immutable once the run starts"
    )
    s.add_argument(
        "--data-dir",
        required=True,
        type=Path,
        metavar="DIR",
        help="state directory: SQLite store, coordinator key (0600), checkpoints",
    )
    s.add_argument(
        "--listen",
        default="127.0.0.1:7070",
        metavar="HOST:PORT",
        help="gRPC listen address (port 0 picks a free port; printed as 'listening: HOST:PORT'); default %(default)s",
    )
    s.add_argument(
        "--advertise-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="gRPC endpoint published in the DHT record (default: the listen address)",
    )
    s.add_argument(
        "--dht-listen",
        default=None,
        metavar="MULTIADDR",
        help="hivemind DHT listen multiaddr; default: the --listen host, gRPC port + 1 (/ip4/127.0.0.1/tcp/7071)",
    )
    s.add_argument(
        "--announce",
        action="append",
        default=[],
        metavar="MULTIADDR",
        help="public multiaddr of the DHT node (e.g. /ip4/203.0.113.7/tcp/7071), put in the join string "
        "instead of the listen addresses; repeatable",
    )
    s.add_argument(
        "--initial-peers",
        nargs="*",
        default=[],
        metavar="MULTIADDR",
        help="DHT peers to bootstrap from (multiaddrs with /p2p/<id>); none = a new DHT",
    )
    s.add_argument(
        "--no-dht",
        action="store_true",
        help="do not run a DHT node (no join string; workers need the gRPC endpoint directly)",
    )
    s.add_argument(
        "--tls-cert",
        type=Path,
        default=None,
        metavar="FILE",
        help="PEM certificate chain (leaf first) for gRPC over TLS; default: a self-signed one in the data dir",
    )
    s.add_argument("--tls-key", type=Path, default=None, metavar="FILE", help="PEM private key of --tls-cert")
    s.add_argument(
        "--insecure",
        action="store_true",
        help="serve gRPC in plaintext (no TLS; the join string then pins no certificate)",
    )
    s.add_argument(
        "--metrics-listen",
        default=None,
        metavar="HOST:PORT",
        help="Prometheus metrics HTTP address (default: disabled)",
    )
    s.add_argument(
        "--tick-ms",
        type=int,
        default=250,
        metavar="N",
        help="period of the lease/deadline tick in milliseconds; default %(default)s",
    )
    s.add_argument(
        "--grace-s",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds in-flight calls get to finish on SIGTERM/SIGINT; default %(default)s",
    )
    s.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level (stderr); default %(default)s",
    )

    s.add_argument(
        "--max-workers",
        type=int,
        default=None,
        metavar="N",
        help="refuse registrations (RESOURCE_EXHAUSTED) while N workers are active (default: no limit)",
    )
    s.add_argument(
        "--dashboard-listen",
        default=None,
        metavar="HOST:PORT",
        help="serve the live dashboard there (printed as 'dashboard: URL'; loopback only; default: off)",
    )
    s.add_argument(
        "--dashboard-public",
        action="store_true",
        help="allow a non-loopback --dashboard-listen (it has no authentication and lists every worker)",
    )
    s.add_argument(
        "--health-log-s",
        type=float,
        default=30.0,
        metavar="S",
        help="log a one-line health summary every S seconds (0: never); default %(default)s",
    )

    st = sub.add_parser("status", help="show workers, cells and rounds of a run")
    st.add_argument("--data-dir", type=Path, metavar="DIR", help="read the daemon's store (read-only)")
    st.add_argument("--target", default=None, metavar="HOST:PORT", help="ask a live daemon over gRPC instead")
    st.add_argument(
        "--tls-fingerprint",
        default=None,
        metavar="HEX",
        help="with --target: the sha256 of the daemon's TLS certificate (its 'tls: sha256 HEX' line), pinned",
    )
    st.add_argument("--insecure", action="store_true", help="with --target: the daemon serves plaintext (--insecure)")
    st.add_argument("--json", action="store_true", help="print JSON (for scripts) instead of tables")
    st.add_argument("--rounds", type=int, default=10, metavar="N", help="recent rounds to show; default %(default)s")
    st.add_argument(
        "--key",
        type=Path,
        default=None,
        metavar="FILE",
        help="with --target: sign with this key (DIR/coordinator.key or the operator's) to see every worker",
    )

    tk = sub.add_parser("token", help="join tokens of a permissioned run")
    tsub = tk.add_subparsers(dest="token_command", required=True)
    kg = tsub.add_parser("keygen", help="create DIR/operator.key and print its public key (base64)")
    kg.add_argument("--data-dir", required=True, type=Path, metavar="DIR")
    tc = tsub.add_parser("create", help="issue a token; prints it (and nothing else) on stdout")
    tc.add_argument("--data-dir", required=True, type=Path, metavar="DIR")
    tc.add_argument("--expires-s", required=True, type=float, metavar="S", help="valid for S seconds from now")
    tc.add_argument("--uses", required=True, type=int, metavar="N", help="registrations it admits")
    tc.add_argument("--name", required=True, metavar="NAME", help="a unique name (list, revoke)")
    tc.add_argument(
        "--operator-key",
        type=Path,
        default=None,
        metavar="FILE",
        help="operator private key (default: DIR/operator.key)",
    )
    tl = tsub.add_parser("list", help="name, id, expiry, uses left, bound key, revoked")
    tl.add_argument("--data-dir", required=True, type=Path, metavar="DIR")
    tl.add_argument("--json", action="store_true", help="print JSON instead of a table")
    tr = tsub.add_parser("revoke", help="revoke a token by name or id (takes effect on a running daemon)")
    tr.add_argument("--data-dir", required=True, type=Path, metavar="DIR")
    tr.add_argument("token", metavar="NAME|ID")

    from bagel.coordinator import export

    export.add_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return guarded("error: ", lambda: _cmd_serve(args))
    if args.command == "token":
        return guarded("error: ", lambda: _cmd_token(args))
    if args.command in ("sample", "export"):
        from bagel.coordinator import export

        cmd = export.cmd_sample if args.command == "sample" else export.cmd_export
        return guarded("error: ", lambda: cmd(args))
    return guarded("error: ", lambda: _cmd_status(args))


# ---------------------------------------------------------------------------- serve


def _cmd_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from bagel.coordinator.daemon import serve
    from bagel.coordinator.dashboard import DashboardAddressError, parse_listen
    from bagel.protocol.runspec import SpecError, load_spec

    if args.tick_ms < 10:
        raise UsageError("--tick-ms must be at least 10")
    if args.max_workers is not None and args.max_workers < 1:
        raise UsageError("--max-workers must be at least 1")
    if not args.grace_s >= 0:
        raise UsageError("--grace-s must be >= 0")
    if (args.tls_cert is None) != (args.tls_key is None):
        raise UsageError("give both --tls-cert and --tls-key, or neither")
    if not args.health_log_s >= 0:
        raise UsageError("--health-log-s must be 0 (off) or a positive number of seconds")
    if args.dashboard_listen is not None:
        try:
            parse_listen(args.dashboard_listen, public=args.dashboard_public)
        except DashboardAddressError as e:
            raise UsageError(str(e)) from None
    if args.insecure and args.tls_cert is not None:
        raise UsageError("--insecure contradicts --tls-cert/--tls-key")
    listen_host, listen_port = check_host_port("--listen", args.listen)
    metrics = check_host_port("--metrics-listen", args.metrics_listen) if args.metrics_listen else None
    if args.advertise_endpoint:
        check_host_port("--advertise-endpoint", args.advertise_endpoint)
    if not args.no_dht:
        if args.dht_listen:
            check_multiaddr("--dht-listen", args.dht_listen)
        for peer in args.initial_peers:
            check_multiaddr("--initial-peers", peer)
    check_dir_arg("--data-dir", args.data_dir)
    try:
        spec = load_spec(args.run)
    except (OSError, SpecError) as e:
        raise UsageError(f"run spec {args.run}: {e}") from None
    from bagel.protocol.dhtaddress import AddressError, check_announce, check_listen, dht_listen_for

    try:
        dht_listen = check_listen(args.dht_listen) if args.dht_listen else dht_listen_for(args.listen)
        announce = check_announce(args.announce)
    except AddressError as e:
        raise UsageError(str(e)) from None
    from bagel.coordinator.preflight import check_data_dir, check_spec

    check_spec(spec)  # before anything is written: a refused serve leaves no data dir
    if args.data_dir.is_dir():
        check_data_dir(spec, args.data_dir)  # read-only: a damaged or foreign data dir is left as it is
    check_port_free("--listen", listen_host, listen_port)
    if metrics is not None:
        check_port_free("--metrics-listen", *metrics)
    fresh = not args.data_dir.exists()
    serving: list[bool] = []  # set once the daemon serves: from then on its data dir holds the run
    try:
        return serve(
            spec,
            args.data_dir,
            grace_s=args.grace_s,
            listen=args.listen,
            advertise=args.advertise_endpoint,
            dht=None if args.no_dht else True,
            dht_listen=dht_listen,
            announce=announce,
            initial_peers=list(args.initial_peers),
            metrics_listen=args.metrics_listen,
            tick_ms=args.tick_ms,
            tls=not args.insecure,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            max_workers=args.max_workers,
            dashboard_listen=args.dashboard_listen,
            dashboard_public=args.dashboard_public,
            health_log_s=args.health_log_s,
            on_serving=lambda: serving.append(True),
        )
    except BaseException as e:
        if fresh and not serving and args.data_dir.is_dir():  # refused while starting: leave no data dir behind
            import shutil

            shutil.rmtree(args.data_dir, ignore_errors=True)
        raise _serve_failure(e, args.data_dir) from e


def _serve_failure(e: BaseException, data_dir: Path) -> BaseException:
    """The one-line error for a serve that failed to start (or the exception as it is)."""
    import sqlite3

    from bagel.coordinator.dashboard import DashboardAddressError
    from bagel.coordinator.store import StoreError
    from bagel.models.initfrom import InitFromError
    from bagel.protocol.dhtaddress import AddressError
    from bagel.protocol.discovery import DiscoveryError, RelayLimitError
    from bagel.protocol.identity import IdentityError, KeyFilePermissionError
    from bagel.protocol.tls import TLSError

    if isinstance(e, StoreError | TLSError | InitFromError | AddressError | DashboardAddressError):
        # another spec in the data dir, locked; an unusable certificate; init_from weights that do
        # not fit a cell (naming the tensor); a corrupt dht.key; the dashboard's port taken
        return UsageError(str(e))
    if isinstance(e, KeyFilePermissionError):
        return RuntimeFailure(str(e))
    if isinstance(e, IdentityError):
        return RuntimeFailure(
            f"{e}; restore {data_dir}/coordinator.key from a backup (a new key changes the join string "
            "and orphans the run's workers)"
        )
    if isinstance(e, sqlite3.DatabaseError):
        return RuntimeFailure(
            f"the store {data_dir}/coordinator.sqlite3 is damaged ({e}): restore the data dir from a backup, "
            "or start the run again in an empty data dir"
        )
    if isinstance(e, RelayLimitError):  # decided at each start of its p2p daemon (`bagel.protocol.relay`)
        return RuntimeFailure(f"the DHT node did not start: {e}; start serve again")
    if isinstance(e, DiscoveryError):
        return RuntimeFailure(f"the DHT node did not start: {e}; check --dht-listen and --initial-peers")
    if isinstance(e, RuntimeError) and "Failed to bind" in str(e):
        return RuntimeFailure(f"{e}; another process may hold the port: choose another --listen")
    return e


# ---------------------------------------------------------------------------- status


def status_from_store(data_dir: Path, rounds: int = 10) -> dict[str, Any]:
    """The status document from the store (read-only); the schema of `statusdoc.document`."""
    from bagel.coordinator.statusdoc import cell_commit_stats, document
    from bagel.coordinator.store import STARTED_KEY, Store, to_json
    from bagel.protocol import bagel_pb2 as pb
    from bagel.protocol.runspec import SpecError, parse_cell, parse_spec

    store = Store.open_readonly(data_dir)
    try:
        spec = store.spec()
        snap = store.load(recent_commits=1)
        stats = cell_commit_stats(store.commit_records())
        try:
            target = parse_spec(spec.spec_toml).slo.cell_sample_target if spec else 0
        except SpecError:
            target = 0
        started = store.get_kv(STARTED_KEY)
        resp = pb.StatusResponse(
            run_id=spec.run_id if spec else "",
            spec_hash=spec.spec_hash if spec else "",
            now_unix_ms=int(time.time() * 1000),
            started_unix_ms=int(started) if isinstance(started, int) else 0,
            detailed=True,
        )
        members: dict[str, list[str]] = {}
        counts: dict[str, int] = {"standby": 0}
        for w in snap.workers:
            state = w.state.value
            counts[state] = counts.get(state, 0) + 1
            if state == "active" and w.cell_id:
                members.setdefault(w.cell_id, []).append(w.worker_id)
            elif state == "active":
                counts["standby"] += 1
            resp.workers.add(
                worker_id=w.worker_id,
                name=w.profile.name,
                state=state,
                cell_id=w.cell_id,
                reputation=w.reputation,
                samples_per_s=float(w.throughput.get(w.cell_id, 0.0)) if w.cell_id else 0.0,
                vram_bytes=w.profile.vram_bytes,
                host_memory_bytes=w.profile.host_memory_bytes,
                rounds_contributed=w.rounds_contributed,
            )
        for state, n in counts.items():
            resp.worker_counts[state] = n
        open_rounds = {r.cell_id: r for r in snap.rounds}
        for c in snap.cells:
            r = open_rounds.get(c.cell_id)
            rate, last_ms = stats.get(c.cell_id, (0.0, 0))
            resp.cells.add(
                cell_id=c.cell_id,
                kind="router" if parse_cell(c.cell_id) is None else "expert",
                round=r.round if r else 0,
                round_state=r.state.value if r else "none",
                committed_round=c.committed_round,
                committed_hash=c.committed_hash,
                members=sorted(members.get(c.cell_id, [])),
                last_loss=c.last_loss,
                latest_checkpoint_round=c.checkpoint_round,
                samples_committed=c.samples_committed,
                sample_target=target,
                samples_per_s=rate,
                last_commit_unix_ms=last_ms,
                rollbacks=c.rollbacks,
            )
        return document(
            resp,
            source=str(data_dir),
            live=False,
            rounds=[to_json(r) for r in store.recent_rounds(rounds)],
            checkpoints=[
                {"cell_id": m.cell_id, "round": m.round, "state_hash": m.state_hash, "total_bytes": m.total_bytes}
                for m in store.list_checkpoints()
            ],
        )
    finally:
        store.close()


def status_from_target(
    target: str, timeout_s: float = 10.0, *, tls_fingerprint: str = "", key: Path | None = None
) -> dict[str, Any]:
    """The status document from a live daemon (GetStatus), over TLS pinned to `tls_fingerprint`
    ("" = plaintext), signed with `key` if given (the daemon's or the operator's key: every
    worker; unsigned: the aggregate view); `bagel.protocol.tls.TLSError` before any request if
    the pin fails."""
    import asyncio

    import grpc

    from bagel.protocol import bagel_pb2 as pb
    from bagel.protocol import bagel_pb2_grpc as pb_grpc
    from bagel.protocol.grpc_options import channel_options
    from bagel.protocol.tls import pinned_credentials

    pinned = pinned_credentials(target, tls_fingerprint, timeout_s) if tls_fingerprint else None

    req = pb.GetStatusRequest()
    if key is not None:
        from bagel.protocol.envelope import sign_request
        from bagel.protocol.identity import Identity

        identity = Identity.load(key)

    async def ask() -> pb.StatusResponse:
        if pinned is None:
            channel = grpc.aio.insecure_channel(target, options=channel_options())
        else:
            options = channel_options() + pinned.channel_options()
            channel = grpc.aio.secure_channel(target, pinned.credentials(), options=options)
        async with channel as ch:
            stub = pb_grpc.CoordinatorStub(ch)
            if key is not None:  # the run id comes from the daemon (the challenge RPC is public)
                ch_resp = await stub.AdmissionChallenge(pb.AdmissionChallengeRequest(), timeout=timeout_s)
                req.auth.CopyFrom(
                    sign_request(identity, pb.StatusAuthRequest(), run_id=ch_resp.run_id, method="GetStatus")
                )
            return await stub.GetStatus(req, timeout=timeout_s)

    from bagel.coordinator.statusdoc import document

    return document(asyncio.run(ask()), source=target, live=True)


DASH = "—"  # what the table shows for a value the source does not know (null in the JSON)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return DASH
    s = int(seconds)
    if s < 120:
        return f"{seconds:.1f}s" if seconds < 10 else f"{s}s"
    if s < 7200:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _render(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)  # a pipe gets 80 columns, too narrow for worker ids
    console.print(
        f"[bold]run[/bold] {doc['run_id']}  spec {doc['spec_hash'][:12]}  up {_age(doc['uptime_s'])}  ({doc['source']})"
    )
    cells = Table(title="cells")
    cols = (
        "cell",
        "round",
        "state",
        "committed",
        "hash",
        "members",
        "samples",
        "target",
        "ETA",
        "loss",
        "ckpt",
        "rollbacks",
    )
    for col in cols:
        cells.add_column(col)
    for c in doc["cells"]:
        cells.add_row(
            c["cell_id"],
            str(c["round"]),
            c["round_state"],
            str(c["committed_round"]),
            c["committed_hash"][:12] or DASH,
            str(len(c["members"])),
            str(c["samples_committed"]),
            DASH if c["sample_target"] is None else str(c["sample_target"]),
            _age(c["eta_s"]),
            DASH if c["last_loss"] is None else f"{c['last_loss']:.4f}",
            DASH if c["latest_checkpoint_round"] is None else str(c["latest_checkpoint_round"]),
            str(c["rollbacks"]),
        )
    console.print(cells)
    workers = Table(title=f"workers ({len(doc['workers'])})")
    for col in (
        "worker",
        "name",
        "state",
        "cell",
        "phase",
        "heartbeat",
        "samples/s",
        "vram GiB",
        "RAM GiB",
        "rep",
        "rounds",
    ):
        workers.add_column(col)
    for w in doc["workers"][:200]:
        workers.add_row(
            w["worker_id"],
            w["name"],
            w["state"],
            w["cell_id"] or DASH,
            w["phase"] or DASH,
            _age(w["heartbeat_age_s"]),
            f"{w['samples_per_s']:.1f}",
            f"{w['vram_bytes'] / 2**30:.1f}",
            f"{w['host_memory_bytes'] / 2**30:.1f}" if w.get("host_memory_bytes") else DASH,
            f"{w['reputation']:.2f}",
            str(w["rounds_contributed"]),
        )
    console.print(workers)
    if doc["rounds"]:
        rounds = Table(title="recent rounds")
        for col in ("cell", "round", "attempt", "state", "members", "contributors", "reason"):
            rounds.add_column(col)
        for r in doc["rounds"]:
            rounds.add_row(
                r["cell_id"],
                str(r["round"]),
                str(r["attempt"]),
                str(r["state"]),
                str(len(r["members"])),
                str(len(r["contributors"])),
                str(r.get("reason", ""))[:40],
            )
        console.print(rounds)


def _cmd_status(args: argparse.Namespace) -> int:
    import sqlite3

    from bagel.coordinator.store import StoreError
    from bagel.protocol.tls import TLSError, check_fingerprint

    if (args.data_dir is None) == (args.target is None):
        print("error: give exactly one of --data-dir DIR or --target HOST:PORT", file=sys.stderr)
        return EXIT_USAGE
    if args.key is not None and args.target is None:
        print("error: --key signs a --target request; --data-dir reads the store directly", file=sys.stderr)
        return EXIT_USAGE
    from bagel.protocol.identity import IdentityError

    fingerprint = ""
    if args.target is not None:
        if (args.tls_fingerprint is None) == (not args.insecure):
            print(
                "error: with --target give --tls-fingerprint HEX (the daemon's 'tls: sha256 HEX' line) "
                "or --insecure (a plaintext daemon)",
                file=sys.stderr,
            )
            return EXIT_USAGE
        try:
            fingerprint = check_fingerprint(args.tls_fingerprint) if args.tls_fingerprint else ""
        except TLSError as e:
            print(f"error: --tls-fingerprint: {e}", file=sys.stderr)
            return EXIT_USAGE
    try:
        if args.target:
            doc = status_from_target(args.target, tls_fingerprint=fingerprint, key=args.key)
        else:
            doc = status_from_store(args.data_dir, args.rounds)
    except (StoreError, IdentityError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except sqlite3.DatabaseError:
        raise  # `guarded` says the store is damaged and what to do
    except (TLSError, OSError) as e:  # the pin failed, or no server there
        print(f"error: {args.target}: {e}", file=sys.stderr)
        return EXIT_FAILED
    except Exception as e:  # grpc errors from --target
        details = e.details() if hasattr(e, "details") else e
        code = e.code().name if hasattr(e, "code") else type(e).__name__
        hint = " (a daemon serving TLS drops plaintext: give --tls-fingerprint HEX)" if args.insecure else ""
        print(f"error: {code}: {details}{hint}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(json.dumps(doc, indent=1, sort_keys=True))
    else:
        _render(doc)
    return EXIT_OK


# ---------------------------------------------------------------------------- token

OPERATOR_KEY_FILE = "operator.key"


def _open_run_store(data_dir: Path) -> Any:
    """The read-write store of an existing run (StoreError if there is none yet)."""
    from bagel.coordinator.store import DB_NAME, Store, StoreError

    if not (data_dir / DB_NAME).exists():
        raise StoreError(f"no coordinator database in {data_dir}: start the coordinator on it once first")
    store = Store.open(data_dir)
    if store.spec() is None:
        store.close()
        raise StoreError(f"{data_dir} holds no run spec yet: start the coordinator on it once first")
    return store


def _cmd_token(args: argparse.Namespace) -> int:
    from bagel.coordinator.store import StoreError
    from bagel.protocol.identity import IdentityError

    try:
        if args.token_command == "keygen":
            return _token_keygen(args)
        if args.token_command == "create":
            return _token_create(args)
        if args.token_command == "list":
            return _token_list(args)
        return _token_revoke(args)
    except (StoreError, IdentityError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE


def _token_keygen(args: argparse.Namespace) -> int:
    import base64

    from bagel.protocol.identity import Identity

    path = args.data_dir / OPERATOR_KEY_FILE
    if path.exists():
        raise ValueError(f"{path} exists already; its public key: see `token create` errors, or remove it first")
    args.data_dir.mkdir(parents=True, exist_ok=True)
    identity = Identity.generate()
    identity.save(path)
    print(base64.b64encode(identity.public_key).decode())
    return EXIT_OK


def _token_create(args: argparse.Namespace) -> int:
    import base64
    import os

    from bagel.coordinator.store import JoinTokenRow
    from bagel.protocol.identity import Identity
    from bagel.protocol.jointoken import TOKEN_ID_BYTES, issue_token, to_text
    from bagel.protocol.runspec import parse_spec

    if not args.expires_s > 0:
        raise ValueError("--expires-s must be positive")
    if args.uses < 1:
        raise ValueError("--uses must be at least 1")
    store = _open_run_store(args.data_dir)
    try:
        stored = store.spec()
        assert stored is not None
        spec = parse_spec(stored.spec_toml)
        if spec.security.mode != "permissioned":
            raise ValueError(f"run {spec.run.id!r} is open (security.mode): it takes no join tokens")
        key_path = args.operator_key or args.data_dir / OPERATOR_KEY_FILE
        operator = Identity.load(key_path)
        if base64.b64encode(operator.public_key).decode() != spec.security.operator_public_key:
            raise ValueError(f"{key_path} is not the key of the spec's security.operator_public_key")
        now = int(time.time() * 1000)
        token_id = os.urandom(TOKEN_ID_BYTES)
        expires = now + int(args.expires_s * 1000)
        raw = issue_token(
            operator,
            run_id=spec.run.id,
            token_id=token_id,
            name=args.name,
            issued_ms=now,
            expires_ms=expires,
            uses=args.uses,
        )
        store.add_token(
            JoinTokenRow(
                token_id=token_id.hex(), name=args.name, issued_unix_ms=now, expires_unix_ms=expires, uses=args.uses
            )
        )
    finally:
        store.close()
    print(to_text(raw))
    return EXIT_OK


def _token_rows(rows: list[Any]) -> list[dict[str, Any]]:
    from bagel.protocol.identity import worker_id_of

    out = []
    for t in rows:
        out.append(
            {
                "name": t.name,
                "id": t.token_id,
                "expires_unix_ms": t.expires_unix_ms,
                "uses": t.uses,
                "uses_left": max(0, t.uses - t.used),
                "bound_key": t.bound_key,
                "bound_worker": worker_id_of(bytes.fromhex(t.bound_key)) if t.bound_key else "",
                "revoked": t.revoked_unix_ms > 0,
            }
        )
    return out


def _token_list(args: argparse.Namespace) -> int:
    from datetime import UTC, datetime

    store = _open_run_store(args.data_dir)
    try:
        rows = _token_rows(store.list_tokens())
    finally:
        store.close()
    if args.json:
        print(json.dumps(rows, indent=1, sort_keys=True))
        return EXIT_OK
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"join tokens ({len(rows)})")
    for col in ("name", "id", "expires (UTC)", "uses left", "bound key (worker)", "revoked"):
        table.add_column(col)
    now = int(time.time() * 1000)
    for r in rows:
        expires = datetime.fromtimestamp(r["expires_unix_ms"] / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(
            r["name"],
            r["id"],
            expires + (" (expired)" if r["expires_unix_ms"] <= now else ""),
            f"{r['uses_left']}/{r['uses']}",
            f"{r['bound_key'][:16]}... ({r['bound_worker']})" if r["bound_key"] else "-",
            "yes" if r["revoked"] else "no",
        )
    Console(width=160).print(table)
    return EXIT_OK


def _token_revoke(args: argparse.Namespace) -> int:
    store = _open_run_store(args.data_dir)
    try:
        row = store.revoke_token(args.token, int(time.time() * 1000))
    finally:
        store.close()
    print(f"revoked {row.name} ({row.token_id})")
    return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
