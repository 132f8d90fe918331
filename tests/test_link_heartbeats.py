"""The worker's heartbeat loop (`worker/link.py`): a phase change is never left waiting
for the interval, and a changed instruction its watch answers is taken at once.

The link's coordinator client is replaced by a recorder (these tests are about the loop's
timing of requests, not the RPC); the interval is a minute, so a heartbeat that waited for
it would miss the tests' few-second wait by far.
"""

from __future__ import annotations

import asyncio
import io
from types import SimpleNamespace
from typing import Any

import pytest

from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.identity import Identity
from bagel.protocol.joinstring import JoinInfo
from bagel.worker.display import Display
from bagel.worker.link import CoordinatorLink

from simworkers import fake_peer_id

pytestmark = pytest.mark.timeout(30)

INTERVAL_S = 60.0
WAIT_S = 5.0


class _Owner:
    """Turns READY when told to (the test decides when: during the call or its answer)."""

    def __init__(self) -> None:
        self.phase = pb.PHASE_TRAINING
        self.link: CoordinatorLink | None = None
        self.ready_on_answer = False
        self.instructions: list[pb.Instruction] = []

    def heartbeat_request(self) -> pb.HeartbeatRequest:
        return pb.HeartbeatRequest(phase=self.phase)

    def become_ready(self) -> None:
        assert self.link is not None
        self.phase = pb.PHASE_READY
        self.link.wake_heartbeat()

    def on_instruction(self, instr: pb.Instruction) -> None:
        self.instructions.append(instr)
        if self.ready_on_answer and self.phase != pb.PHASE_READY:
            self.become_ready()  # the answer's instruction completed at once


class _Client:
    """Records each heartbeat's phase; the first one is held until `release` is set.
    Heartbeats answer an instruction tagged 1. A watch is held until the test sets
    `watch_release` (answering `watch_answer`), as a coordinator holds it while nothing
    changes; `on_watch` runs while it is held."""

    def __init__(self) -> None:
        self.phases: list[int] = []
        self.in_flight = asyncio.Event()
        self.release = asyncio.Event()
        self.second = asyncio.Event()
        self.watches: list[tuple[int, int]] = []  # (known_tag, wait_ms)
        self.watching = asyncio.Event()
        self.watch_release = asyncio.Event()
        self.watch_answer = pb.WatchInstructionResponse()

    async def watch_instruction(self, known_tag: int, wait_ms: int) -> pb.WatchInstructionResponse:
        self.watches.append((known_tag, wait_ms))
        self.watching.set()
        await self.watch_release.wait()
        return self.watch_answer

    async def call(self, name: str, req: pb.HeartbeatRequest) -> Any:
        assert name == "Heartbeat"
        self.phases.append(req.phase)
        if len(self.phases) == 1:
            self.in_flight.set()
            await self.release.wait()
        else:
            self.second.set()
        return SimpleNamespace(instruction=pb.Instruction(tag=1))


def _link(owner: _Owner, client: _Client) -> CoordinatorLink:
    join = JoinInfo("run", Identity.generate().public_key, ("/ip4/127.0.0.1/tcp/1/p2p/" + fake_peer_id("j"),))
    link = CoordinatorLink(owner, join, Identity.generate(), Display("json", stream=io.StringIO()), asyncio.Event())  # type: ignore[arg-type]
    link.client = client  # type: ignore[assignment]
    link.hb_interval_s = INTERVAL_S
    owner.link = link
    return link


@pytest.mark.parametrize("when", ["while the heartbeat is in flight", "while its answer is handled"])
async def test_a_phase_change_during_a_heartbeat_is_sent_at_once(when: str) -> None:
    """The wake used to be cleared after the answer came back, so a READY reached while a
    heartbeat was on the wire (or by the answer itself: a round all trained ahead is READY
    on its TRAIN) waited a whole interval; the round could not freeze meanwhile."""
    owner, client = _Owner(), _Client()
    owner.ready_on_answer = when == "while its answer is handled"
    link = _link(owner, client)
    link.start_heartbeats()
    try:
        await asyncio.wait_for(client.in_flight.wait(), WAIT_S)
        if not owner.ready_on_answer:
            owner.become_ready()
        client.release.set()
        await asyncio.wait_for(client.second.wait(), WAIT_S)
        assert client.phases[:2] == [pb.PHASE_TRAINING, pb.PHASE_READY]
    finally:
        await link.stop_heartbeats()


async def test_without_a_phase_change_the_next_heartbeat_waits_for_the_interval() -> None:
    """The other side of the rule: an answer that changes nothing does not start another
    heartbeat at once (no busy loop)."""
    owner, client = _Owner(), _Client()
    link = _link(owner, client)
    client.release.set()
    link.start_heartbeats()
    try:
        await asyncio.wait_for(client.in_flight.wait(), WAIT_S)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(client.second.wait(), 0.5)
        assert client.phases == [pb.PHASE_TRAINING]
        assert client.watches == [], "a training worker holds no watch"
    finally:
        await link.stop_heartbeats()


async def test_a_changed_instruction_from_the_watch_is_taken_and_heartbeated_at_once() -> None:
    """Between heartbeats a waiting worker holds a watch with the last answer's tag; a changed
    instruction it answers reaches the owner, and the next heartbeat goes at once (it says
    what the worker now does), not an interval later."""
    owner, client = _Owner(), _Client()
    owner.phase = pb.PHASE_READY  # waiting for the freeze
    link = _link(owner, client)
    client.release.set()
    link.start_heartbeats()
    try:
        await asyncio.wait_for(client.watching.wait(), WAIT_S)
        assert client.watches == [(1, int(INTERVAL_S * 1000))]
        assert not client.second.is_set(), "held: no heartbeat while nothing changed"
        freeze = pb.Instruction(order=pb.ORDER_REDUCE, round=1, tag=2)
        client.watch_answer = pb.WatchInstructionResponse(instruction=freeze, changed=True)
        client.watch_release.set()
        await asyncio.wait_for(client.second.wait(), WAIT_S)
        assert owner.instructions[1] == freeze
    finally:
        await link.stop_heartbeats()


async def test_a_watch_answer_is_dropped_when_another_call_was_answered_meanwhile() -> None:
    """Answers are taken in request order: a report answered while the watch was held may
    be newer than the watch's answer, so that answer is dropped (and a heartbeat asks again)."""
    owner, client = _Owner(), _Client()
    owner.phase = pb.PHASE_REDUCING  # its report awaits the verdict
    link = _link(owner, client)
    client.release.set()
    link.start_heartbeats()
    try:
        await asyncio.wait_for(client.watching.wait(), WAIT_S)
        link.answers += 1  # what `rpc` counts when another call (a ReportRound) is answered
        stale = pb.Instruction(order=pb.ORDER_REDUCE, round=1, tag=2)
        client.watch_answer = pb.WatchInstructionResponse(instruction=stale, changed=True)
        client.watch_release.set()
        await asyncio.wait_for(client.second.wait(), WAIT_S)
        assert stale not in owner.instructions
    finally:
        await link.stop_heartbeats()
