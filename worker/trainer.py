"""Inner loop of one DiLoCo round: H AdamW steps on this member's shard of the cell's data.

The round's data and noise are a pure function of (run, cell, round, member): the sample
indices come from `bagel.models.data.shard`, and every micro-batch draws its t, noise and
label drops from its own CPU generator seeded by sha256 of that key plus (step, micro-batch).
So a re-run round sees exactly the same data, and a worker with N
GPUs (DDP inside the worker, `bagel.worker.ddp`) computes the same contribution as a
single-device worker up to float summation order: micro-batches are laid out per step
independently of the number of ranks, and rank r takes micro-batches r, r+N, ...

Device handling: bf16 autocast on CUDA only (behind a device check), plain fp32 on CPU.
`throttle` > 1 makes a CPU worker slower by sleeping (throttle-1) x the compute time of
each step, which is how one machine plays a heterogeneous swarm.

The inner optimizer (AdamW) lives across rounds while the worker stays on a cell: DiLoCo
keeps each worker's inner optimizer state local and unsynchronized (Douillard et al. 2023,
"DiLoCo", Algorithm 1). It is reset when the cell changes or the worker resyncs.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

# A dataset below this many bytes is moved to the accelerator once instead of per batch.
_RESIDENT_DATA_BYTES = 256 << 20


class CellTaskLike(Protocol):
    """What the trainer needs from `bagel.models.experts.CellTask`."""

    def build_model(self) -> nn.Module: ...
    def train_data(self) -> tuple[torch.Tensor, torch.Tensor]: ...
    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, generator: torch.Generator) -> torch.Tensor: ...


class Collective(Protocol):
    """Sum all-reduce across the ranks of one worker (see `bagel.worker.ddp`)."""

    rank: int
    world_size: int

    def all_reduce_sum(self, buf: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class RoundKey:
    """Identifies one member's work in one round; seeds its data and noise."""

    run_id: str
    cell_id: str
    round: int
    member: int  # position in the round's sorted member list
    members: int


@dataclass(frozen=True)
class InnerPlan:
    inner_steps: int
    micro_batch: int
    grad_accum: int

    def __post_init__(self) -> None:
        if self.inner_steps < 1 or self.micro_batch < 1 or self.grad_accum < 1:
            raise ValueError(f"inner_steps, micro_batch and grad_accum must be >= 1, got {self}")

    @property
    def batch(self) -> int:
        """Samples per optimizer step."""
        return self.micro_batch * self.grad_accum

    @property
    def samples(self) -> int:
        return self.inner_steps * self.batch


@dataclass(frozen=True)
class StepProgress:
    step: int  # inner steps done so far (1-based after the first)
    steps: int
    loss: float  # loss of this step
    samples: int  # samples processed so far this round
    samples_per_s: float  # of this worker, throttle included


@dataclass(frozen=True)
class TrainResult:
    samples: int
    mean_loss: float
    steps: int
    compute_s: float  # wall time of the inner loop, throttle sleeps included
    completed: bool  # False if stopped before `inner_steps`
    # where compute_s went (the round metrics): batches gathered and moved, loss and
    # backward, optimizer steps (with the multi-rank gradient all-reduce), throttle pauses
    data_s: float = 0.0
    forward_backward_s: float = 0.0
    optimizer_s: float = 0.0
    throttle_s: float = 0.0


def micro_batch_seed(key: RoundKey, step: int, j: int) -> int:
    """The 63-bit seed of the noise and timesteps of micro-batch j of inner step `step` of
    one member's round (sha256 of the parts joined by US, so stable across processes).

    Not `bagel.models.data.derive_seed` (sha256 of the parts' repr): the two give different
    numbers, and training numerics and the golden fixtures depend on this one."""
    parts = (key.run_id, key.cell_id, key.round, key.member, step, j)
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def micro_batches(step_batch: int, grad_accum: int, world_size: int) -> int:
    """Number of micro-batches a step's samples are split into.

    `grad_accum` as assigned, rounded up to a multiple of the rank count so every rank of a
    multi-GPU worker gets the same number of micro-batches; never more than the samples.
    """
    m = grad_accum if grad_accum % world_size == 0 else math.ceil(grad_accum / world_size) * world_size
    return max(1, min(m, step_batch))


