"""`bagel-worker join JOIN_STRING ...` (also `python -m bagel.worker join ...`).

One command for a volunteer: create or load the identity, find the coordinator from the
join string, profile, register, and train until stopped. Under
`torchrun --nproc-per-node N -m bagel.worker join ...` rank 0 runs the agent and the other
ranks follow it (DDP inside the worker, `bagel.worker.ddp`).

SIGTERM or Ctrl-C leaves gracefully (finish or abandon the round, Leave, exit 0); a second
one aborts at once. Exit codes: 0 done, 2 bad arguments, 3 the coordinator runs another spec.

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

from bagel.worker.profile import DEFAULT_UPLINK_MBPS
from bagel.worker.roundwork import BYZANTINE_MODES


def default_data_dir() -> Path:
    return Path(os.environ.get("BAGEL_WORKER_HOME", Path.home() / ".bagel" / "worker"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bagel-worker", description="Contribute this machine to a Bagel training run.")
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
    out = j.add_mutually_exclusive_group()
    out.add_argument("--quiet", action="store_true", help="print only warnings and errors")
    out.add_argument("--log-json", action="store_true", help="print one JSON object per event line (for scripts)")
    j.add_argument(
        "--reduce-timeout-s", type=float, default=60.0, help="give up an exchange after this many seconds (default: 60)"
    )
    j.add_argument(
        "--leave-grace-s",
        type=float,
        default=15.0,
        help="on SIGTERM, wait at most this long for a running exchange before leaving (default: 15)",
    )
    j.add_argument(
        "--token",
        default=None,
        metavar="TOKEN",
        help="join token (bagel-token1:...) for a permissioned run, from its operator; "
        "also read from $BAGEL_JOIN_TOKEN",
    )
    # fault injection and test hooks: documented in the module docstring, hidden from --help
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
    if args.uplink_mbps <= 0:
        raise ValueError(f"--uplink-mbps must be positive, got {args.uplink_mbps}")
    if args.reduce_timeout_s <= 0:
        raise ValueError(f"--reduce-timeout-s must be positive, got {args.reduce_timeout_s}")
    if args.leave_grace_s < 0:
        raise ValueError(f"--leave-grace-s must be >= 0, got {args.leave_grace_s}")
    token_text = args.token if args.token is not None else os.environ.get("BAGEL_JOIN_TOKEN", "")
    join_token = b""
    if token_text:
        from bagel.protocol.jointoken import from_text

        try:
            join_token = from_text(token_text)
        except ValueError as e:
            raise ValueError(f"--token: {e}") from None
    return AgentConfig(
        join=args.join_string,
        data_dir=args.data_dir or default_data_dir(),
        device=args.device,
        max_vram_gb=args.max_vram_gb,
        name=args.name,
        throttle=args.throttle,
        uplink_mbps=args.uplink_mbps,
        byzantine=args.byzantine,
        dht_listen=tuple(args.dht_listen or ("/ip4/0.0.0.0/tcp/0",)),
        reduce_timeout_s=args.reduce_timeout_s,
        leave_grace_s=args.leave_grace_s,
        keep_round_history=args.keep_round_history,
        join_token=join_token,
    )


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
    # Back large CPU tensors (>= 2 MiB) with transparent huge pages; torch reads this at its
    # first large allocation. Decoding a 16M-value int8 part into a fresh tensor goes from
    # 1.9 to 3.1 GB/s here, the difference being 4 KiB page faults (bench/compression.py).
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    if hasattr(signal, "SIGUSR1"):
        try:
            faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints every thread's stack
        except (ValueError, OSError, AttributeError):  # stderr is not a real file (embedded, tests)
            pass
    logging.basicConfig(
        level=os.environ.get("BAGEL_LOG_LEVEL", "WARNING"), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from bagel.protocol.joinstring import JoinStringError
    from bagel.worker import ddp
    from bagel.worker.display import Display

    try:
        cfg = config_from_args(args)
    except (ValueError, JoinStringError) as e:
        print(f"bagel-worker: {e}", file=sys.stderr)
        return 2
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
        from bagel.worker.agent import Agent, ensure_dirs

        display = Display("json" if args.log_json else "quiet" if args.quiet else "auto")
        try:
            ensure_dirs(Path(cfg.data_dir))
            agent = Agent(cfg, display, ctx)
        except (ValueError, JoinStringError, OSError) as e:
            print(f"bagel-worker: {e}", file=sys.stderr)
            return 2
        display.start()
        try:
            return asyncio.run(_run_agent(agent))
        finally:
            display.stop()
    finally:
        ctx.shutdown()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
