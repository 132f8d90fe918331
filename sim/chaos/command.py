"""`bagel-sim chaos SCENARIO --out DIR`: a real coordinator and real workers, faults on a schedule.

Everything is a real process on loopback (CPU, tiny model):

    hivemind-dht (bootstrap)  <-DHT-  bagel-coordinator serve  <-gRPC-  FaultProxy  <-gRPC-  bagel-worker x N
                                       (--advertise-endpoint = the proxy)       (this process)

- A standalone hivemind DHT node is the join string's initial peer, so the join string
  stays valid across coordinator restarts (a restarted coordinator gets a new DHT peer id).
- The coordinator listens on a fixed loopback port and publishes, with
  `--advertise-endpoint`, the address of a `FaultProxy` (sim/proxy.py) running in this
  process; every worker resolves that record, so all control-plane traffic crosses the
  proxy and its latency/bandwidth/reset/hang faults. A restarted coordinator binds the same
  port, so the proxy's target never changes.
- Workers run `bagel-worker join` with `--log-json` (their events are parsed here) and
  `--keep-round-history` (one local checkpoint per committed round, re-hashed at the end).

Faults follow the scenario's schedule (sim/chaos_scenario.py), counted from the first
committed round. The coordinator's commit log (its SQLite store, read-only) is read before
every coordinator kill, after every restart, at the end while running and after the stop.
Everything observed goes into a `sim.invariants.History`, and `check_history` decides;
two runner checks join it: every scheduled fault fired, and no process exited on its own.
The report (sim/chaos_report.py) writes summary.json, summary.md and timeline.png. The
exit status is 1 when any check fails. Every process is stopped on exit, on error and on
Ctrl-C (process groups, `finally`).

A scenario with `chaos.bed = true` runs on the network test bed instead (root; see
sim/chaos/bed.py): no proxy and no bootstrap node, the coordinator on the public segment,
workers behind NATs or public, link faults on the bed's links; `--bed-tag` picks the
bed's name, and a machine without root or namespaces refuses it in one line (exit 2).

Faults by script, as torchft's EventInjector and hivemind's Fault enum do in tests, but
against the real daemons.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

from bagel.sim.chaos.driver import RUN_MARKER, ChaosRun
from bagel.sim.chaos.scenario import ChaosScenarioError, load_chaos_scenario

EXIT_OK, EXIT_INVARIANT, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def add_chaos_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `chaos` on a `bagel-sim` subparsers object (the integrator's sim/cli.py)."""
    p = subparsers.add_parser(
        "chaos",
        help="real coordinator + workers on loopback with faults on a schedule; checks invariants",
        description=__doc__.split("\n\n")[0],
    )
    _add_args(p)
    p.set_defaults(func=run_chaos)
    return p


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "scenario", type=Path, metavar="SCENARIO", help="chaos scenario TOML (e.g. sim/scenarios/chaos-default.toml)"
    )
    p.add_argument(
        "--out",
        required=True,
        type=Path,
        metavar="DIR",
        help="output directory: summary.json, summary.md, timeline.png, logs/, data dirs; must be new or empty",
    )
    p.add_argument(
        "--force", action="store_true", help="reuse DIR from an earlier chaos run (its run data is deleted first)"
    )
    p.add_argument("--workers", type=int, default=None, metavar="N", help="override the scenario's worker count")
    p.add_argument(
        "--seed", type=int, default=None, help="override the scenario's seed (victims of count/fraction faults)"
    )
    p.add_argument(
        "--bed-tag",
        default=None,
        metavar="TAG",
        help="override a bed scenario's NetLab tag (namespaces bagelnl-TAG-*), so two runs never share a bed",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def _prepare_out(out: Path, force: bool) -> str | None:
    if not out.exists():
        return None
    if not out.is_dir():
        return f"{out} exists and is not a directory"
    entries = list(out.iterdir())
    if not entries:
        return None
    if not force:
        return f"{out} is not empty (use --force to reuse the output of an earlier chaos run)"
    if not (out / RUN_MARKER).exists():
        return f"{out} was not written by bagel-sim chaos ({RUN_MARKER} missing); refusing to delete it"
    for name in ("coordinator", "workers", "logs"):
        shutil.rmtree(out / name, ignore_errors=True)
    for name in ("run.toml", "bootstrap.key", "summary.json", "summary.md", "timeline.png", RUN_MARKER):
        (out / name).unlink(missing_ok=True)
    return None


def _bed_problem(sc: Any, tag: str | None) -> str | None:
    """Why a bed scenario cannot run here (one line), or None."""
    from bagel.sim.netlab.bed import missing_prerequisite
    from bagel.sim.netlab.topology import TopologyError, check_tag

    if len(sc.bed.placement) != sc.workers:
        return f"--workers {sc.workers}: bed.placement places {len(sc.bed.placement)} workers"
    if tag is not None:
        try:
            check_tag(tag)
        except TopologyError as e:
            return f"--bed-tag: {e}"
    reason = missing_prerequisite()
    return f"chaos.bed = true, but {reason}" if reason else None


def run_chaos(args: argparse.Namespace) -> int:
    """`bagel-sim chaos`: 0 every check holds, 1 one failed, 2 bad arguments (or a bed scenario
    on a machine that cannot build the bed), 130 interrupted."""
    import dataclasses

    try:
        sc = load_chaos_scenario(args.scenario)
    except ChaosScenarioError as e:
        print(f"bagel-sim chaos: {args.scenario}: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.workers is not None:
        if (
            args.workers < 1
            or any(w >= args.workers for f in sc.faults for w in f.workers)
            or any(i >= args.workers for i in sc.byzantine)
        ):
            print(
                f"bagel-sim chaos: --workers {args.workers}: too few for the scenario's worker indices", file=sys.stderr
            )
            return EXIT_USAGE
        sc = dataclasses.replace(sc, workers=args.workers)
    if args.seed is not None:
        sc = dataclasses.replace(sc, seed=args.seed)
    if sc.bed is not None:
        problem = _bed_problem(sc, args.bed_tag)
        if problem:
            print(f"bagel-sim chaos: {problem}", file=sys.stderr)
            return EXIT_USAGE
        if args.bed_tag is not None:
            sc = dataclasses.replace(sc, bed=sc.bed.with_tag(args.bed_tag))
    elif args.bed_tag is not None:
        print(f"bagel-sim chaos: --bed-tag: {args.scenario} does not run on the bed (chaos.bed)", file=sys.stderr)
        return EXIT_USAGE
    problem = _prepare_out(args.out, args.force)
    if problem:
        print(f"bagel-sim chaos: {problem}", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run = ChaosRun(sc, args.out, echo=not args.quiet)

    async def main() -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        # Ctrl-C and SIGTERM cancel the run; it then stops every process and still reports
        # (a second one during the stop SIGKILLs every process group at once)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            return await run.run()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    try:
        summary = asyncio.run(main())
    except (KeyboardInterrupt, asyncio.CancelledError):
        summary = {"interrupted": True}
    if summary.get("interrupted"):
        print(f"bagel-sim chaos: interrupted; every process was stopped; partial report in {args.out}", file=sys.stderr)
        return EXIT_INTERRUPTED
    ok = all(summary["invariants"].values())
    if not args.quiet:
        print(f"bagel-sim chaos: {args.out / 'summary.md'}", file=sys.stderr)
    print(
        json.dumps(
            {"invariants": summary["invariants"], "committed_rounds": summary["committed_rounds"]}, sort_keys=True
        )
    )
    return EXIT_OK if ok else EXIT_INVARIANT


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bagel.sim.chaos", description=__doc__.split("\n\n")[0])
    _add_args(p)
    return run_chaos(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
