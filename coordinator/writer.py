"""Durable writes off the event loop, in order, with group commit.

The server must not answer before a transition's records are in SQLite (design
section 3), but an fsync can take milliseconds (or, on a busy disk, much longer) and must
not stall every other request. So `AsyncWriter` owns one thread that writes batches in
submission order; a handler awaits the future of its own batch. When batches queue up
behind a slow fsync, the thread takes all that are waiting (up to `max_group`) and
writes them in ONE transaction with one fsync, then resolves all their futures: group
commit, as databases do it. Each batch stays all-or-nothing (it is inside one
transaction); a failure fails every batch of the group, which the server treats as
fatal (see `CoordinatorApp._die`).

Ordering: FIFO, so a future that completes implies every earlier batch is durable;
`barrier()` awaits the latest one. `run(fn)` runs a function on the writer thread in the
same order (the checkpoint index is written this way).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from bagel.coordinator.store import Store

_STOP = object()


def _resolve(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if fut.done():  # the awaiting handler was cancelled (client went away): nothing to tell
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def _post(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    try:
        loop.call_soon_threadsafe(_resolve, fut, result, exc)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        pass


class AsyncWriter:
    """One writer thread for one Store (see the module docstring)."""

    def __init__(self, store: Store, *, max_group: int = 512) -> None:
        self.store = store
        self.max_group = max_group
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._last: asyncio.Future[Any] | None = None
        self.batches = 0  # submitted batches
        self.transactions = 0  # SQLite transactions actually run (<= batches)
        self._thread = threading.Thread(target=self._run, name="bagel-store-writer", daemon=True)
        self._thread.start()
        self._closed = False

    # ------------------------------------------------------------------ event-loop side

    def submit(self, effects: Sequence[Any], now_ms: int) -> asyncio.Future[None]:
        """Queue one batch; the future completes when it is durable (or fails)."""
        if self._closed:
            raise RuntimeError("writer is closed")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._q.put(("write", (list(effects), now_ms), fut, loop))
        self._last = fut
        self.batches += 1
        return fut

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` on the writer thread, after everything submitted before it."""
        if self._closed:
            raise RuntimeError("writer is closed")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._q.put(("call", (fn, args), fut, loop))
        self._last = fut
        return await fut

    def pending(self) -> bool:
        last = self._last
        return last is not None and not last.done()

    async def barrier(self) -> None:
        """Wait until everything submitted so far is durable (free when nothing is pending)."""
        last = self._last
        if last is not None and not last.done():
            await asyncio.shield(last)

    async def close(self) -> None:
        """Drain, then stop the thread. Earlier failures are not re-raised here."""
        if self._closed:
            return
        try:
            await self.barrier()
        except Exception:
            pass
        self._closed = True
        self._q.put(_STOP)
        await asyncio.to_thread(self._thread.join)

    # ------------------------------------------------------------------ writer thread

    def _run(self) -> None:
        carry: Any = None
        while True:
            item = carry if carry is not None else self._q.get()
            carry = None
            if item is _STOP:
                return
            kind, payload, fut, loop = item
            if kind == "call":
                fn, args = payload
                try:
                    result, exc = fn(*args), None
                except BaseException as e:  # handed to the awaiting coroutine
                    result, exc = None, e
                _post(loop, fut, result, exc)
                continue
            group = [item]
            while len(group) < self.max_group:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is _STOP or nxt[0] != "write":
                    carry = nxt  # keep the order: handle it after this group
                    break
                group.append(nxt)
            try:
                self.store.write_many([g[1] for g in group])
                exc = None
            except BaseException as e:
                exc = e
            self.transactions += 1
            for _kind, _payload, f, lp in group:
                _post(lp, f, None, exc)
