"""Data parallelism inside one worker: `torchrun --nproc-per-node N -m bagel.worker join ...`.

A worker with N GPUs is still one member of its cell's replica group: one identity, one
DHT node, one coordinator session, one contribution per round. Only rank 0 runs the agent
(coordinator, DHT, averaging, outer step, checkpoints). Ranks 1..N-1 run `follow()`: they
wait for rank 0's next command, receive the round's starting weights by broadcast, and
take their share of every inner step's micro-batches; the trainer sums gradients across
ranks with one all-reduce per inner step (`InnerTrainer._reduce_grads`), so every rank
applies the same AdamW update and rank 0 ends the round holding the worker's local weights.

Backends: NCCL when the ranks own CUDA devices, gloo on CPU (tested with 2 processes).
Commands travel as JSON bytes in a uint8 tensor broadcast from rank 0, never pickled
(`broadcast_object_list` would unpickle; the house rule forbids it even between our own
processes, so one code path handles all bytes the same way).
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# Followers block in a broadcast while rank 0 waits for orders, so the collective timeout
# must outlast the longest idle stretch (a worker may wait hours for a cell).
DEFAULT_TIMEOUT_S = float(os.environ.get("BAGEL_DDP_TIMEOUT_S", 7 * 24 * 3600))
MAX_COMMAND_BYTES = 16 << 20


@dataclass
class DistContext:
    """This process's place in a multi-process worker (world_size 1 = no DDP)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str = ""

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def all_reduce_sum(self, buf: torch.Tensor) -> None:
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)

    def device_for(self, requested: str) -> str:
        """The device this rank should use: cuda:LOCAL_RANK for a CUDA run, else as asked."""
        if self.enabled and requested in ("auto", "cuda") and torch.cuda.is_available():
            return f"cuda:{self.local_rank}"
        return requested

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def shutdown(self) -> None:
        """Leave the process group together: a barrier first, so no rank tears down its
        sockets while another is still reading the last broadcast (gloo aborts the reader)."""
        if self.enabled and dist.is_initialized():
            try:
                dist.barrier()
            finally:
                dist.destroy_process_group()


def init_from_env(device: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S) -> DistContext:
    """Join the process group torchrun describes in the environment, if any."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistContext()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    use_cuda = device != "cpu" and torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return DistContext(rank=rank, world_size=world, local_rank=local_rank, backend=backend)


def _comm_device(ctx: DistContext) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if ctx.backend == "nccl" else torch.device("cpu")


def send_command(ctx: DistContext, command: dict[str, Any]) -> None:
    """Rank 0: broadcast one JSON command to every rank."""
    data = json.dumps(command, separators=(",", ":")).encode()
    if len(data) > MAX_COMMAND_BYTES:
        raise ValueError(f"command of {len(data)} bytes exceeds {MAX_COMMAND_BYTES}")
    dev = _comm_device(ctx)
    n = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    dist.broadcast(n, src=0)
    dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev), src=0)


def recv_command(ctx: DistContext) -> dict[str, Any]:
    """Ranks > 0: receive the next command from rank 0."""
    dev = _comm_device(ctx)
    n = torch.zeros(1, dtype=torch.int64, device=dev)
    dist.broadcast(n, src=0)
    size = int(n.item())
    if not (0 < size <= MAX_COMMAND_BYTES):
        raise ValueError(f"rank 0 announced a {size}-byte command")
    buf = torch.empty(size, dtype=torch.uint8, device=dev)
    dist.broadcast(buf, src=0)
    out = json.loads(bytes(buf.cpu().numpy()).decode())
    if not isinstance(out, dict) or "op" not in out:
        raise ValueError("malformed command from rank 0")
    return out


def broadcast_model(ctx: DistContext, model: nn.Module) -> None:
    """Copy rank 0's parameters and buffers into every rank's model (same order everywhere)."""
    if not ctx.enabled:
        return
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if ctx.backend == "gloo" and t.device.type != "cpu":  # pragma: no cover - gloo is CPU
                tmp = t.detach().cpu()
                dist.broadcast(tmp, src=0)
                t.copy_(tmp)
            else:
                dist.broadcast(t.data, src=0)


def follow(ctx: DistContext, handlers: dict[str, Callable[[dict[str, Any]], None]]) -> None:
    """Ranks > 0: execute rank 0's commands until it sends {"op": "exit"}."""
    while True:
        cmd = recv_command(ctx)
        op = cmd["op"]
        if op == "exit":
            return
        handler = handlers.get(op)
        if handler is None:
            raise ValueError(f"unknown command {op!r} from rank 0")
        handler(cmd)
