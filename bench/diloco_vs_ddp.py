"""DiLoCo with compressed pseudo-gradients vs synchronous data-parallel training.

One expert cell (`k0.r0` of a 1 cluster x 1 timestep-range run, tiny DiT, the bundled
digits), 4 workers, the same samples for every variant (worker m sees exactly the same
shard indices, from `bagel.models.data.shard`, at the same step in every variant):

(a) ddp          synchronous data-parallel: an fp32 gradient average every step. Run
                 in-process as one model whose step gradient is the exact mean of the 4
                 workers' micro-batch gradients (grad_accum = workers in the real
                 `InnerTrainer`), which is what 4 replicas with an exact all-reduce compute.
                 Bytes are what a ring all-reduce would send per worker:
                 2 (W-1)/W x 4 B x params per step (framing not counted: flatters DDP).
(b) diloco_fp32  DiLoCo (Douillard et al. 2023), H inner AdamW steps per round, outer
                 Nesterov SGD (the spec's 0.7 / 0.9), fp32 pseudo-gradients;
(c) diloco_int8  the same with blockwise int8 (no error feedback);
(d) diloco_int4  the same with blockwise int4 and error feedback.
(e) diloco_int4_overlap{50,100}  (d) with `[diloco] overlap = "delayed"`: while round n's
                 exchange runs, each member trains the first A steps of round n + 1 from
                 its own trained weights (`InnerTrainer.run`, the worker's own stop point),
                 and once round n's outer step is applied moves them onto it
                 (`roundwork.move_onto`) and trains the other H - A from there
                 (`start_step=A`). A = H/2 (an exchange half as long as the compute) and
                 A = H (an exchange as long as the compute or longer: the whole round is
                 one outer step late, the most staleness the mode has). Same samples,
                 same bytes as (d): the cost of the staleness is the loss gap to (d).
(f) diloco_int4_state_{bf16,fp16}  (d) with `[sync] state_dtype = "bf16"` / "fp16": the
                 committed state (weights and outer momentum) lives on that grid: every
                 member rounds it at round 0 and after every outer step (computed in fp32),
                 so a joiner's download is half the bytes and lossless. Same samples and
                 exchange bytes as (d): the cost of the grid is the loss gap to (d), whose
                 state is fp32. The state file's bytes are reported per variant.

The DiLoCo variants use the worker's real pieces: `InnerTrainer` (AdamW kept across rounds,
as the worker does), `pseudo_gradient`, `CellState`, `outer_step`, `ErrorFeedback`, and the
group exchange `DataPlane.all_reduce` over hivemind P2P between 4 peers on loopback, each
with its own DHT node; the bytes reported are the `ExchangeResult.bytes_sent` the data plane
counted on its streams (a part re-sent after a broken stream counts twice, as it was sent
twice; hence `bytes_sent_max_worker` next to the mean). Every member applies the outer step
to its own state copy, and the bench checks that the 4 state hashes agree every round.

Learning rates: DDP's lr and DiLoCo's inner lr are each swept over `--lrs` (constant lr, as
the worker trains) with the fp32 codec for DiLoCo; int8 and int4 reuse fp32's best inner lr
(they get no sweep of their own, so the selection cannot favour them). A delayed outer
update acts like extra outer momentum, so int4+EF and its overlap variants are each run at
every outer lr:momentum pair of `--outer` and reported at their best; int4+EF without
overlap gets the same sweep, so the gap between them is the cost of staleness alone; so do the
bf16 and fp16 states, against int4+EF's fp32 state. The sweep selects on
the same held-out loss it reports (there is no separate validation split); both variants
are selected the same way.

Held-out loss: the mean of `CellTask.eval_loss(model, *heldout_data(), seed=s)` over
`--eval-seeds` fixed seeds (deterministic; the same noise for every variant).

Targets: (d) sends >= 300x fewer bytes per worker than (a), and its held-out loss is at
most 5% above (a)'s. A bound on the first: per round, int4 (block 128: 0.53 B/value) sends
about 2 (k-1)/k x 0.53 B x params per member, DDP 2 (W-1)/W x 4 B x params x H, so the
ratio is at most about H x 4 / 0.53 = 376 at H = 50, less the data plane's headers.

Not a test. The default (10 rounds at batch 32, 8 training runs) took 24 minutes on the shared
2-core development machine at a load average of 9-15; expect well under that on a quiet one.
Without the overlap rows (`--overlaps "" --naive-overlaps ""`, 19 training runs with the
state-dtype rows) one seed took 10 to 11 minutes there:
    .venv/bin/python bench/diloco_vs_ddp.py --json bench/out/diloco_vs_ddp.json
    .venv/bin/python bench/diloco_vs_ddp.py --quick      # smoke run, 2 rounds at batch 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import hivemind
import torch

from bagel.compression import ErrorFeedback
from bagel.models.data import shard
from bagel.models.experts import CellTask, cell_task
from bagel.protocol.runspec import RunSpec, parse_spec
from bagel.worker.averaging import Contributor, DataPlane
from bagel.worker.diloco import STATE_DTYPES, CellState, OuterConfig, outer_step, pseudo_gradient
from bagel.worker.roundwork import eager_start, joined, move_onto, trainable
from bagel.worker.trainer import InnerPlan, InnerTrainer, RoundKey, TrainResult, round_indices

CELL = "k0.r0"
CPU = torch.device("cpu")
LOSS_TARGET = 0.05  # (d)'s held-out loss at most 5% above (a)'s
BYTES_TARGET = 300.0  # (a) bytes / (d) bytes
EXCHANGE_TIMEOUT_S = 300.0  # generous: the machine is shared

SPEC_TEMPLATE = """\
[run]
id = "bench-diloco-vs-ddp"
seed = {seed}
description = "bench/diloco_vs_ddp.py: one cell, DiLoCo vs DDP"

