"""One round's work as the agent tracks it, and the two heavy steps it runs: train and reduce.

`RoundWork` is what a worker is doing about one attempt of one round of its cell: training
(in a thread), ready (pseudo-gradient computed), reducing (exchange running for one
`reduce_attempt`) or reported (`pending` outcome waiting for the commit). The agent keeps
at most one. The committed `CellState` is only read here: the round trains a separate
model and the outer step runs on a clone, so abandoning a round at any point is a rollback
for free, and a re-frozen exchange (higher reduce_attempt) reuses the kept delta.

Also here: `corrupt`, the `--byzantine` fault modes applied to the
pseudo-gradient this worker contributes, and `follow_round` for ranks > 0 of a DDP worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from bagel.compression import ErrorFeedback
from bagel.models.data import shard
from bagel.protocol.convert import part_weight_from_wire
from bagel.protocol.envelope import DEFAULT_MAX_CLOCK_SKEW_S
from bagel.protocol.messages import Instruction, PartAudit
from bagel.protocol.runspec import parse_spec
from bagel.robust import attacks
from bagel.worker import ddp
from bagel.worker.catchup import CommittedUpdate
from bagel.worker.diloco import CellState, OuterConfig, outer_step, pseudo_gradient
from bagel.worker.heldout import SliceLossAudit
from bagel.worker.parts import Layout
from bagel.worker.trainer import (
    CellRuntime,
    InnerPlan,
    RoundKey,
    StepProgress,
    TrainResult,
    build_runtime,
    pick_device,
    round_indices,
)

BYZANTINE_MODES = (
    "sign-flip",
    "scale",
    "nan",
    "zero",
    "stale",
    "alie",
    "ipm",
    "freeload-zero",
    "freeload-replay",
    "budget-liar",
    "bad-reducer",
)
# bad-reducer: the part this worker reduces is scaled by this before it is encoded and signed
BAD_REDUCER_SCALE = 1e3
BYZANTINE_SCALE = 100.0
# budget-liar: what it claims (its profile's samples/s, and x this many samples done in 1/this of the time)
LIAR_SAMPLES_PER_S = 1e9
LIAR_FACTOR = 10
# How long a worker's exchange may run (`exchange_timeout_s`): until the coordinator's
# reduce deadline for the attempt plus the clock skew the coordinator accepts on signed
# requests, so a worker whose clock runs ahead does not give up an exchange the
# coordinator still waits for; 60 s where the coordinator names no deadline (an older
# one); never less than a second, nor more than a day whatever the coordinator says.
DEFAULT_REDUCE_TIMEOUT_S = 60.0
REDUCE_DEADLINE_GRACE_S = DEFAULT_MAX_CLOCK_SKEW_S
MIN_REDUCE_TIMEOUT_S = 1.0
MAX_REDUCE_TIMEOUT_S = 86400.0


@dataclass
class ReduceOutcome:
    state: CellState  # committed state + the outer step: the candidate of the round
    state_hash: str
    residuals: dict[str, torch.Tensor]  # error feedback after this exchange
    bytes_sent: int
    bytes_received: int
    comm_s: float
    audit: PartAudit | None = None  # what we saw of the part we reduced, for the coordinator
    # the commit guard's measurements (worker/heldout.py), None until measured
    heldout_loss: float | None = None
    heldout_loss_base: float | None = None
    encode_s: float = 0.0  # of comm_s: encoding our contribution
    outer_step_s: float = 0.0  # the outer step and the state hash (and the kept update's part digests)
    paths: dict[str, str] = field(default_factory=dict)  # contributor -> how we were connected to it
    # the round's committed update as applied (the exchange's encoded averaged parts), kept
    # on commit so peers a round or two behind can catch up by it (`[sync] catch_up_rounds`)
    update: CommittedUpdate | None = None
    # (sender, bytes, ms) of each contribution we received as a reducer (`ExchangeResult.peer_rates`)
    peer_rates: tuple[tuple[str, int, int], ...] = ()


@dataclass
class RoundWork:
    cell_id: str
    round: int
    round_attempt: int
    member_index: int
    members: int
    plan: InnerPlan
    deadline_unix_ms: int
    stop: threading.Event = field(default_factory=threading.Event)
    inner_step: int = 0
    last_loss: float = 0.0
    result: TrainResult | None = None
    delta: dict[str, torch.Tensor] | None = None
    reduce_attempt: int = 0  # the contributor set being / last exchanged (0 = none yet)
    reduce_task: asyncio.Task | None = None
    pending: ReduceOutcome | None = None  # reported, waiting for the commit
    pending_attempt: int = 0
    report_epoch: int = 0
    contributors: int = 0  # weighted contributors of the exchange (catch-up ones excluded)
    catch_up: bool = False  # a zero-weight contribution: trained nothing, only applies the average
    # monotonic seconds: training ended (READY), the first exchange started (the wait between)
    ready_at: float = 0.0
    reduce_started_at: float = 0.0
    metrics_reported: bool = False  # the training phases went out with a report already

    @classmethod
    def from_instruction(cls, i: Any, member_index: int) -> RoundWork:
        p = i.plan
        return cls(
            cell_id=i.cell_id,
            round=i.round,
            round_attempt=i.round_attempt,
            member_index=member_index,
            members=p.shard_members(member_index),
            plan=InnerPlan(p.inner_steps, p.micro_batch, p.grad_accum),
            deadline_unix_ms=p.deadline_unix_ms,
        )

    @classmethod
    def for_catch_up(cls, i: Any, committed: CellState) -> RoundWork:
        """Work for a catch-up contributor: a zero delta with zero samples (weight 0)."""
        w = cls(
            cell_id=i.cell_id,
            round=i.round,
            round_attempt=i.round_attempt,
            member_index=0,
            members=1,
            plan=InnerPlan(1, 1, 1),
            deadline_unix_ms=0,
            catch_up=True,
        )
        w.result = TrainResult(samples=0, mean_loss=0.0, steps=0, compute_s=0.0, completed=True)
        w.delta = {n: torch.zeros(t.shape, dtype=torch.float32) for n, t in committed.weights.items()}
        return w

    def matches(self, cell_id: str, round: int, round_attempt: int) -> bool:
        return (self.cell_id, self.round, self.round_attempt) == (cell_id, round, round_attempt)

    def key(self, run_id: str) -> RoundKey:
        return RoundKey(run_id, self.cell_id, self.round, self.member_index, self.members)


def trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


@dataclass
class AheadRun:
    """Inner steps of round `guess.round`, trained ahead while the exchange of the round
    before it runs (`[diloco] overlap = "delayed"`), from the eager estimate of that round's
    outer step (`eager_start`), as the plan `guess` (the last plan, one round on). `start` is what the steps started
    from, so that once the round commits they can be moved onto its outcome."""

    guess: RoundWork
    base_round: int  # the round whose exchange the steps overlap
    start: dict[str, torch.Tensor] | None = None  # where the steps started, float32 on CPU
    result: TrainResult | None = None

    @property
    def steps(self) -> int:
        return self.result.steps if self.result is not None else self.guess.inner_step


def eager_start(committed: CellState, delta: Mapping[str, torch.Tensor], cfg: OuterConfig) -> dict[str, torch.Tensor]:
    """Where training ahead starts: the committed state after an outer step with this
    member's own pseudo-gradient standing in for the average still being exchanged, with the
    committed outer momentum (so it overshoots where the real step will). The idea is the
    "eager" update of Kale et al. 2025 (Eager Updates for Overlapped Communication and
    Computation in DiLoCo). Starting from the member's own trained weights instead leaves
    out the outer step's momentum, and the steps ahead then fail to correct its overshoot:
    `bench/diloco_vs_ddp.py` measures both. Weights only, float32 on CPU."""
    est = CellState(committed.weights, committed.momentum)  # float32 copies (exact upcasts); no average kept
    outer_step(est, delta, dataclasses.replace(cfg, ema_decay=0.0))
    return est.weights


def train_ahead(
    run_id: str,
    rt: CellRuntime,
    a: AheadRun,
    on_step: Callable[[StepProgress], None] | None,
    start: Mapping[str, torch.Tensor],
) -> None:
    """Blocking: train `a.guess`'s steps from `start` (`eager_start`), until `a.guess.stop`
    is set or the plan's steps are done."""
    CellState(start).load_into(rt.model)
    a.start = {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in trainable(rt.model).items()}
    key = a.guess.key(run_id)
    idx = round_indices(shard, key, rt.trainer.num_train, a.guess.plan)
    a.result = rt.trainer.run(key, a.guess.plan, idx, on_step=on_step, stop=a.guess.stop)


