"""The worker's graceful stop under one budget: every step of it runs under one deadline.

The steps are finishing the running exchange, the Leave call, closing the servers, the p2p
replica and the DHT. A stop made of steps that are each bounded can still overrun its
documented bound, because the bounds add up. So every step here gets at most what is left
of one deadline, taken when the stop was requested: `stop_bound_s` minus `EXIT_RESERVE_S`.
The reserve is kept for what runs after the agent returns: the event loop's teardown,
ending the children, the process exit. A step that overruns its share is cancelled and
left behind, never awaited, because a step that ignores its cancellation must not hold the
stop either. The stop then goes on with the next step.

The budget also knows which step is running and how long each one took. The watchdog
(`bagel.protocol.shutdown.StopSignals`) prints that if the process still overruns, and the
worker reports it in its `stop-steps` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

# Kept out of the steps' budget for what runs after `Agent.run` returns: the event loop's
# teardown (cancelling what is left, joining its executor's threads), ending the children
# (`end_descendants`: SIGTERM, SIGKILL after 2 s) and the interpreter's exit.
EXIT_RESERVE_S = 4.0


class StopBudget:
    """One graceful stop's deadline and the record of its steps (`run`)."""

    def __init__(
        self, bound_s: float, reserve_s: float = EXIT_RESERVE_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.bound_s = bound_s
        self.reserve_s = min(reserve_s, bound_s / 2)
        self._clock = clock
        self.started_at: float | None = None
        self.step = ""  # the step running now ("" between steps)
        self.step_since = 0.0
        self.steps: list[tuple[str, float, bool]] = []  # (step, seconds, finished in time)

    def start(self) -> None:
        """The stop begins now (once: a later call keeps the first moment)."""
        if self.started_at is None:
            self.started_at = self._clock()

    @property
    def started(self) -> bool:
        return self.started_at is not None

    def left(self) -> float:
        """Seconds left for the steps (infinite before the stop began)."""
        if self.started_at is None:
            return math.inf
        return max(0.0, self.started_at + self.bound_s - self.reserve_s - self._clock())

    def elapsed(self) -> float:
        return 0.0 if self.started_at is None else self._clock() - self.started_at

    async def run(self, name: str, aw: Awaitable[T], cap_s: float = math.inf) -> tuple[bool, T | None]:
        """Await `aw` as the step `name` for at most `cap_s` and never past the deadline.

        Returns (True, its result) if it finished in time; (False, None) if it overran (it is
        cancelled and left behind) or raised (the stop goes on either way)."""
        budget = min(cap_s, self.left())
        task = asyncio.ensure_future(aw)
        self.step, self.step_since = name, self._clock()
        try:
            done, _ = await asyncio.wait({task}, timeout=budget if math.isfinite(budget) else None)
        finally:
            took = self._clock() - self.step_since
            self.step = ""
        if not done:
            task.cancel()
            self._note(name, took, False)
            return False, None
        self._note(name, took, True)
        if task.cancelled() or task.exception() is not None:  # retrieved: no "never retrieved" warning
            return True, None
        return True, task.result()

    def enter(self, name: str) -> None:
        """Mark `name` as the step in progress from now on, for what is not awaited here (the
        event loop's teardown after the agent returns, the process exit)."""
        self.step, self.step_since = name, self._clock()

    def _note(self, name: str, took: float, ok: bool) -> None:
        if self.started_at is not None:  # the same steps serve a pause, which is no stop
            self.steps.append((name, took, ok))

    def progress(self) -> str:
        """What the stop is doing now and what it did, for a line on stderr (thread-safe enough:
        it only reads)."""
        done = ", ".join(f"{n} {s:.1f}s{'' if ok else ' (overran)'}" for n, s, ok in list(self.steps))
        now = f"in step '{self.step}' for {self._clock() - self.step_since:.1f}s" if self.step else "between steps"
        return f"{now}; after {self.elapsed():.1f}s of stopping; done: {done or 'nothing yet'}"

    def summary(self) -> dict[str, float]:
        """Each finished step's seconds (an overrun step's name ends in ' (overran)')."""
        return {(n if ok else f"{n} (overran)"): round(s, 3) for n, s, ok in self.steps}


def in_daemon_thread(fn: Callable[[], Any], name: str) -> asyncio.Future[Any]:
    """Run the blocking `fn` on a daemon thread of its own; a future for its result.

    For a blocking call that must not hold the process if it never returns: a thread of the
    loop's default executor would be joined by the loop's teardown and at the interpreter's
    exit, and neither join has a bound."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def body() -> None:
        try:
            result, error = fn(), None
        except BaseException as e:  # noqa: BLE001  (handed to the awaiting coroutine)
            result, error = None, e
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=body, name=name, daemon=True).start()
    return fut


__all__ = ["EXIT_RESERVE_S", "StopBudget", "in_daemon_thread"]
