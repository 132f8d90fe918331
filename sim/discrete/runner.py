"""Run several policies' engines, one process each, and collect their results.

The policies of a `bagel-sim run` share nothing: each `Engine` builds its own population,
coordinator core and random generators from the scenario seed. So they can run in
parallel processes and give exactly what a sequential run gives (the determinism test in
tests/test_sim_engine.py compares the two). With three policies on two cores this roughly
halves the wall time of a big scenario.

Processes are forked where the platform allows (no re-import, no pickling of the
scenario); each sends its progress and finally its pickled `EngineResult` over one queue.
Up to `jobs` run at once (by default one per core), the costliest first
(`SimPolicy.sim_cost`, then the order given): longest-processing-time-first packing, so
the policy that takes longest (bagel, which simulates the most rounds) has a core to
itself from the start and the others queue on the rest. The last result then arrives
after about max(the longest policy, the others' CPU time / the other cores). Running
more processes than cores would share the longest policy's core with the others and
make it finish later.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import queue
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from bagel.sim.discrete.engine import Engine, EngineResult
from bagel.sim.discrete.policies import SimPolicy
from bagel.sim.discrete.scenario import Scenario

Progress = Callable[[int, float], None]  # (policy index, fraction done)


def default_jobs(n_policies: int) -> int:
    """One policy per core, at most all of them at once."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover (not Linux)
        cores = os.cpu_count() or 1
    return max(1, min(n_policies, cores))


def run_policies(
    scenario: Scenario,
    pols: Sequence[SimPolicy],
    *,
    workers: int | None = None,
    hours: float | None = None,
    seed: int | None = None,
    jobs: int = 1,
    progress: Progress | None = None,
) -> list[EngineResult]:
    """Simulate each policy; results in the order of `pols`. jobs <= 1: in this process."""
    kw: dict[str, Any] = {"workers": workers, "hours": hours, "seed": seed}  # Engine's keywords
    if jobs <= 1 or len(pols) <= 1:
        out = []
        for k, p in enumerate(pols):
            cb = None if progress is None else (lambda f, k=k: progress(k, f))
            out.append(Engine(scenario, p, **kw).run(cb))
        return out
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else None)
    q = ctx.Queue()
    procs: dict[int, mp.process.BaseProcess] = {}
    results: dict[int, EngineResult] = {}
    pending = sorted(range(len(pols)), key=lambda k: -pols[k].sim_cost)  # costliest first (stable)
    try:
        while pending or procs:
            while pending and len(procs) < jobs:
                k = pending.pop(0)
                procs[k] = ctx.Process(
                    target=_child, args=(q, k, scenario, pols[k], kw, progress is not None), daemon=True
                )
                procs[k].start()
            try:
                kind, k, payload = q.get(timeout=1.0)
            except queue.Empty:
                for k, pr in procs.items():
                    if not pr.is_alive() and k not in results:
                        # it may have sent its result just before exiting: look once more
                        try:
                            kind, k2, payload = q.get(timeout=1.0)
                        except queue.Empty:
                            raise RuntimeError(
                                f"policy {pols[k].name}: its process died (exit code {pr.exitcode})"
                            ) from None
                        _handle(kind, k2, payload, pols, results, procs, progress)
                        break
                continue
            _handle(kind, k, payload, pols, results, procs, progress)
    finally:
        for pr in procs.values():
            if pr.is_alive():
                pr.kill()
            pr.join()
        q.close()
    return [results[k] for k in range(len(pols))]


def _handle(
    kind: str,
    k: int,
    payload: object,
    pols: Sequence[SimPolicy],
    results: dict[int, EngineResult],
    procs: dict[int, mp.process.BaseProcess],
    progress: Progress | None,
) -> None:
    if kind == "progress":
        if progress is not None:
            progress(k, float(payload))  # type: ignore[arg-type]
    elif kind == "result":
        results[k] = payload  # type: ignore[assignment]
        procs.pop(k).join()
    else:
        raise RuntimeError(f"policy {pols[k].name} failed in its process:\n{payload}")


def _child(q: mp.queues.Queue, k: int, scenario: Scenario, policy: SimPolicy, kw: dict, report: bool) -> None:
    # No cyclic garbage collector in a policy's process: the engine makes no reference
    # cycles (a full collection after a 10,000-worker day finds 0 objects, peak memory is
    # the same), and its full collections over ~10^6 live objects cost ~3% of the run.
    # The process ends with the run, so nothing accumulates beyond it.
    gc.disable()
    try:
        cb = (lambda f: q.put(("progress", k, f))) if report else None
        q.put(("result", k, Engine(scenario, policy, **kw).run(cb)))
    except BaseException:  # noqa: BLE001 (handed to the parent, which raises)
        q.put(("error", k, traceback.format_exc()))
    q.close()
    q.join_thread()  # flush the result before the process exits
