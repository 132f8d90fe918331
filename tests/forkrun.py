"""Test launcher: import a command's code once, fork one real process per case.

    python tests/forkrun.py coordinator|worker|sim HOLD_S CASES_JSON

Importing torch, grpc and hivemind costs seconds of CPU per process, and the signal matrix
(tests/test_signals.py) and the bad-input table (tests/test_cli.py) have dozens of cases,
so this script imports `bagel.coordinator.cli` (or `bagel.worker.cli`, `bagel.sim.cli`) and
what they load once, and then forks one child per case. Each child starts its own session (so a signal to its process
group reaches it, its DHT child and p2pd, and nothing else), sends its stdout and stderr
to the case's files, and runs the real command line through the real `main`, leaving the
interpreter the usual way (atexit handlers included). The launcher prints `pid NAME PID`
per case, then `exit NAME CODE` as each child ends.

A case with `"hold": true` holds its graceful stop open for HOLD_S seconds first (the
coordinator's `CoordinatorHandle.stop`, the worker's `Agent._close`, patched in that child
only), so that the test's second signal lands while the stop is still running.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

prog, hold_s, cases = sys.argv[1], float(sys.argv[2]), json.loads(sys.argv[3])
if prog == "coordinator":
    import bagel.coordinator.preflight  # noqa: F401  (and what serve loads before refusing)
    import bagel.models.data  # noqa: F401
    from bagel.coordinator import cli as command
    from bagel.coordinator.daemon import CoordinatorHandle as Held

    held_method = "stop"
elif prog == "sim":
    from bagel.sim import cli as command  # type: ignore[no-redef]

    Held, held_method = None, ""  # type: ignore[assignment]
else:
    from bagel.worker import cli as command  # type: ignore[no-redef]
    from bagel.worker.agent import Agent as Held  # type: ignore[assignment]

    held_method = "_close"

mine: dict | None = None
pids: dict[int, str] = {}
for case in cases:
    pid = os.fork()
    if pid == 0:
        mine = case
        break
    pids[pid] = case["name"]
    print(f"pid {case['name']} {pid}", flush=True)

if mine is None:  # the launcher: report how each case ended
    while pids:
        pid, status = os.wait()
        print(f"exit {pids.pop(pid)} {os.waitstatus_to_exitcode(status)}", flush=True)
    sys.exit(0)

os.setsid()
for fd, path in ((1, mine["out"]), (2, mine["err"])):
    f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(f, fd)
    os.close(f)
if mine.get("hold") and Held is not None:
    original = getattr(Held, held_method)

    async def held(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        await asyncio.sleep(hold_s)
        return await original(self, *args, **kwargs)

    setattr(Held, held_method, held)
sys.argv = [f"bagel-{prog}", *mine["argv"]]
sys.exit(command.main(mine["argv"]))