def move_onto(model: torch.nn.Module, start: Mapping[str, torch.Tensor], committed: CellState) -> None:
    """The delayed outer update: each parameter p becomes committed + (p - start), i.e. the
    round's own local progress is replaced by the committed outcome of its exchange, and the
    steps trained ahead since are kept on top of it."""
    with torch.no_grad():
        for name, p in trainable(model).items():
            shift = committed.weights[name].to(torch.float32) - start[name]
            p.add_(shift.to(device=p.device, dtype=p.dtype))


def joined(first: TrainResult, rest: TrainResult) -> TrainResult:
    """One round trained in two runs: the steps trained ahead, then the rest."""
    steps = first.steps + rest.steps
    if rest.steps == 0:
        mean = first.mean_loss
    elif first.steps == 0:
        mean = rest.mean_loss
    else:
        mean = (first.mean_loss * first.steps + rest.mean_loss * rest.steps) / steps
    return TrainResult(
        samples=first.samples + rest.samples,
        mean_loss=mean,
        steps=steps,
        compute_s=first.compute_s + rest.compute_s,
        completed=rest.completed,
        data_s=first.data_s + rest.data_s,
        forward_backward_s=first.forward_backward_s + rest.forward_backward_s,
        optimizer_s=first.optimizer_s + rest.optimizer_s,
        throttle_s=first.throttle_s + rest.throttle_s,
    )


