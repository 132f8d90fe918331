"""Waiting for a coordinator that is not there yet: retries with backoff and a visible countdown.

A volunteer often starts before the operator's coordinator is up, or loses it for a while
(a restart, a network cut). Then the first steps of `Agent.run` fail: the DHT node cannot
reach the join string's bootstrap peers (`BootstrapUnreachable`), or it reaches them but
finds no coordinator record (`CoordinatorNotFound`). Neither is a reason to exit: `retry`
runs the step again after a capped exponential delay with jitter (`delay_s`: 2, 4, 8, ...
up to `MAX_DELAY_S`, so a thousand volunteers do not come back in one wave), shows what is
wrong and a countdown to the next try, and gives up only when the worker is asked to stop.
Once registered, the link (`worker/link.py`) rides out outages the same way.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

from bagel.worker.display import Display

T = TypeVar("T")

FIRST_DELAY_S = 2.0
MAX_DELAY_S = 60.0
JITTER = 0.2  # each delay is scaled by a uniform factor in [1 - JITTER, 1 + JITTER]
PLAIN_COUNTDOWN_EVERY_S = 10  # a plain-text countdown line this often during a long wait


def delay_s(attempt: int, rng: random.Random) -> float:
    """The wait after failed attempt `attempt` (1-based): FIRST_DELAY_S * 2^(attempt-1), capped, jittered."""
    base = min(MAX_DELAY_S, FIRST_DELAY_S * 2.0 ** min(attempt - 1, 30))
    return base * rng.uniform(1.0 - JITTER, 1.0 + JITTER)


async def retry(
    step: Callable[[], Awaitable[T]],
    *,
    what: str | Callable[[BaseException], str],
    hint: str | Callable[[BaseException], str],
    retryable: tuple[type[BaseException], ...],
    display: Display,
    stop: asyncio.Event,
    rng: random.Random | None = None,
) -> T | None:
    """Run `step` until it succeeds (its result) or `stop` is set (None). A `retryable`
    failure is shown as one warning (`what`, the reason, `hint`, the next try) and waited
    out with a countdown; any other exception propagates. `what` and `hint` may be functions
    of the failure, when one step can fail retryably in more than one way."""
    rng = rng or random.Random()
    attempt = 0
    while not stop.is_set():
        try:
            return await step()
        except retryable as e:
            attempt += 1
            wait = delay_s(attempt, rng)
            display.event(
                "waiting",
                level="warning",
                message=f"{_say(what, e)}: {_reason(e)}; {_say(hint, e)}; retrying in {wait:.0f}s (attempt {attempt})",
            )
            if await _countdown(wait, display, stop):
                return None
    return None


def _say(text: str | Callable[[BaseException], str], e: BaseException) -> str:
    return text if isinstance(text, str) else text(e)


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1][:200] if text else type(e).__name__


async def _countdown(wait_s: float, display: Display, stop: asyncio.Event) -> bool:
    """Sleep `wait_s`, showing the seconds left; True if `stop` was set meanwhile."""
    loop = asyncio.get_running_loop()
    end = loop.time() + wait_s
    last_line = int(wait_s)
    while True:
        left = end - loop.time()
        if left <= 0:
            display.update(phase="connecting")
            return False
        display.update(phase=f"waiting for the coordinator: retry in {left:.0f}s")
        if display.mode == "plain" and int(left) <= last_line - PLAIN_COUNTDOWN_EVERY_S:
            last_line = int(left)
            display.event("waiting", message=f"retrying in {left:.0f}s")
        try:
            await asyncio.wait_for(stop.wait(), min(1.0, left))
            return True
        except TimeoutError:
            pass


__all__ = ["FIRST_DELAY_S", "MAX_DELAY_S", "delay_s", "retry"]
