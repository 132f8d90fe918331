"""The worker's stop budget (`bagel.worker.stopping`): steps share one deadline, a step
that overruns is cancelled and left behind (even one that ignores its cancellation), and
the budget says which step it is in."""

from __future__ import annotations

import asyncio
import math
import threading

from bagel.worker.stopping import StopBudget, in_daemon_thread


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_steps_share_one_deadline() -> None:
    clock = Clock()
    b = StopBudget(30.0, reserve_s=4.0, clock=clock)
    assert b.left() == math.inf and not b.started
    b.start()
    clock.t += 10.0
    b.start()  # a second start keeps the first moment
    assert b.left() == 16.0
    clock.t += 100.0
    assert b.left() == 0.0
    # the reserve never takes more than half the bound
    assert StopBudget(2.0, reserve_s=4.0).reserve_s == 1.0


def test_an_overrunning_step_is_left_behind_and_the_rest_still_run() -> None:
    async def main() -> None:
        b = StopBudget(0.6, reserve_s=0.0)
        b.start()
        release = asyncio.Event()

        async def stubborn() -> None:  # ignores its cancellation: must not hold the stop
            while not release.is_set():
                try:
                    await asyncio.sleep(10)
                except asyncio.CancelledError:
                    continue

        async def quick() -> str:
            return "closed"

        async def broken() -> None:
            raise RuntimeError("boom")

        ok, _ = await b.run("stuck", stubborn(), cap_s=0.2)
        assert not ok
        assert await b.run("quick", quick()) == (True, "closed")
        assert await b.run("broken", broken()) == (True, None)  # raised: the stop goes on
        ok, _ = await b.run("the rest", asyncio.sleep(10))  # capped by what is left of 0.6 s
        assert not ok
        assert [name for name in b.summary()] == ["stuck (overran)", "quick", "broken", "the rest (overran)"]
        assert "done: stuck" in b.progress() and "between steps" in b.progress()
        release.set()

    asyncio.run(main())


def test_progress_names_the_step_in_progress_and_a_pause_records_nothing() -> None:
    async def main() -> None:
        b = StopBudget(30.0)
        await b.run("a pause's step", asyncio.sleep(0))  # not stopping: no record
        assert b.summary() == {}
        b.start()
        seen: list[str] = []

        async def look() -> None:
            seen.append(b.progress())

        await b.run("closing the DHT", look())
        assert seen[0].startswith("in step 'closing the DHT' for ")
        assert list(b.summary()) == ["closing the DHT"]
        b.enter("the exit")  # not awaited here, still named by the watchdog's line
        assert b.progress().startswith("in step 'the exit' for ") and "done: closing the DHT" in b.progress()

    asyncio.run(main())


def test_a_daemon_thread_step_does_not_hold_the_loop_teardown() -> None:
    gate = threading.Event()

    async def main() -> bool:
        b = StopBudget(0.3, reserve_s=0.0)
        b.start()
        ok, _ = await b.run("blocked", in_daemon_thread(gate.wait, "blocked-call"), cap_s=0.2)
        assert await asyncio.wait_for(in_daemon_thread(lambda: 7, "quick-call"), 5) == 7
        return ok

    # asyncio.run joins its default executor's threads without a bound; a daemon thread is not one
    assert asyncio.run(main()) is False
    gate.set()