def train_round(
    run_id: str,
    rt: CellRuntime,
    committed: CellState,
    w: RoundWork,
    ctx: ddp.DistContext,
    reset_optimizer: bool,
    on_step: Callable[[StepProgress], None] | None,
    ahead: AheadRun | None = None,
    on_data_sent: Callable[[str, int], None] | None = None,
) -> tuple[TrainResult, dict[str, torch.Tensor]]:
    """Blocking: H inner steps from the committed weights; returns the result and delta.
    With `ahead` (its steps are this round's first ones, trained from the weights before
    `committed`'s outer step), those steps are moved onto `committed` and the round goes on
    from the step after them. In a DDP worker, `on_data_sent(cell_id, nbytes)` hears of
    fetched data sent to the other ranks (`share_cell_data`)."""
    key = w.key(run_id)
    if ahead is not None and ahead.result is not None and ahead.start is not None and ahead.result.steps > 0:
        g = ahead.guess.key(run_id)
        if (g.cell_id, g.round) != (key.cell_id, key.round) or ahead.result.steps > w.plan.inner_steps or ctx.enabled:
            raise ValueError("steps trained ahead for another round")
        move_onto(rt.model, ahead.start, committed)
        first = ahead.result
        # a member's indices for a round are one prefix-stable sequence (models/data.shard):
        # on the shard the steps ahead were trained on, the rest of the round goes on from
        # the next sample; when the plan moved us to another shard (the group changed), the
        # rest starts at that shard's first sample, the ones the loss audit looks at
        same_shard = (g.member, g.members) == (key.member, key.members)
        offset = first.samples if same_shard else 0
        count = offset + (w.plan.inner_steps - first.steps) * w.plan.batch
        idx = torch.as_tensor(
            shard(key.run_id, key.cell_id, key.round, key.member, key.members, rt.trainer.num_train, count),
            dtype=torch.long,
        )
        rest = rt.trainer.run(
            key, w.plan, idx, on_step=on_step, stop=w.stop, start_step=first.steps, sample_offset=offset
        )
        res = joined(first, rest)
        if res.samples > w.plan.samples:
            # steps ahead in a larger batch than this plan's: what is claimed, and so the
            # round's weight, stays within the plan's budget (more would be a lie to the core)
            res = dataclasses.replace(res, samples=w.plan.samples)
        delta = pseudo_gradient(committed.weights, trainable(rt.model)) if res.completed else {}
        return res, delta
    if reset_optimizer:
        rt.trainer.reset_optimizer()
    committed.load_into(rt.model)
    if ctx.enabled:
        fetched, sent = share_cell_data(ctx, rt.task.spec, w.cell_id)
        if sent and on_data_sent is not None:
            on_data_sent(w.cell_id, sent)
        ddp.send_command(
            ctx,
            {
                "op": "train",
                "cell_id": w.cell_id,
                "key": asdict(key),
                "plan": asdict(w.plan),
                "reset_optimizer": reset_optimizer,
                "fetched": fetched,
            },
        )
        ddp.broadcast_model(ctx, rt.model)
    idx = round_indices(shard, key, rt.trainer.num_train, w.plan)
    res = rt.trainer.run(key, w.plan, idx, on_step=on_step, stop=w.stop)
    delta = pseudo_gradient(committed.weights, trainable(rt.model)) if res.completed else {}
    return res, delta


