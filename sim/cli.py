"""`bagel-sim`: run policies side by side on a simulated volunteer population.

    bagel-sim run SCENARIO.toml --out DIR [--workers N] [--hours H] [--seed S]
                  [--policies a,b,c] [--lease-mode declared|heartbeat] [--no-progress]
                  [--profile FILE] [--jobs N]

writes DIR/summary.json, DIR/run.json (what was simulated), DIR/summary.md and PNG plots
(committed rounds per cell over time, committed compute over time, wasted work by cause,
utilisation). This shell does the I/O and reads the wall
clock; the engine itself is pure. The policies run in parallel processes (`--jobs`,
default: one per core, the costliest first; see `bagel.sim.discrete.runner`), with the same
results as one after the other. `python -m bagel.sim run ...` is the same command.

    bagel-sim chaos SCENARIO.toml --out DIR ...

runs real processes with faults on a schedule (`bagel.sim.chaos.command`, which registers its own
subcommand and flags here).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from bagel.protocol.clierrors import OneLineParser, check_dir_arg, guarded, version_text
from bagel.sim.discrete import policies as registry
from bagel.sim.discrete.engine import EngineResult
from bagel.sim.discrete.report import markdown, plot, run_meta, summarize, write_json
from bagel.sim.discrete.runner import default_jobs, run_policies
from bagel.sim.discrete.scenario import Scenario, SimScenarioError, load_sim_scenario


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="bagel-sim", description="Discrete-event simulation of Bagel's coordinator at scale.")
    p.add_argument("--version", action="version", version=version_text("bagel-sim"))
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="simulate a scenario under several policies and write a report")
    r.add_argument("scenario", type=Path, help="scenario TOML (see sim/scenarios/)")
    r.add_argument("--out", type=Path, required=True, help="output directory (created if missing)")
    r.add_argument("--workers", type=int, default=None, help="population size (default: the scenario's)")
    r.add_argument("--hours", type=float, default=None, help="virtual hours to simulate (default: the scenario's)")
    r.add_argument("--seed", type=int, default=None, help="random seed (default: the scenario's)")
    r.add_argument(
        "--policies",
        default=None,
        help=f"comma-separated policies (default: the scenario's); known: {','.join(registry.names())}",
    )
    r.add_argument(
        "--lease-mode",
        choices=("declared", "heartbeat"),
        default=None,
        help="how leases are simulated (default: the scenario's engine.lease_mode; see bagel.sim.discrete.engine)",
    )
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="write cProfile stats of the whole run to this file (implies --jobs 1)",
    )
    r.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="policies simulated at once, one process each, the costliest first (default: one per core)",
    )
    from bagel.sim.chaos.command import add_chaos_parser

    add_chaos_parser(sub)
    return p


def run_scenario(
    scenario: Scenario,
    policy_names: list[str],
    *,
    workers: int | None = None,
    hours: float | None = None,
    seed: int | None = None,
    progress: bool = False,
    jobs: int = 1,
) -> tuple[list[EngineResult], float]:
    """Simulate each policy (`jobs` at once); returns the results and the wall time in seconds."""
    pols = [registry.get(n) for n in policy_names]
    t0 = time.perf_counter()
    if progress:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(
            TextColumn("{task.description:<16}"),
            BarColumn(),
            TextColumn("{task.percentage:>5.1f}%"),
            TimeElapsedColumn(),
        ) as bar:
            tasks = [bar.add_task(p.name, total=1.0) for p in pols]
            results = run_policies(
                scenario,
                pols,
                workers=workers,
                hours=hours,
                seed=seed,
                jobs=jobs,
                progress=lambda k, f: bar.update(tasks[k], completed=f),
            )
    else:
        results = run_policies(scenario, pols, workers=workers, hours=hours, seed=seed, jobs=jobs)
    return results, time.perf_counter() - t0


def _cmd_run(a: argparse.Namespace) -> int:
    try:
        sc = load_sim_scenario(a.scenario)
    except SimScenarioError as e:
        print(f"bagel-sim: {e}", file=sys.stderr)
        return 2
    if a.lease_mode:
        sc = replace(sc, engine=replace(sc.engine, lease_mode=a.lease_mode))
    names = [n.strip() for n in a.policies.split(",")] if a.policies else list(sc.scenario.policies)
    for flag, v in (("--workers", a.workers), ("--hours", a.hours), ("--jobs", a.jobs)):
        if v is not None and v <= 0:
            print(f"bagel-sim: {flag} must be positive", file=sys.stderr)
            return 2
    try:
        for n in names:
            registry.get(n)
    except ValueError as e:
        print(f"bagel-sim: --policies: {e}", file=sys.stderr)
        return 2
    check_dir_arg("--out", a.out)
    a.out.mkdir(parents=True, exist_ok=True)
    progress = not a.no_progress and sys.stderr.isatty()
    if a.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    # a profile sees this process only: then the policies run here, one after the other
    jobs = 1 if a.profile else (a.jobs or default_jobs(len(names)))
    cpu0 = _cpu_s()
    results, wall = run_scenario(sc, names, workers=a.workers, hours=a.hours, seed=a.seed, progress=progress, jobs=jobs)
    cpu = _cpu_s() - cpu0
    if a.profile:
        prof.disable()
        prof.dump_stats(str(a.profile))
    seed = sc.scenario.seed if a.seed is None else a.seed
    summary = summarize(results, target_samples=sc.scenario.target_samples_per_cell)
    summary["wall_s"] = wall
    meta = run_meta(results, scenario=sc.scenario.name, seed=seed, lease_mode=sc.engine.lease_mode)
    # CPU seconds of this process and its policy processes: on a shared machine a fairer
    # figure than wall time
    meta["cpu_s"] = cpu
    meta["jobs"] = jobs
    write_json(summary, a.out / "summary.json")
    write_json(meta, a.out / "run.json")
    md = markdown(summary, meta)
    (a.out / "summary.md").write_text(md)
    plot(results, a.out)
    print(md)
    print(f"wrote {a.out / 'summary.json'}, {a.out / 'summary.md'} and plots in {wall:.1f} s")
    return 0


def _cpu_s() -> float:
    """CPU seconds of this process plus its finished children (the policy processes)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.command == "run":
        return guarded("bagel-sim: ", lambda: _cmd_run(a))
    return guarded("bagel-sim chaos: ", lambda: int(a.func(a)))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