def pick_device(requested: str = "auto") -> torch.device:
    """`auto` -> the first CUDA device if torch sees one, else CPU; otherwise as given."""
    if requested == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(requested)
    except RuntimeError:
        raise ValueError(f"--device {requested}: expected auto, cpu or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {requested}: this torch build sees no CUDA device")
        index = 0 if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise ValueError(f"--device {requested}: only {torch.cuda.device_count()} CUDA device(s)")
        return torch.device("cuda", index)
    if dev.type != "cpu":
        raise ValueError(f"--device {requested}: expected auto, cpu or cuda:N")
    return dev


class InnerTrainer:
    """Runs the inner steps of rounds of one cell on one device (or one rank of a worker)."""

    def __init__(
        self,
        task: CellTaskLike,
        model: nn.Module,
        device: torch.device,
        *,
        lr: float,
        weight_decay: float = 0.0,
        throttle: float = 1.0,
        collective: Collective | None = None,
    ) -> None:
        if throttle < 1.0:
            raise ValueError(f"throttle must be >= 1 (a slowdown factor), got {throttle}")
        self.task = task
        self.model = model
        self.device = device
        self.lr = lr
        self.weight_decay = weight_decay
        self.throttle = throttle
        self.collective = collective
        self._params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = self._new_optimizer()
        x, y = task.train_data()
        nbytes = x.numel() * x.element_size() + y.numel() * y.element_size()
        self._resident = device.type != "cpu" and nbytes <= _RESIDENT_DATA_BYTES
        self.x = x.to(device) if self._resident else x
        self.y = y.to(device) if self._resident else y

    @property
    def num_train(self) -> int:
        return int(self.x.shape[0])

    def _new_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self._params, lr=self.lr, weight_decay=self.weight_decay)

    def reset_optimizer(self) -> None:
        """Forget the inner AdamW moments (new cell, or state replaced by a resync)."""
        self.optimizer = self._new_optimizer()

    def _autocast(self) -> Any:
        # bf16 autocast only where it is fast and supported; CPU trains in plain fp32.
        if self.device.type == "cuda":
            return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        return torch.autocast(device_type="cpu", enabled=False)

    def run(
        self,
        key: RoundKey,
        plan: InnerPlan,
        indices: torch.Tensor,
        *,
        on_step: Callable[[StepProgress], None] | None = None,
        stop: threading.Event | None = None,
        start_step: int = 0,
        sample_offset: int | None = None,
    ) -> TrainResult:
        """Train steps `start_step` .. `plan.inner_steps - 1` on `indices`, in order: step s
        takes the next `plan.batch` of them from `sample_offset` (default: start_step x
        batch, where a run from step 0 would be), so a round can be trained in two runs,
        even with two batch shapes.

        Stops early (completed=False) when `stop` is set; in a multi-rank worker the stop
        flag rides on the per-step gradient all-reduce, so all ranks stop at the same step.
        """
        if not 0 <= start_step <= plan.inner_steps:
            raise ValueError(f"start_step {start_step} outside 0..{plan.inner_steps}")
        batch = plan.batch
        first = start_step * batch if sample_offset is None else sample_offset
        need = first + (plan.inner_steps - start_step) * batch
        if indices.numel() < need:
            raise ValueError(f"need {need} sample indices, got {indices.numel()}")
        world = self.collective.world_size if self.collective else 1
        rank = self.collective.rank if self.collective else 0
        nmb = micro_batches(batch, plan.grad_accum, world)
        self.model.train()
        losses: list[float] = []
        samples = 0
        t_start = time.perf_counter()
        compute_s = 0.0
        data_s = fb_s = opt_s = pause_s = 0.0
        cuda = self.device.type == "cuda"
        completed = True
        for step in range(start_step, plan.inner_steps):
            t0 = time.perf_counter()
            at = first + (step - start_step) * batch
            step_idx = indices[at : at + batch]
            self.optimizer.zero_grad(set_to_none=False)
            local_loss = 0.0
            for j, mb in enumerate(torch.tensor_split(step_idx, nmb)):
                if j % world != rank or mb.numel() == 0:
                    continue
                t_data = time.perf_counter()
                gen = torch.Generator().manual_seed(micro_batch_seed(key, step, j))
                x = self.x[mb.to(self.x.device)] if self._resident else self.x[mb]
                y = self.y[mb.to(self.y.device)] if self._resident else self.y[mb]
                x = x.to(self.device, non_blocking=True)
                y = y.to(self.device, non_blocking=True)
                t_fb = time.perf_counter()
                data_s += t_fb - t_data
                with self._autocast():
                    loss = self.task.loss(self.model, x, y, gen)
                # weight by micro-batch size so the summed gradient is the mean over the step
                (loss * (mb.numel() / batch)).backward()
                local_loss += float(loss.detach()) * mb.numel() / batch  # waits for the device
                fb_s += time.perf_counter() - t_fb
            t_opt = time.perf_counter()
            stopping = stop is not None and stop.is_set()
            if self.collective is not None and world > 1:
                step_loss, stopping = self._reduce_grads(local_loss, stopping)
            else:
                step_loss = local_loss
            if stopping:
                completed = False
                self.optimizer.zero_grad(set_to_none=False)
                break
            self.optimizer.step()
            if cuda:
                torch.cuda.synchronize(self.device)
            opt_s += time.perf_counter() - t_opt
            losses.append(step_loss)
            samples += step_idx.numel()
            elapsed = time.perf_counter() - t0
            if self.throttle > 1.0:
                pause = (self.throttle - 1.0) * elapsed
                t_pause = time.perf_counter()
                if stop is not None:
                    stop.wait(pause)
                else:
                    time.sleep(pause)
                pause_s += time.perf_counter() - t_pause
            compute_s = time.perf_counter() - t_start
            if on_step is not None and rank == 0:
                on_step(
                    StepProgress(
                        step=step + 1,
                        steps=plan.inner_steps,
                        loss=step_loss,
                        samples=samples,
                        samples_per_s=samples / compute_s if compute_s > 0 else 0.0,
                    )
                )
        compute_s = time.perf_counter() - t_start
        mean = sum(losses) / len(losses) if losses else float("nan")
        return TrainResult(
            samples=samples,
            mean_loss=mean,
            steps=len(losses),
            compute_s=compute_s,
            completed=completed,
            data_s=data_s,
            forward_backward_s=fb_s,
            optimizer_s=opt_s,
            throttle_s=pause_s,
        )

    def _reduce_grads(self, local_loss: float, stopping: bool) -> tuple[float, bool]:
        """One sum all-reduce of [all grads..., loss, stop flag] across the worker's ranks."""
        assert self.collective is not None
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        extra = torch.tensor([local_loss, 1.0 if stopping else 0.0], device=flat.device)
        buf = torch.cat([flat, extra])
        self.collective.all_reduce_sum(buf)
        offset = 0
        for p, g in zip(self._params, grads, strict=True):
            n = g.numel()
            reduced = buf[offset : offset + n].view_as(g).to(g.dtype)
            if p.grad is None:
                p.grad = reduced.clone()
            else:
                p.grad.copy_(reduced)
            offset += n
        return float(buf[-2]), bool(buf[-1] > 0)