def share_cell_data(ctx: ddp.DistContext, spec: Any, cell_id: str) -> tuple[bool, int]:
    """Rank 0, before a train command: whether `cell_id`'s data was fetched from the
    coordinator rather than loaded from a local copy, and the bytes sent now. If it was
    fetched, and the other ranks are about to build the cell's runtime (the cell changed),
    send them that data first (`ddp.send_tensors`): they have no coordinator session to
    fetch it themselves."""
    from bagel.models import datashards

    data = datashards.installed(spec, cell_id)
    sent = 0
    if data is not None and ctx.followers_cell != cell_id:
        tensors = [data.x_train, data.y_train, data.x_heldout, data.y_heldout]
        ddp.send_command(ctx, {"op": "data", "cell_id": cell_id, **ddp.describe_tensors(tensors)})
        ddp.send_tensors(ctx, tensors)
        sent = sum(t.numel() * t.element_size() for t in tensors)
    ctx.followers_cell = cell_id
    return data is not None, sent


def follow_round(ctx: ddp.DistContext, rt: CellRuntime, cmd: Mapping[str, Any]) -> TrainResult:
    """Ranks > 0: the same round as rank 0, from rank 0's broadcast weights."""
    if cmd.get("reset_optimizer"):
        rt.trainer.reset_optimizer()
    ddp.broadcast_model(ctx, rt.model)
    key = RoundKey(**cmd["key"])
    plan = InnerPlan(**cmd["plan"])
    return rt.trainer.run(key, plan, round_indices(shard, key, rt.trainer.num_train, plan))


def fresh_feedback(residuals: Mapping[str, torch.Tensor]) -> ErrorFeedback:
    """An ErrorFeedback holding the committed residuals (the same tensors, not copies: the
    feedback replaces a residual, it never changes one in place); a failed attempt never
    touches them."""
    ef = ErrorFeedback()
    for k, r in residuals.items():
        ef.store(k, r.float())
    return ef


def exchange_timeout_s(i: Instruction, now_unix_s: float, cap_s: float | None = None) -> float:
    """Seconds this worker gives the exchange `i` orders before it gives up on it.

    The coordinator sizes each exchange's deadline from the links, the lease and what the
    cell's exchanges really took (`coordinator/core/rounds.py`, `Rounds.reduce_span_ms`):
    a large model's exchange over home uplinks takes minutes, which no fixed timeout on
    the worker fits. So the worker follows that deadline (plus `REDUCE_DEADLINE_GRACE_S`);
    `cap_s` (`--reduce-timeout-s`) bounds it where the operator set one."""
    if i.reduce_deadline_unix_ms > 0:
        t = i.reduce_deadline_unix_ms / 1000.0 - now_unix_s + REDUCE_DEADLINE_GRACE_S
    else:
        t = DEFAULT_REDUCE_TIMEOUT_S
    if cap_s is not None:
        t = min(t, cap_s)
    return min(MAX_REDUCE_TIMEOUT_S, max(MIN_REDUCE_TIMEOUT_S, t))