[model]
arch = "dit"
preset = "tiny"
image_size = 8
channels = 1
num_classes = 10

[data]
source = "digits"
clusters = 1
holdout_fraction = 0.1

[cells]
timestep_ranges = 1
overlap = 0.0
router = false

[diloco]
inner_steps = {H}
inner_lr = 0.001
outer_lr = 0.7
outer_momentum = 0.9
nesterov = true
"""

log = logging.getLogger("bench.diloco_vs_ddp")


@dataclass(frozen=True)
class Budget:
    """The training budget every variant gets."""

    workers: int
    H: int  # inner steps per DiLoCo round (and DDP steps per "round" of data)
    batch: int  # samples per worker per step
    rounds: int

    @property
    def steps(self) -> int:
        return self.rounds * self.H

    @property
    def samples(self) -> int:
        return self.rounds * self.H * self.batch * self.workers


# ---------------------------------------------------------------- shared helpers


def make_spec(seed: int, H: int) -> RunSpec:
    return parse_spec(SPEC_TEMPLATE.format(seed=seed, H=H))


def member_indices(spec: RunSpec, rnd: int, member: int, budget: Budget, n: int) -> torch.Tensor:
    """Worker `member`'s H x batch sample indices of round `rnd` (the worker's own shard call)."""
    key = RoundKey(spec.run.id, CELL, rnd, member, budget.workers)
    return round_indices(shard, key, n, InnerPlan(budget.H, budget.batch, 1))


def heldout_loss(task: CellTask, model: torch.nn.Module, seeds: int) -> float:
    x, y = task.heldout_data()
    return sum(task.eval_loss(model, x, y, seed=s) for s in range(seeds)) / seeds


def ring_allreduce_bytes(numel: int, workers: int) -> int:
    """Bytes one worker sends in a ring all-reduce of `numel` fp32 values (Patarasuk & Yuan 2009)."""
    return round(2 * (workers - 1) / workers * 4 * numel)


# ---------------------------------------------------------------- (a) synchronous data-parallel


def run_ddp(spec: RunSpec, task: CellTask, budget: Budget, lr: float, eval_seeds: int) -> dict[str, Any]:
    """One model, each step's gradient the exact mean over the workers' micro-batches."""
    t0 = time.perf_counter()
    model = task.build_model()
    trainer = InnerTrainer(task, model, CPU, lr=lr, weight_decay=spec.diloco.inner_weight_decay)
    n = trainer.num_train
    # micro-batch j of every step is worker j's batch: the trainer weights each by its share,
    # so the summed gradient is the mean of the workers' mean gradients.
    plan = InnerPlan(budget.H, budget.batch, budget.workers)
    losses: list[float] = []
    curve: list[float] = []  # held-out loss (seed 0 only) after every H steps
    for rnd in range(1, budget.rounds + 1):
        per_member = torch.stack(
            [member_indices(spec, rnd, m, budget, n).view(budget.H, budget.batch) for m in range(budget.workers)]
        )  # [W, H, b]
        idx = per_member.transpose(0, 1).reshape(-1)  # step-major: step s = [w0 batch, w1 batch, ...]
        res = trainer.run(RoundKey(spec.run.id, CELL, rnd, 0, 1), plan, idx)
        losses.append(res.mean_loss)
        curve.append(heldout_loss(task, model, 1))
    params = sum(p.numel() for p in trainable(model).values())
    return {
        "heldout_loss": heldout_loss(task, model, eval_seeds),
        "bytes_per_worker": budget.steps * ring_allreduce_bytes(params, budget.workers),
        "train_loss_last_round": losses[-1],
        "train_loss_per_round": losses,
        "heldout_curve": curve,
        "steps": budget.steps,
        "wall_s": time.perf_counter() - t0,
    }


# ---------------------------------------------------------------- (b-d) DiLoCo over the real data plane


@dataclass
class Peer:
    worker_id: str
    dht: hivemind.DHT
    plane: DataPlane

    def contributor(self, max_samples: int) -> Contributor:
        maddrs = tuple(str(m) for m in self.dht.get_visible_maddrs())
        return Contributor(self.worker_id, self.plane.peer_id, maddrs, max_samples)


async def start_peers(run_id: str, n: int, peers: list[Peer]) -> None:
    """n peers on loopback, each with its own DHT node (bootstrapped off the first) and data plane.

    Appends to `peers` as it goes, so the caller's `finally` can stop whatever started."""
    first: list[Any] = []
    for i in range(n):
        dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first)
        try:
            plane = DataPlane(await dht.replicate_p2p(), run_id, pending_wait_s=30.0)
            await plane.start()
        except BaseException:
            dht.shutdown()
            raise
        peers.append(Peer(f"w{i}", dht, plane))
        first = first or list(dht.get_visible_maddrs())


