"""`bagel-coordinator`: run the coordinator daemon, or inspect a run's state.

    bagel-coordinator serve --run SPEC.toml --data-dir DIR [--listen HOST:PORT]
        [--dht-listen MULTIADDR] [--initial-peers MULTIADDR ...] [--metrics-listen HOST:PORT]
        [--tick-ms N] [--grace-s S] [--advertise-endpoint HOST:PORT] [--no-dht]
        [--tls-cert FILE --tls-key FILE | --insecure]
    bagel-coordinator status --data-dir DIR [--json]
    bagel-coordinator status --target HOST:PORT (--tls-fingerprint HEX | --insecure) [--json]

`serve` speaks gRPC over TLS by default: with the operator's `--tls-cert/--tls-key`, or
else a self-signed certificate generated into the data dir on the first start and reused
afterwards. It prints the fingerprint (`tls: sha256 HEX`), which the DHT record and the
join string carry, so workers pin it; `--insecure` serves plaintext (loopback tests,
benchmarks, a TLS-terminating proxy in front).

`status` reads the SQLite store read-only, so it works while the daemon runs (WAL readers
never block the writer); `--target` asks a live daemon over gRPC (GetStatus) instead,
which also shows volatile fields (phases, leases).

Exit codes: 0 clean stop, 1 the store failed while serving, 2 bad arguments or a data dir
that cannot be used (another run's spec, locked by another daemon, malformed spec).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bagel-coordinator", description="Bagel run coordinator.")
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
        default="/ip4/127.0.0.1/tcp/0",
        metavar="MULTIADDR",
        help="hivemind DHT listen multiaddr; default %(default)s",
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
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return _cmd_serve(args)
    return _cmd_status(args)


# ---------------------------------------------------------------------------- serve


def _cmd_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from bagel.coordinator.daemon import serve
    from bagel.coordinator.store import StoreError
    from bagel.protocol.runspec import SpecError, load_spec
    from bagel.protocol.tls import TLSError

    if args.tick_ms < 10:
        print("error: --tick-ms must be at least 10", file=sys.stderr)
        return EXIT_USAGE
    if (args.tls_cert is None) != (args.tls_key is None):
        print("error: give both --tls-cert and --tls-key, or neither", file=sys.stderr)
        return EXIT_USAGE
    if args.insecure and args.tls_cert is not None:
        print("error: --insecure contradicts --tls-cert/--tls-key", file=sys.stderr)
        return EXIT_USAGE
    try:
        spec = load_spec(args.run)
    except (OSError, SpecError) as e:
        print(f"error: run spec {args.run}: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return serve(
            spec,
            args.data_dir,
            grace_s=args.grace_s,
            listen=args.listen,
            advertise=args.advertise_endpoint,
            dht=None if args.no_dht else True,
            dht_listen=args.dht_listen,
            initial_peers=list(args.initial_peers),
            metrics_listen=args.metrics_listen,
            tick_ms=args.tick_ms,
            tls=not args.insecure,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
        )
    except StoreError as e:  # another spec in the data dir, locked, bad schema
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except TLSError as e:  # unreadable certificate or key, a key of another certificate
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE


# ---------------------------------------------------------------------------- status


def status_from_store(data_dir: Path, rounds: int = 10) -> dict[str, Any]:
    """The status document from the store (read-only)."""
    from bagel.coordinator.store import Store, to_json

    store = Store.open_readonly(data_dir)
    try:
        spec = store.spec()
        snap = store.load(recent_commits=1)
        commits = store.commits()
        per_cell: dict[str, int] = {}
        for cell, _r, _h in commits:
            per_cell[cell] = per_cell.get(cell, 0) + 1
        members: dict[str, list[str]] = {}
        for w in snap.workers:
            if w.state.value == "active" and w.cell_id:
                members.setdefault(w.cell_id, []).append(w.worker_id)
        open_rounds = {r.cell_id: r for r in snap.rounds}
        return {
            "source": str(data_dir),
            "run_id": spec.run_id if spec else "",
            "spec_hash": spec.spec_hash if spec else "",
            "now_unix_ms": int(time.time() * 1000),
            "workers": [
                {
                    "worker_id": w.worker_id,
                    "name": w.profile.name,
                    "state": w.state.value,
                    "cell_id": w.cell_id,
                    "reputation": w.reputation,
                    "samples_per_s": float(w.throughput.get(w.cell_id, 0.0)) if w.cell_id else 0.0,
                    "vram_bytes": w.profile.vram_bytes,
                    "rounds_contributed": w.rounds_contributed,
                }
                for w in snap.workers
            ],
            "cells": [
                {
                    "cell_id": c.cell_id,
                    "round": open_rounds[c.cell_id].round if c.cell_id in open_rounds else 0,
                    "round_state": open_rounds[c.cell_id].state.value if c.cell_id in open_rounds else "none",
                    "committed_round": c.committed_round,
                    "committed_hash": c.committed_hash,
                    "commits_recorded": per_cell.get(c.cell_id, 0),
                    "members": sorted(members.get(c.cell_id, [])),
                    "samples_committed": c.samples_committed,
                    "last_loss": c.last_loss,
                    "latest_checkpoint_round": c.checkpoint_round,
                }
                for c in snap.cells
            ],
            "rounds": [to_json(r) for r in store.recent_rounds(rounds)],
            "checkpoints": [
                {"cell_id": m.cell_id, "round": m.round, "state_hash": m.state_hash, "total_bytes": m.total_bytes}
                for m in store.list_checkpoints()
            ],
        }
    finally:
        store.close()


def status_from_target(target: str, timeout_s: float = 10.0, *, tls_fingerprint: str = "") -> dict[str, Any]:
    """The status document from a live daemon (GetStatus), over TLS pinned to `tls_fingerprint`
    ("" = plaintext); `bagel.protocol.tls.TLSError` before any request if the pin fails."""
    import asyncio

    import grpc
    from google.protobuf.json_format import MessageToDict

    from bagel.protocol import bagel_pb2 as pb
    from bagel.protocol import bagel_pb2_grpc as pb_grpc
    from bagel.protocol.grpc_options import channel_options
    from bagel.protocol.tls import pinned_credentials

    pinned = pinned_credentials(target, tls_fingerprint, timeout_s) if tls_fingerprint else None

    async def ask() -> pb.StatusResponse:
        if pinned is None:
            channel = grpc.aio.insecure_channel(target, options=channel_options())
        else:
            options = channel_options() + pinned.channel_options()
            channel = grpc.aio.secure_channel(target, pinned.credentials(), options=options)
        async with channel as ch:
            return await pb_grpc.CoordinatorStub(ch).GetStatus(pb.GetStatusRequest(), timeout=timeout_s)

    resp = asyncio.run(ask())
    doc = MessageToDict(resp, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    doc["source"] = target
    return doc


def _render(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"[bold]run[/bold] {doc.get('run_id', '')}  spec {str(doc.get('spec_hash', ''))[:12]}  ({doc['source']})"
    )
    cells = Table(title="cells")
    for col in ("cell", "round", "state", "committed", "hash", "members", "samples", "loss", "ckpt"):
        cells.add_column(col)
    for c in doc.get("cells", []):
        cells.add_row(
            c["cell_id"],
            str(c.get("round", 0)),
            str(c.get("round_state", "")),
            str(c.get("committed_round", 0)),
            str(c.get("committed_hash", ""))[:12],
            str(len(c.get("members", []))),
            str(c.get("samples_committed", 0)),
            f"{float(c.get('last_loss', 0.0)):.4f}",
            str(c.get("latest_checkpoint_round", -1)),
        )
    console.print(cells)
    workers = Table(title=f"workers ({len(doc.get('workers', []))})")
    for col in ("worker", "name", "state", "cell", "samples/s", "vram GiB", "rep", "rounds"):
        workers.add_column(col)
    for w in doc.get("workers", [])[:200]:
        workers.add_row(
            w["worker_id"],
            str(w.get("name", "")),
            str(w.get("state", "")),
            str(w.get("cell_id", "")),
            f"{float(w.get('samples_per_s', 0.0)):.1f}",
            f"{int(w.get('vram_bytes', 0)) / 2**30:.1f}",
            f"{float(w.get('reputation', 0.0)):.2f}",
            str(w.get("rounds_contributed", 0)),
        )
    console.print(workers)
    if doc.get("rounds"):
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
    from bagel.coordinator.store import StoreError
    from bagel.protocol.tls import TLSError, check_fingerprint

    if (args.data_dir is None) == (args.target is None):
        print("error: give exactly one of --data-dir DIR or --target HOST:PORT", file=sys.stderr)
        return EXIT_USAGE
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
            doc = status_from_target(args.target, tls_fingerprint=fingerprint)
        else:
            doc = status_from_store(args.data_dir, args.rounds)
    except StoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