def round_indices(shard_fn: Callable[..., Any], key: RoundKey, n: int, plan: InnerPlan) -> torch.Tensor:
    """This member's `plan.samples` sample indices for the round, from `shard(...)`."""
    idx = shard_fn(key.run_id, key.cell_id, key.round, key.member, key.members, n, plan.samples)
    out = torch.as_tensor(idx, dtype=torch.long)
    if out.numel() != plan.samples:
        raise ValueError(f"shard returned {out.numel()} indices, expected {plan.samples}")
    if out.numel() and (int(out.min()) < 0 or int(out.max()) >= n):
        raise ValueError(f"shard returned indices outside [0, {n})")
    return out


@dataclass
class CellRuntime:
    """The model and trainer of the cell a worker (or one rank of it) currently trains."""

    cell_id: str
    task: Any  # bagel.models.experts.CellTask
    model: nn.Module
    trainer: InnerTrainer


def build_runtime(
    spec: Any, cell_id: str, device: torch.device, *, throttle: float = 1.0, collective: Collective | None = None
) -> CellRuntime:
    """Task, model (on `device`) and inner trainer of `cell_id` for run spec `spec`."""
    from bagel.models.experts import cell_task

    task = cell_task(spec, cell_id)
    model = task.build_model().to(device)
    trainer = InnerTrainer(
        task,
        model,
        device,
        lr=spec.diloco.inner_lr,
        weight_decay=spec.diloco.inner_weight_decay,
        throttle=throttle,
        collective=collective,
    )
    return CellRuntime(cell_id, task, model, trainer)