async def stop_peers(peers: list[Peer]) -> None:
    for p in peers:
        try:
            await p.plane.close()
        finally:
            p.dht.shutdown()


class DilocoRun:
    """One DiLoCo training run: W members with their own model, AdamW, state copy and feedback."""

    def __init__(
        self,
        spec: RunSpec,
        task: CellTask,
        budget: Budget,
        inner_lr: float,
        codec: str,
        ef: bool,
        ahead: int = 0,
        naive: bool = False,
        state_dtype: str = "fp32",
    ):
        self.spec, self.task, self.budget, self.codec = spec, task, budget, codec
        self.ahead = ahead  # steps of the next round trained during each exchange (overlap)
        self.naive = naive  # train ahead from the member's own weights, not the eager estimate
        self.starts: list[dict[str, torch.Tensor] | None] = [None] * budget.workers
        self.ahead_results: list[TrainResult | None] = [None] * budget.workers
        init = task.build_model()
        # every member builds its round-0 state itself, rounded onto the run's state dtype
        self.states = [CellState.from_model(init, dtype=STATE_DTYPES[state_dtype]) for _ in range(budget.workers)]
        self.trainers = [
            InnerTrainer(task, task.build_model(), CPU, lr=inner_lr, weight_decay=spec.diloco.inner_weight_decay)
            for _ in range(budget.workers)
        ]
        self.efs = [ErrorFeedback() if ef else None for _ in range(budget.workers)]
        self.outer = OuterConfig.from_spec(spec.diloco)
        self.bytes_sent = [0] * budget.workers
        self.bytes_received = [0] * budget.workers
        self.comm_s = 0.0
        self.hash_mismatches = 0
        self.eval_model = task.build_model()
        self.curve: list[float] = []  # held-out loss (seed 0 only) after every outer step

    def train_member(self, rnd: int, m: int) -> tuple[dict[str, torch.Tensor], int, float]:
        """Blocking: H inner steps from member m's committed weights; its pseudo-gradient.
        With overlap, the first `ahead` of them were trained during the last exchange
        (`train_ahead`): they are moved onto the committed weights and the round goes on."""
        tr = self.trainers[m]
        idx = member_indices(self.spec, rnd, m, self.budget, tr.num_train)
        key = RoundKey(self.spec.run.id, CELL, rnd, m, self.budget.workers)
        plan = InnerPlan(self.budget.H, self.budget.batch, 1)
        start, first = self.starts[m], self.ahead_results[m]
        if start is not None and first is not None:
            move_onto(tr.model, start, self.states[m])
            self.starts[m] = self.ahead_results[m] = None
            res = joined(first, tr.run(key, plan, idx, start_step=self.ahead))
        else:
            self.states[m].load_into(tr.model)  # AdamW moments persist across rounds, as in the worker
            res = tr.run(key, plan, idx)
        return pseudo_gradient(self.states[m].weights, trainable(tr.model)), res.samples, res.mean_loss

    def train_ahead(self, rnd: int, m: int, delta: dict[str, torch.Tensor]) -> None:
        """Blocking: member m's first `ahead` steps of round `rnd`, while the exchange of round
        rnd - 1 is in flight, stopped where the worker would be: from the eager estimate of
        the coming outer step (`roundwork.eager_start`, the worker's way), or with `naive`
        from the member's own trained weights."""
        tr = self.trainers[m]
        if not self.naive:
            CellState(eager_start(self.states[m], delta, self.outer)).load_into(tr.model)
        self.starts[m] = {n: p.detach().clone() for n, p in trainable(tr.model).items()}
        idx = member_indices(self.spec, rnd, m, self.budget, tr.num_train)
        key = RoundKey(self.spec.run.id, CELL, rnd, m, self.budget.workers)
        stop = threading.Event()
        res = tr.run(
            key,
            InnerPlan(self.budget.H, self.budget.batch, 1),
            idx,
            stop=stop,
            on_step=lambda p: stop.set() if p.step >= self.ahead else None,
        )
        assert res.steps == self.ahead, (res.steps, self.ahead)
        self.ahead_results[m] = res

    async def round(self, peers: list[Peer], rnd: int, exchange_round: int) -> float:
        """Train every member (one after the other: 2 cores), then exchange and step the outer optimizer."""
        work = [await asyncio.to_thread(self.train_member, rnd, m) for m in range(self.budget.workers)]
        if self.ahead and rnd < self.budget.rounds:  # the GPU does not wait for the exchange
            for m in range(self.budget.workers):
                await asyncio.to_thread(self.train_ahead, rnd + 1, m, work[m][0])
        contributors = [p.contributor(self.budget.H * self.budget.batch) for p in peers]
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(
                p.plane.all_reduce(
                    worker_id=p.worker_id,
                    cell_id=CELL,
                    round=exchange_round,  # unique across the runs that share these peers
                    round_attempt=1,
                    reduce_attempt=1,
                    contributors=contributors,
                    delta=delta,
                    weight=float(samples),
                    codec=self.codec,
                    timeout_s=EXCHANGE_TIMEOUT_S,
                    error_feedback=self.efs[m],
                )
                for m, (p, (delta, samples, _)) in enumerate(zip(peers, work, strict=True))
            )
        )
        self.comm_s += time.perf_counter() - t0
        hashes = set()
        for m, res in enumerate(results):
            self.bytes_sent[m] += res.bytes_sent
            self.bytes_received[m] += res.bytes_received
            outer_step(self.states[m], res.averaged, self.outer)
            hashes.add(self.states[m].state_hash())
        if len(hashes) != 1:
            self.hash_mismatches += 1
            log.warning("round %d: the %d members disagree on the state hash", rnd, len(hashes))
        self.states[0].load_into(self.eval_model)
        self.curve.append(heldout_loss(self.task, self.eval_model, 1))
        return sum(w[2] for w in work) / len(work)

    async def train(self, peers: list[Peer], first_exchange_round: int, eval_seeds: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        losses = [await self.round(peers, r, first_exchange_round + r - 1) for r in range(1, self.budget.rounds + 1)]
        self.states[0].load_into(self.eval_model)
        W = self.budget.workers
        return {
            "heldout_loss": heldout_loss(self.task, self.eval_model, eval_seeds),
            "bytes_per_worker": sum(self.bytes_sent) / W,
            "bytes_sent_max_worker": max(self.bytes_sent),
            "bytes_received_per_worker": sum(self.bytes_received) / W,
            "train_loss_last_round": losses[-1],
            "train_loss_per_round": losses,
            "heldout_curve": self.curve,
            "rounds": self.budget.rounds,
            "replicas_identical": self.hash_mismatches == 0,
            "state_file_bytes": len(self.states[0].to_safetensors()),
            "comm_s": self.comm_s,
            "wall_s": time.perf_counter() - t0,
        }


async def run_diloco_all(
    spec: RunSpec,
    task: CellTask,
    budget: Budget,
    lrs: list[float],
    eval_seeds: int,
    overlaps: tuple[int, ...] = (),
    naive_overlaps: tuple[int, ...] = (),
    outer_grid: tuple[tuple[float, float], ...] = (),
    state_dtypes: tuple[str, ...] = (),
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """The inner-lr sweep with fp32, then int8, int4+EF and its variants (overlap, the state
    on a half-precision grid) at fp32's best inner lr, on one set of peers."""
    peers: list[Peer] = []
    sweep: list[dict[str, Any]] = []
    out: dict[str, dict[str, Any]] = {}
    next_round = 1
    try:
        await start_peers(spec.run.id, budget.workers, peers)
        for lr in lrs:
            r = await DilocoRun(spec, task, budget, lr, "fp32", ef=False).train(peers, next_round, eval_seeds)
            next_round += budget.rounds
            sweep.append({"lr": lr, **r})
            log.info("diloco_fp32 inner lr %g: held-out %.4f (%.0f s)", lr, r["heldout_loss"], r["wall_s"])
        best = min(sweep, key=lambda s: s["heldout_loss"])
        out["diloco_fp32"] = {"codec": "fp32", "error_feedback": False, "inner_lr": best["lr"], **best}
        out["diloco_fp32"].pop("lr")
        default_outer = ((spec.diloco.outer_lr, spec.diloco.outer_momentum),)
        swept = outer_grid or default_outer
        for name, codec, ef, ahead, naive, grid, sdtype in (
            ("diloco_int8", "int8", False, 0, False, default_outer, "fp32"),
            ("diloco_int4", "int4", True, 0, False, swept, "fp32"),
            *(
                (f"diloco_int4_overlap{pct}", "int4", True, budget.H * pct // 100, False, swept, "fp32")
                for pct in overlaps
            ),
            *(
                (f"diloco_int4_naive{pct}", "int4", True, budget.H * pct // 100, True, default_outer, "fp32")
                for pct in naive_overlaps
            ),
            *((f"diloco_int4_state_{d}", "int4", True, 0, False, swept, d) for d in state_dtypes),
        ):
            tried: list[dict[str, Any]] = []
            for olr, mom in grid:
                ospec = replace(spec, diloco=replace(spec.diloco, outer_lr=olr, outer_momentum=mom))
                run = DilocoRun(
                    ospec, task, budget, best["lr"], codec, ef=ef, ahead=ahead, naive=naive, state_dtype=sdtype
                )
                r = await run.train(peers, next_round, eval_seeds)
                next_round += budget.rounds
                tried.append({"outer_lr": olr, "outer_momentum": mom, **r})
                log.info("%s outer %g/%g: held-out %.4f (%.0f s)", name, olr, mom, r["heldout_loss"], r["wall_s"])
            pick = min(tried, key=lambda t: t["heldout_loss"])
            out[name] = {
                "codec": codec,
                "error_feedback": ef,
                "inner_lr": best["lr"],
                "ahead_steps": ahead,
                "ahead_from": "own weights" if naive else "eager estimate",
                "state_dtype": sdtype,
                **pick,
                "outer_sweep": [{k: t[k] for k in ("outer_lr", "outer_momentum", "heldout_loss")} for t in tried],
            }
    finally:
        await stop_peers(peers)
    return sweep, out


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="", help="write the results to this JSON file")
    p.add_argument(
        "--samples",
        type=int,
        default=64000,
        help="training samples per variant, over all workers; rounded down to whole rounds "
        "of workers x H x batch (default: 10 rounds at batch 32)",
    )
    p.add_argument("--workers", type=int, default=4, help="workers (data-parallel ranks / DiLoCo members)")
    p.add_argument("--H", type=int, default=50, help="DiLoCo inner steps per round")
    p.add_argument("--batch", type=int, default=32, help="samples per worker per inner step")
    p.add_argument("--lrs", default="3e-4,1e-3,3e-3", help="comma-separated AdamW learning rates to sweep")
    p.add_argument("--eval-seeds", type=int, default=8, help="noise seeds the held-out loss is averaged over")
    p.add_argument("--seed", type=int, default=0, help="run seed (initial weights, split)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (the machine is shared)")
    p.add_argument(
        "--overlaps",
        default="50,100",
        help="overlap variants of int4+EF: percent of H trained ahead during each exchange (empty: none)",
    )
    p.add_argument(
        "--naive-overlaps",
        default="100",
        help="the same, trained ahead from each member's own weights instead of the eager estimate (empty: none)",
    )
    p.add_argument(
        "--outer",
        default="0.7:0.9,0.7:0.8,0.5:0.9,0.5:0.8",
        help="outer lr:momentum pairs swept for int4+EF with and without overlap, each variant at its best "
        "(a delayed update acts as extra momentum; empty: the spec's 0.7:0.9 only)",
    )
    p.add_argument(
        "--state-dtypes",
        default="bf16,fp16",
        help="variants of int4+EF (no overlap) whose committed state lives on this grid ([sync] state_dtype), "
        "each at its best outer lr/momentum (empty: none)",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: 2 rounds at batch 8")
    args = p.parse_args(argv)
    if args.quick:
        args.batch = 8
        args.samples = 2 * args.workers * args.H * args.batch
    try:
        args.lr_list = [float(x) for x in args.lrs.split(",") if x.strip()]
    except ValueError:
        p.error(f"--lrs: expected comma-separated numbers, got {args.lrs!r}")
    for flag in ("overlaps", "naive_overlaps"):
        text = getattr(args, flag)
        try:
            got = tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            p.error(f"--{flag.replace('_', '-')}: expected comma-separated percentages, got {text!r}")
        if any(not 0 < x <= 100 for x in got):
            p.error(f"--{flag.replace('_', '-')}: each percentage must be in 1..100, got {text!r}")
        setattr(args, flag.removesuffix("s") + "_list", got)
    args.state_dtype_list = tuple(x.strip() for x in args.state_dtypes.split(",") if x.strip())
    if any(d not in STATE_DTYPES or d == "fp32" for d in args.state_dtype_list):
        p.error(f"--state-dtypes: each one of bf16, fp16 (int4+EF is the fp32 state), got {args.state_dtypes!r}")
    try:
        args.outer_grid = tuple(
            (float(a), float(b)) for a, b in (x.split(":") for x in args.outer.split(",") if x.strip())
        )
    except ValueError:
        p.error(f"--outer: expected comma-separated lr:momentum pairs, got {args.outer!r}")
    if any(not (lr > 0 and 0 <= m < 1) for lr, m in args.outer_grid):
        p.error(f"--outer: each lr must be positive and each momentum in [0, 1), got {args.outer!r}")
    if not args.lr_list or any(lr <= 0 for lr in args.lr_list):
        p.error(f"--lrs: expected positive learning rates, got {args.lrs!r}")
    if args.workers < 2 or args.H < 1 or args.batch < 1 or args.eval_seeds < 1:
        p.error("--workers must be >= 2; --H, --batch and --eval-seeds >= 1")
    args.rounds = args.samples // (args.workers * args.H * args.batch)
    if args.rounds < 1:
        p.error(f"--samples {args.samples} is less than one round ({args.workers * args.H * args.batch} samples)")
    return args


def fmt_bytes(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(b) < 1024 or unit == "GiB":
            return f"{b:.1f} {unit}"
        b /= 1024
    return f"{b:.1f} GiB"


def print_report(result: dict[str, Any]) -> None:
    s = result["setup"]
    print(
        f"\nDiLoCo vs DDP: cell {CELL}, tiny DiT ({s['params']} params), {s['workers']} workers, "
        f"{s['samples']} samples each variant ({s['rounds']} rounds x H={s['H']} x batch {s['batch']} x "
        f"{s['workers']}), initial held-out loss {s['initial_heldout_loss']:.4f}"
    )
    print("\nlearning-rate sweep (held-out loss):")
    print(f"  {'lr':>8}  {'ddp':>8}  {'diloco_fp32':>12}")
    for d, f in zip(result["lr_sweep"]["ddp"], result["lr_sweep"]["diloco_fp32"], strict=True):
        print(f"  {d['lr']:>8.1e}  {d['heldout_loss']:>8.4f}  {f['heldout_loss']:>12.4f}")
    ddp = result["variants"][0]
    header = ("variant", "lr", "outer", "held-out", "vs ddp", "bytes/worker", "ddp/this", "wall s")
    print("\n  {:<22} {:>8} {:>8} {:>9} {:>7} {:>13} {:>9} {:>7}".format(*header))
    for v in result["variants"]:
        lr = v.get("lr", v.get("inner_lr"))
        rel = v["heldout_loss"] / ddp["heldout_loss"] - 1
        ratio = ddp["bytes_per_worker"] / v["bytes_per_worker"]
        outer = f"{v['outer_lr']:g}/{v['outer_momentum']:g}" if "outer_lr" in v else "-"
        print(
            f"  {v['name']:<22} {lr:>8.1e} {outer:>8} {v['heldout_loss']:>9.4f} {rel:>+7.1%} "
            f"{fmt_bytes(v['bytes_per_worker']):>13} {ratio:>8.1f}x {v['wall_s']:>7.0f}"
        )
    swept = [v for v in result["variants"] if len(v.get("outer_sweep", ())) > 1]
    if swept:
        print("\n  outer lr/momentum sweep (held-out loss), each variant reported at its best:")
        for v in swept:
            cells = (f"{t['outer_lr']:g}/{t['outer_momentum']:g} {t['heldout_loss']:.4f}" for t in v["outer_sweep"])
            print(f"  {v['name']:<22} " + "  ".join(cells))
    print("\n  held-out loss (seed 0) after each round of H steps:")
    for v in result["variants"]:
        print(f"  {v['name']:<22} " + " ".join(f"{x:.3f}" for x in v["heldout_curve"]))
    t = result["targets"]
    print(
        f"\n  int4+EF vs ddp: {t['bytes_ratio']:.1f}x fewer bytes (target >= {BYTES_TARGET:.0f}x): "
        f"{'MET' if t['bytes_met'] else 'MISSED'}; bound ~ H x 4 / 0.53 = {t['bytes_ratio_bound']:.0f}x"
    )
    print(
        f"  int4+EF held-out loss {t['loss_rel']:+.1%} vs ddp (target <= +{LOSS_TARGET:.0%}): "
        f"{'MET' if t['loss_met'] else 'MISSED'}"
    )
    for name, o in t.get("overlap", {}).items():
        print(
            f"  {name} ({o['ahead_steps']} of H steps one outer step late, from the {o['ahead_from']}): "
            f"held-out {o['loss_rel_vs_ddp']:+.1%} "
            f"vs ddp ({'MET' if o['loss_met'] else 'MISSED'}), {o['loss_rel_vs_int4']:+.1%} vs int4+EF without "
            f"overlap; {o['bytes_ratio']:.1f}x fewer bytes than ddp ({'MET' if o['bytes_met'] else 'MISSED'})"
        )
    grid = t.get("state_dtype", {})
    if grid:
        print("\n  the committed state's dtype (int4+EF, no overlap, each at its best outer lr/momentum):")
        print(
            f"  {'state':>6} {'held-out':>9} {'vs ddp':>8} {'vs fp32 state':>14} {'state file':>12} {'file ratio':>11}"
        )
        for dt, o in grid.items():
            print(
                f"  {dt:>6} {o['heldout_loss']:>9.4f} {o['loss_rel_vs_ddp']:>+8.2%} {o['loss_rel_vs_fp32']:>+14.2%} "
                f"{o['state_file_bytes']:>12,} {o['file_ratio_vs_fp32']:>11.3f}"
            )
    print(
        "  replicas bit-identical every round: "
        + ", ".join(f"{v['name']}={v['replicas_identical']}" for v in result["variants"][1:])
    )
    print(f"  total wall time {result['wall_s']:.0f} s")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("hivemind").setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    spec = make_spec(args.seed, args.H)
    task = cell_task(spec, CELL)
    budget = Budget(args.workers, args.H, args.batch, args.rounds)
    init = task.build_model()
    params = sum(p.numel() for p in trainable(init).values())
    setup = {
        "cell": CELL,
        "preset": spec.model.preset,
        "params": params,
        "workers": budget.workers,
        "H": budget.H,
        "batch": budget.batch,
        "rounds": budget.rounds,
        "steps": budget.steps,
        "samples": budget.samples,
        "train_images": int(task.train_data()[0].shape[0]),
        "heldout_images": int(task.heldout_data()[0].shape[0]),
        "eval_seeds": args.eval_seeds,
        "threads": args.threads,
        "outer": {"lr": spec.diloco.outer_lr, "momentum": spec.diloco.outer_momentum, "nesterov": spec.diloco.nesterov},
        "initial_heldout_loss": heldout_loss(task, init, args.eval_seeds),
        "ddp_mode": "in-process exact average of the workers' fp32 gradients; bytes = ring all-reduce "
        "2(W-1)/W x 4 B x params per step per worker, no framing",
        "diloco_bytes": "ExchangeResult.bytes_sent of DataPlane.all_reduce over hivemind P2P, mean over workers",
    }
    log.info(
        "%d params, %d rounds x H=%d x batch %d x %d workers = %d samples per variant",
        params,
        budget.rounds,
        budget.H,
        budget.batch,
        budget.workers,
        budget.samples,
    )

    ddp_sweep = []
    for lr in args.lr_list:
        r = run_ddp(spec, task, budget, lr, args.eval_seeds)
        ddp_sweep.append({"lr": lr, **r})
        log.info("ddp lr %g: held-out %.4f (%.0f s)", lr, r["heldout_loss"], r["wall_s"])
    best_ddp = min(ddp_sweep, key=lambda s: s["heldout_loss"])
    fp32_sweep, diloco = asyncio.run(
        run_diloco_all(
            spec,
            task,
            budget,
            args.lr_list,
            args.eval_seeds,
            args.overlap_list,
            args.naive_overlap_list,
            args.outer_grid,
            args.state_dtype_list,
        )
    )

    variants = [{"name": "ddp", **best_ddp}]
    variants += [{"name": n, **diloco[n]} for n in diloco if n != "diloco_fp32"]
    variants.insert(1, {"name": "diloco_fp32", **diloco["diloco_fp32"]})
    ddp, int4 = variants[0], variants[3]
    ratio = ddp["bytes_per_worker"] / int4["bytes_per_worker"]
    loss_rel = int4["heldout_loss"] / ddp["heldout_loss"] - 1
    overlap = {
        v["name"]: {
            "ahead_steps": v["ahead_steps"],
            "ahead_from": v["ahead_from"],
            "loss_rel_vs_ddp": v["heldout_loss"] / ddp["heldout_loss"] - 1,
            "loss_rel_vs_int4": v["heldout_loss"] / int4["heldout_loss"] - 1,
            "bytes_ratio": ddp["bytes_per_worker"] / v["bytes_per_worker"],
            "loss_met": v["heldout_loss"] / ddp["heldout_loss"] - 1 <= LOSS_TARGET,
            "bytes_met": ddp["bytes_per_worker"] / v["bytes_per_worker"] >= BYTES_TARGET,
        }
        for v in variants
        if v.get("ahead_steps")
    }
    state_grid = {
        v["state_dtype"]: {
            "variant": v["name"],
            "heldout_loss": v["heldout_loss"],
            "loss_rel_vs_ddp": v["heldout_loss"] / ddp["heldout_loss"] - 1,
            "loss_rel_vs_fp32": v["heldout_loss"] / int4["heldout_loss"] - 1,
            "state_file_bytes": v["state_file_bytes"],
            "file_ratio_vs_fp32": v["state_file_bytes"] / int4["state_file_bytes"],
            "outer_lr": v["outer_lr"],
            "outer_momentum": v["outer_momentum"],
        }
        for v in variants
        if v["name"] == "diloco_int4" or v["name"].startswith("diloco_int4_state_")
    }
    result = {
        "setup": setup,
        "lr_sweep": {
            "ddp": [{"lr": s["lr"], "heldout_loss": s["heldout_loss"]} for s in ddp_sweep],
            "diloco_fp32": [{"lr": s["lr"], "heldout_loss": s["heldout_loss"]} for s in fp32_sweep],
        },
        "variants": variants,
        "targets": {
            "bytes_ratio": ratio,
            "bytes_target": BYTES_TARGET,
            "bytes_met": ratio >= BYTES_TARGET,
            "bytes_ratio_bound": budget.H * 4 / 0.53125,
            "loss_rel": loss_rel,
            "loss_target": LOSS_TARGET,
            "loss_met": loss_rel <= LOSS_TARGET,
            "overlap": overlap,
            "state_dtype": state_grid if len(state_grid) > 1 else {},
        },
        "wall_s": time.perf_counter() - t_start,
    }
    print_report(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