async def reduce_round(
    dataplane: Any,
    spec: Any,
    worker_id: str,
    committed: CellState,
    w: RoundWork,
    i: Any,
    ef: ErrorFeedback | None,
    timeout_s: float,
    *,
    base_hash: str = "",
) -> ReduceOutcome:
    """Average our delta over exactly i.contributors, then the outer step and the hash.

    base_hash: the hash of `committed`; where the run keeps committed updates (`[sync]
    catch_up_rounds` > 0), the outcome carries the round's update, from that state to the new one.
    """
    from bagel.worker.averaging import Contributor

    assert w.delta is not None and w.result is not None
    # Catch-up contributors come with max_samples 0 (coordinator core), while the data plane
    # refuses budgets <= 0. They abstain (weight 0, no payload) anyway, so every worker maps
    # a zero budget to 1 the same way (the group digest stays equal everywhere); at worst a
    # lying catch-up peer could weigh as 1 sample. Remove once the data plane accepts 0.
    # A part weight is read as the protocol's converter reads it (0, unset, is 1; clamped), so
    # every member binds the same weights into the group digest as the coordinator does.
    contributors = [
        Contributor(
            m.worker_id,
            m.peer.peer_id,
            tuple(m.peer.maddrs),
            max(1, int(m.max_samples)),
            m.no_reduce,
            part_weight_from_wire(m.part_weight),
        )
        for m in i.contributors
    ]
    res = await dataplane.all_reduce(
        worker_id=worker_id,
        cell_id=w.cell_id,
        round=w.round,
        round_attempt=w.round_attempt,
        reduce_attempt=i.reduce_attempt,
        contributors=contributors,
        delta=w.delta,
        weight=float(w.result.samples),
        codec=spec.diloco.codec,
        timeout_s=timeout_s,
        error_feedback=ef,
        reducer=spec.diloco.aggregation,
        audit_blocks=spec.audit.sketch_blocks,
        loss_probe=loss_probe(spec, committed, w, i, Layout.of(w.delta).names),
    )
    cfg = OuterConfig.from_spec(spec.diloco, spec.ema)
    sync = getattr(spec, "sync", None)
    keep_update = bool(getattr(sync, "catch_up_rounds", 0)) and bool(res.parts)

    def step() -> tuple[CellState, str, CommittedUpdate | None]:
        new = committed.clone()
        outer_step(new, res.averaged, cfg, ema_step=max(1, w.round))
        h = new.state_hash()
        update = None
        if keep_update:
            update = CommittedUpdate.of(
                w.round, res.codec, res.part_numels, res.parts, base_hash=base_hash, state_hash=h
            )
        return new, h, update

    t_outer = time.perf_counter()
    new, h, update = await asyncio.to_thread(step)
    outer_s = time.perf_counter() - t_outer
    residuals: dict[str, torch.Tensor] = {}
    if ef is not None:
        for n in w.delta:
            r = ef.residual(n)
            if r is not None:
                residuals[n] = r
    return ReduceOutcome(
        new,
        h,
        residuals,
        res.bytes_sent,
        res.bytes_received,
        res.comm_s,
        res.audit,
        encode_s=res.encode_s,
        outer_step_s=outer_s,
        update=update,
        peer_rates=res.peer_rates,
    )


_LOSS_AUDITS: OrderedDict[tuple[str, str], SliceLossAudit] = OrderedDict()  # (spec hash, cell); bounded
_LOSS_AUDITS_KEPT = 2
_LOSS_AUDITS_LOCK = threading.Lock()  # probes run in worker threads


def loss_audit_for(spec: Any, cell_id: str) -> SliceLossAudit:
    """The cell's `SliceLossAudit` (its CPU model and training data), built once and kept for a few cells."""
    key = (spec.spec_hash, cell_id)
    with _LOSS_AUDITS_LOCK:
        audit = _LOSS_AUDITS.get(key)
        if audit is None:
            audit = _LOSS_AUDITS[key] = SliceLossAudit(spec, cell_id)
            while len(_LOSS_AUDITS) > _LOSS_AUDITS_KEPT:
                _LOSS_AUDITS.popitem(last=False)
        _LOSS_AUDITS.move_to_end(key)
        return audit


