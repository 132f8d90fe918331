"""An exchange the worker abandons frees what it held at once, by reference counting.

A worker abandons an exchange whenever its attempt is aborted (a member died, the deadline
passed) or the coordinator moves on: `Orders` cancels the exchange's task. The task then
holds its CancelledError, whose traceback holds the exchange's frames, and with them the
contribution, the decoded parts and the round's state: several float32 copies of the cell's
parameters. If anything those frames reach held the task, that would be a reference cycle,
and Python's cyclic collector, which runs by counts of objects allocated, not bytes, let such
copies outlive whole rounds (measured on a DiT-S/2 worker with `bench/worker_memory.py`: 5.7
copies of garbage in one, through the round's `RoundWork`, which held its exchange's task).
Here the collector is off: what the exchange held must go as soon as its task is dropped.
"""

from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any

import pytest
import torch

from bagel.worker import averaging
from bagel.worker.parts import prepare_contribution
from bagel.worker.roundwork import RoundWork
from bagel.worker.trainer import InnerPlan, TrainResult

from dataplane_peers import peers, torch_shm_manager  # noqa: F401 (autouse fixture)
from test_statesync_updates import CELL, base_state, close, reduce_order, worker


async def _until(cond: Any) -> None:
    while not cond():
        await asyncio.sleep(0.01)


@pytest.mark.timeout(120)
async def test_an_abandoned_exchange_frees_its_contribution_without_the_cyclic_collector(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[weakref.ref] = []

    def prepare(*args: Any, **kw: Any) -> Any:
        own = prepare_contribution(*args, **kw)
        made.append(weakref.ref(own))
        return own

    monkeypatch.setattr(averaging, "prepare_contribution", prepare)
    async with peers(3) as ps:
        state = base_state()
        members = [(p, await worker(p, state, 4)) for p in ps[:2]]  # the third never contributes
        order = reduce_order(list(ps))
        works = []
        for i, (_, o) in enumerate(members):
            w = RoundWork(CELL, 5, 1, i, 3, InnerPlan(1, 1, 1), 0)
            w.result = TrainResult(samples=10, mean_loss=0.0, steps=1, compute_s=0.0, completed=True)
            g = torch.Generator().manual_seed(i)
            w.delta = {n: 0.01 * torch.randn(t.shape, generator=g) for n, t in state.weights.items()}
            w.reduce_attempt, w.contributors = 1, order.contributors
            o.work = w
            works.append(w)
        gc.collect()
        gc.disable()
        try:
            for (_, o), w in zip(members, works, strict=True):
                o._spawn_exchange(w, o._reduce(w, order), "reduce")  # as `_start_reduce` does
            await asyncio.wait_for(_until(lambda: len(made) == 2), 60)  # both contributions made ...
            await asyncio.sleep(0.2)  # ... and on their way; both members wait for the third
            tasks = [w.reduce_task for w in works]
            assert all(t is not None and not t.done() for t in tasks)
            for t in tasks:
                t.cancel()  # the attempt is abandoned
            await asyncio.wait(tasks)
            assert all(t.cancelled() for t in tasks)
            assert [w.reduce_task for w in works] == [None, None]  # the round's work let go of it
            for _, o in members:
                o.host.tasks.clear()  # the agent's spawn forgets a task once it ended; the test host keeps them
            del tasks, t
            await asyncio.sleep(0.2)  # the loop runs the cancellations' callbacks
            assert [r() for r in made] == [None, None]
        finally:
            gc.enable()
            await close(*(o for _, o in members))
