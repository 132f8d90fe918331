"""`bagel-worker join JOIN_STRING ...` (also `python -m bagel.worker join ...`).

One command for a volunteer: create or load the identity, find the coordinator from the
join string, profile, register, and train until stopped. Under
`torchrun --nproc-per-node N -m bagel.worker join ...` rank 0 runs the agent and the other
ranks follow it (DDP inside the worker, `bagel.worker.ddp`).

SIGTERM or Ctrl-C, to the process or its group, leaves gracefully (finish or abandon the
round, Leave, exit 0) within `--leave-grace-s` + 15 s; a second one exits at once with
128 + the signal's number (`bagel.protocol.shutdown`). A coordinator that is down or
unreachable is waited for with backoff and a countdown (`bagel.worker.waiting`). One
worker per `--data-dir` (`bagel.worker.datadirlock`). Every failure is one line on stderr
(`bagel.protocol.clierrors`). Exit codes: 0 done, 1 a runtime failure (a damaged identity
key, an internal error), 2 bad usage (flags, join string, a data dir another worker
holds), 3 the coordinator runs another spec or is not the pinned server. SIGUSR1 pauses
(leave the run as for a stop, but keep running with the committed state), SIGUSR2 resumes
(join again); SIGQUIT prints every thread's stack.

`--byzantine MODE` is hidden from `--help` on purpose (it exists for fault-injection runs,
`bagel-sim chaos`): the worker then contributes a corrupted pseudo-gradient, one of
sign-flip (-delta), scale (x100), nan, zero (freeloading), stale (last round's delta);
or, with bad-reducer, it contributes honestly but returns the part it reduces scaled x1000
under a consistent signed receipt (the verified-reducer check must catch it).
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import os
import signal
import sys
from pathlib import Path

from bagel.protocol.clierrors import OneLineParser, UsageError, check_dir_arg, check_multiaddr, guarded, version_text
from bagel.protocol.shutdown import descendants, end_descendants
from bagel.worker.profile import DEFAULT_UPLINK_MBPS
from bagel.worker.roundwork import BYZANTINE_MODES


def default_data_dir() -> Path:
    return Path(os.environ.get("BAGEL_WORKER_HOME", Path.home() / ".bagel" / "worker"))


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="bagel-worker", description="Contribute this machine to a Bagel training run.")
    p.add_argument("--version", action="version", version=version_text("bagel-worker"))
    sub = p.add_subparsers(dest="command", required=True)
    j = sub.add_parser("join", help="join a run and train until stopped (Ctrl-C leaves gracefully)")
    j.add_argument("join_string", metavar="JOIN_STRING", help="the run's join string (bagel1:...), from its operator")
    j.add_argument(
        "--device", default="auto", help="auto (first CUDA device, else CPU), cpu, or cuda:N (default: auto)"
    )
    j.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help=f"identity key and local checkpoints (default: {default_data_dir()})",
    )
    j.add_argument(
        "--max-vram-gb", type=float, default=None, help="use at most this much accelerator memory, GiB (default: all)"
    )
    j.add_argument(
        "--max-ram-gb",
        type=float,
        default=None,
        help="use at most this much of the host's RAM, GiB (default: what is available at start)",
    )
    j.add_argument("--name", default="", help="a display name for the operator's status view (default: host-pid)")
    j.add_argument(
        "--throttle",
        type=float,
        default=1.0,
        help="slow training down by this factor >= 1 (sleeps (X-1) x compute per step), to emulate a slower device",
    )
    j.add_argument(
        "--uplink-mbps",
        type=float,
        default=DEFAULT_UPLINK_MBPS,
        help=f"your upload bandwidth in Mbit/s, used to plan rounds (default: {DEFAULT_UPLINK_MBPS:g})",
    )
    j.add_argument(
        "--dht-listen",
        action="append",
        default=None,
        metavar="MULTIADDR",
        help="DHT/P2P listen multiaddr; repeatable (default: /ip4/0.0.0.0/tcp/0)",
    )
    j.add_argument(
        "--relay",
        action="store_true",
        help="serve as a libp2p circuit relay for volunteers behind NATs (needs a publicly reachable address; "
        "list this worker's DHT address in the join string so they use it)",
    )
    out = j.add_mutually_exclusive_group()
    out.add_argument("--quiet", action="store_true", help="print only warnings and errors")
    out.add_argument("--log-json", action="store_true", help="print one JSON object per event line (for scripts)")
    j.add_argument(
        "--reduce-timeout-s",
        type=float,
        default=None,
        help="give up an exchange after at most this many seconds (default: at the coordinator's deadline for it)",
    )
    j.add_argument(
        "--leave-grace-s",
        type=float,
        default=15.0,
        help="on SIGTERM, wait at most this long for a running exchange before leaving (default: 15)",
    )
    j.add_argument(
        "--sync-timeout-s",
        type=float,
        default=120.0,
        metavar="S",
        help="give one state download (and a catch-up by committed updates, which fetches less) at most "
        "S seconds before retrying; raise it for multi-GB states on home links (default: 120)",
    )
    j.add_argument(
        "--token",
        default=None,
        metavar="TOKEN",
        help="join token (bagel-token1:...) for a permissioned run, from its operator; "
        "also read from $BAGEL_JOIN_TOKEN",
    )
    v = j.add_argument_group("volunteer limits")
    v.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        metavar="N",
        help="use at most N CPU threads for training and evaluation (default: torch's choice, all cores)",
    )
    v.add_argument(
        "--max-upload-mbps",
        type=float,
        default=None,
        metavar="X",
        help="cap what this worker sends (exchange, state serving, checkpoint uploads) at X Mbit/s (default: no cap)",
    )
    v.add_argument(
        "--fetch-data",
        choices=("auto", "always", "never"),
        default="auto",
        help="fetch the cell's data shards from the coordinator: auto (when the spec's data.path is not "
        "readable here), always, never (default: auto)",
    )
    # fault injection and test hooks: documented in the module docstring, hidden from --help
    j.add_argument(
        "--metrics-listen",
        default="",
        metavar="HOST:PORT",
        help="serve this worker's Prometheus metrics over HTTP here (port 0 picks one; default: off)",
    )
    j.add_argument("--byzantine", choices=BYZANTINE_MODES, default="", help=argparse.SUPPRESS)
    j.add_argument("--keep-round-history", action="store_true", help=argparse.SUPPRESS)
    return p


def config_from_args(args: argparse.Namespace):  # noqa: ANN201 - AgentConfig, imported lazily
    """Validate the arguments into an AgentConfig (ValueError names the bad flag)."""
    from bagel.worker.agent import AgentConfig

    if args.throttle < 1.0:
        raise ValueError(f"--throttle must be >= 1, got {args.throttle}")
    if args.max_vram_gb is not None and args.max_vram_gb <= 0:
        raise ValueError(f"--max-vram-gb must be positive, got {args.max_vram_gb}")
    if args.max_ram_gb is not None and args.max_ram_gb <= 0:
        raise ValueError(f"--max-ram-gb must be positive, got {args.max_ram_gb}")
    if args.uplink_mbps <= 0:
        raise ValueError(f"--uplink-mbps must be positive, got {args.uplink_mbps}")
    if args.reduce_timeout_s is not None and args.reduce_timeout_s <= 0:
        raise ValueError(f"--reduce-timeout-s must be positive, got {args.reduce_timeout_s}")
    if not 0 < args.sync_timeout_s <= 86400:
        raise ValueError(f"--sync-timeout-s must be in (0, 86400] seconds, got {args.sync_timeout_s}")
    if args.leave_grace_s < 0:
        raise ValueError(f"--leave-grace-s must be >= 0, got {args.leave_grace_s}")
    if args.metrics_listen:
        host, sep, port = args.metrics_listen.rpartition(":")
        if not sep or not port.isdigit() or int(port) > 65535:
            raise ValueError(f"--metrics-listen: expected HOST:PORT, got {args.metrics_listen!r}")
    for maddr in args.dht_listen or ():
        check_multiaddr("--dht-listen", maddr)
    if args.data_dir is not None:
        check_dir_arg("--data-dir", args.data_dir)
    if args.cpu_threads is not None and not 1 <= args.cpu_threads <= 4096:
        raise ValueError(f"--cpu-threads must be in [1, 4096], got {args.cpu_threads}")
    if args.max_upload_mbps is not None and not (0.01 <= args.max_upload_mbps <= 1e6):
        raise ValueError(f"--max-upload-mbps must be in [0.01, 1e6], got {args.max_upload_mbps}")
    token_text = args.token if args.token is not None else os.environ.get("BAGEL_JOIN_TOKEN", "")
    join_token = b""
    if token_text:
        from bagel.protocol.jointoken import from_text

        try:
            join_token = from_text(token_text)
        except ValueError as e:
            raise ValueError(f"--token: {e}") from None
    uplink = args.uplink_mbps
    if args.max_upload_mbps is not None:  # plan rounds with what we will really send
        uplink = min(uplink, args.max_upload_mbps)
    return AgentConfig(
        join=args.join_string,
        data_dir=args.data_dir or default_data_dir(),
        device=args.device,
        max_vram_gb=args.max_vram_gb,
        max_ram_gb=args.max_ram_gb,
        name=args.name,
        throttle=args.throttle,
        uplink_mbps=uplink,
        byzantine=args.byzantine,
        dht_listen=tuple(args.dht_listen or ("/ip4/0.0.0.0/tcp/0",)),
        reduce_timeout_s=args.reduce_timeout_s,
        sync_timeout_s=args.sync_timeout_s,
        leave_grace_s=args.leave_grace_s,
        keep_round_history=args.keep_round_history,
        join_token=join_token,
        metrics_listen=args.metrics_listen,
        fetch_data=args.fetch_data,
        cpu_threads=args.cpu_threads,
        max_upload_mbps=args.max_upload_mbps,
        relay=args.relay,
    )


def set_cpu_threads(n: int) -> None:
    """`--cpu-threads N`: torch's intra-op pool (every thread's, training and evaluation) and
    its inter-op pool, before any parallel work has started."""
    import torch

    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:  # inter-op work already ran in this process (only when embedded)
        pass


async def _run_agent(agent) -> int:  # noqa: ANN001
    try:
        # the agent installs the SIGTERM/SIGINT handlers itself, once its DHT child process
        # exists: a child forked after them would inherit a handler that ignores SIGTERM,
        # and hivemind could then not terminate it (the worker would hang at exit)
        return await agent.run(handle_signals=True)
    except asyncio.CancelledError:
        return 130


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return guarded("bagel-worker: ", lambda: _main(args))


def _main(args: argparse.Namespace) -> int:
    # Back large CPU tensors (>= 2 MiB) with transparent huge pages; torch reads this at its
    # first large allocation. Decoding a 16M-value int8 part into a fresh tensor goes from
    # 1.9 to 3.1 GB/s here, the difference being 4 KiB page faults (bench/compression.py).
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    # two malloc arenas: training, the exchange and state sync reuse what the others freed
    # (bagel.worker.allocator says what it saves); before the worker starts its threads
    from bagel.worker.allocator import limit_arenas

    limit_arenas()
    if hasattr(signal, "SIGQUIT"):
        try:
            faulthandler.register(signal.SIGQUIT)  # `kill -QUIT <pid>` prints every thread's stack
        except (ValueError, OSError, AttributeError):  # stderr is not a real file (embedded, tests)
            pass
    logging.basicConfig(
        level=os.environ.get("BAGEL_LOG_LEVEL", "WARNING"), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from bagel.protocol.joinstring import JoinStringError, parse_join_string
    from bagel.worker import ddp
    from bagel.worker.display import Display

    try:
        cfg = config_from_args(args)
    except (ValueError, JoinStringError, UsageError) as e:
        print(f"bagel-worker: {e}", file=sys.stderr)
        return 2
    try:  # before the data dir is touched: a refused join leaves it as it was
        parse_join_string(cfg.join)
    except JoinStringError as e:
        print(
            f"bagel-worker: JOIN_STRING: {e}; copy the whole bagel1:... line the coordinator printed", file=sys.stderr
        )
        return 2
    if cfg.cpu_threads is not None:
        set_cpu_threads(cfg.cpu_threads)
    # pause / resume: ignored until the agent handles them (a signal during start-up must not
    # kill the worker), and ignored for good by the children forked before that (the DHT
    # process), so a SIGUSR1 to the whole process group pauses the worker and nothing else
    for sig in ("SIGUSR1", "SIGUSR2"):
        if hasattr(signal, sig):
            signal.signal(getattr(signal, sig), signal.SIG_IGN)
    ctx = ddp.init_from_env(args.device)
    try:
        if not ctx.is_leader:
            from bagel.worker.agent import ddp_follower

            # torchrun forwards SIGTERM/SIGINT to every rank; only rank 0 decides how to
            # stop (finish the round, Leave), then tells the others to exit
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            ddp_follower(ctx, args.device, args.throttle)
            return 0
        from bagel.protocol.identity import IdentityError
        from bagel.worker.agent import Agent, ensure_dirs
        from bagel.worker.datadirlock import DataDirBusy, DataDirLock

        display = Display("json" if args.log_json else "quiet" if args.quiet else "auto")
        try:
            ensure_dirs(Path(cfg.data_dir))
            lock = DataDirLock.acquire(Path(cfg.data_dir))
        except OSError as e:
            print(f"bagel-worker: --data-dir {cfg.data_dir}: {e}", file=sys.stderr)
            return 2
        except DataDirBusy as e:
            print(f"bagel-worker: {e}", file=sys.stderr)
            return 2
        try:
            agent = Agent(cfg, display, ctx)
        except IdentityError as e:
            print(f"bagel-worker: {e}; move the damaged key away to start as a new worker", file=sys.stderr)
            return 1
        except (ValueError, JoinStringError, OSError) as e:
            print(f"bagel-worker: {e}", file=sys.stderr)
            return 2
        already = set(descendants())  # the caller's own children (main called in-process) are not ours
        display.start()
        try:
            return asyncio.run(_run_agent(agent))
        finally:
            display.stop()
            end_descendants(spare=already)  # no child of the worker outlives it
            lock.release()
            # the stop's watchdog covered the loop's teardown (its executor's threads are
            # joined without a bound) and the children; what is left is the exit itself
            agent.stop_finished()
    finally:
        ctx.shutdown()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