def loss_probe(
    spec: Any, committed: CellState, w: RoundWork, i: Any, names: Sequence[str]
) -> Callable[[int, Mapping[str, torch.Tensor]], dict[str, tuple[float, float]]] | None:
    """The loss audit of the part this worker reduces in the exchange of instruction `i`
    (`worker.heldout.SliceLossAudit`), or None when the run turns it off (`audit.loss_samples
    = 0`) or the instruction has no plan. Each sender's assigned samples follow from the
    round plan: its position among the plan's members (the data shard index) and its budget."""
    plan = getattr(i, "plan", None)
    if not spec.audit.loss_samples or plan is None or not plan.members:
        return None
    # (data shard index, the group size it was drawn with, budget): a late joiner's shard
    # follows the opening members' (`RoundPlan.shard_members`)
    order = {m.worker_id: (k, plan.shard_members(k), int(m.max_samples)) for k, m in enumerate(plan.members)}

    def probe(start: int, slices: Mapping[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
        audit = loss_audit_for(spec, w.cell_id)
        assigned = {s: audit.assigned(w.round, *order[s]) for s in slices if s in order}
        return audit.gains(committed, names, start, slices, assigned, w.round)

    return probe


def corrupt(
    delta: Mapping[str, torch.Tensor],
    mode: str,
    previous: Mapping[str, torch.Tensor] | None,
    first: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """The pseudo-gradient a Byzantine worker contributes instead of its honest `delta`.

    sign-flip: -delta; scale: delta x 100; nan: all NaN (our own data plane then abstains,
    sending weight 0: reducers' non-finite rejection is the data plane's own test); zero and
    freeload-zero: zeros with the full sample count (a freeloader); stale: the previous
    round's honest delta (zeros in the first round); freeload-replay: its `first` honest
    delta again, every round (honest the first time); budget-liar: its honest delta (it
    lies in its figures instead, see `claimed`); alie / ipm: the papers' attacks as a lone worker can
    run them from its own delta d (`bagel.robust.attacks`): ALIE sends d - 1.5 x |d| (the
    honest per-coordinate std taken as |d|), IPM sends -0.5 x d; bad-reducer: the honest
    delta (this worker lies as a reducer instead: `DataPlane(doctor=BAD_REDUCER_SCALE)`).
    """
    if mode in ("budget-liar", "bad-reducer"):
        return dict(delta)
    if mode == "freeload-zero":
        mode = "zero"
    if mode == "freeload-replay":
        if first is not None and set(first) == set(delta):
            return {k: first[k].clone() for k in delta}
        return dict(delta)
    if mode == "sign-flip":
        return {k: -v for k, v in delta.items()}
    if mode == "scale":
        return {k: v * BYZANTINE_SCALE for k, v in delta.items()}
    if mode == "nan":
        return {k: torch.full_like(v, float("nan")) for k, v in delta.items()}
    if mode == "zero":
        return {k: torch.zeros_like(v) for k, v in delta.items()}
    if mode == "alie":
        return {k: attacks.alie_own(v) for k, v in delta.items()}
    if mode == "ipm":
        return {k: attacks.ipm_own(v) for k, v in delta.items()}
    if mode == "stale":
        if previous is not None and set(previous) == set(delta):
            return {k: previous[k].clone() for k in delta}
        return {k: torch.zeros_like(v) for k, v in delta.items()}
    raise ValueError(f"unknown byzantine mode {mode!r}; known: {', '.join(BYZANTINE_MODES)}")


def claimed(mode: str, samples: int, compute_ms: int) -> tuple[int, int]:
    """(samples, compute_ms) a worker in `--byzantine` `mode` reports for a round it trained
    `samples` in `compute_ms`: the truth, except that a budget-liar claims LIAR_FACTOR times
    the samples in 1/LIAR_FACTOR of the time (and LIAR_SAMPLES_PER_S in its profile)."""
    if mode == "budget-liar":
        return samples * LIAR_FACTOR, max(1, compute_ms // LIAR_FACTOR)
    return samples, compute_ms


def ddp_follower(ctx: ddp.DistContext, device_req: str, throttle: float) -> None:
    """Ranks > 0 of a multi-GPU worker: train rank 0's rounds until it says exit."""
    device = pick_device(ctx.device_for(device_req))
    state: dict[str, Any] = {"spec": None, "rt": None}

    def on_spec(cmd: dict[str, Any]) -> None:
        # the initial weights' digest travels beside the text, as in the Register answer
        state["spec"] = dataclasses.replace(parse_spec(cmd["spec_toml"]), init_sha256=str(cmd.get("init_sha256", "")))

    def on_data(cmd: dict[str, Any]) -> None:
        from bagel.models import datashards

        tensors = ddp.recv_tensors(ctx, cmd)  # taken off the group first: rank 0 has sent them
        if len(tensors) != 4:
            raise ValueError(f"rank 0 sent {len(tensors)} data tensors, not a cell's 4")
        if state["spec"] is None:
            raise ValueError("rank 0 sent a cell's data before the run spec")
        datashards.install(state["spec"], str(cmd["cell_id"]), datashards.CellData(*tensors))

    def on_train(cmd: dict[str, Any]) -> None:
        from bagel.models import datashards

        rt = state["rt"]
        if rt is None or rt.cell_id != cmd["cell_id"]:
            if cmd.get("fetched") and datashards.installed(state["spec"], cmd["cell_id"]) is None:
                # never train on a local copy rank 0 did not use: it may be another dataset
                raise ValueError(f"rank 0 trains {cmd['cell_id']!r:.80} on fetched data it did not send")
            rt = build_runtime(state["spec"], cmd["cell_id"], device, throttle=throttle, collective=ctx)
            state["rt"] = rt
        follow_round(ctx, rt, cmd)

    ddp.follow(ctx, {"spec": on_spec, "data": on_data, "train": on_train})
