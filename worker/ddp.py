"""Data parallelism inside one worker: `torchrun --nproc-per-node N -m bagel.worker join ...`.

A worker with N GPUs is still one member of its cell's replica group: one identity, one
DHT node, one coordinator session, one contribution per round. Only rank 0 runs the agent
(coordinator, DHT, averaging, outer step, checkpoints). Ranks 1..N-1 run `follow()`: they
wait for rank 0's next command, receive the round's starting weights by broadcast, and
take their share of every inner step's micro-batches; the trainer sums gradients across
ranks with one all-reduce per inner step (`InnerTrainer._reduce_grads`), so every rank
applies the same AdamW update and rank 0 ends the round holding the worker's local weights.

A worker without a local copy of the dataset fetches its cell's shards on rank 0 only
(`datafetch`); before the other ranks build a cell's runtime, rank 0 sends them the cell's
decoded tensors (`send_tensors`: described in a command, then broadcast, then checked
against the sha256 the command carries), so every rank trains on the same fetched data.

Backends: NCCL when the ranks own CUDA devices, gloo on CPU (tested with 2 processes).
Commands travel as JSON bytes in a uint8 tensor broadcast from rank 0, never pickled
(`broadcast_object_list` would unpickle; the house rule forbids it even between our own
processes, so one code path handles all bytes the same way).
"""

from __future__ import annotations

import datetime
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bagel.protocol.statehash import state_hash

# Followers block in a broadcast while rank 0 waits for orders, so the collective timeout
# must outlast the longest idle stretch (a worker may wait hours for a cell).
DEFAULT_TIMEOUT_S = float(os.environ.get("BAGEL_DDP_TIMEOUT_S", 7 * 24 * 3600))
MAX_COMMAND_BYTES = 16 << 20
# what rank 0 may send the other ranks as data: a cell's decoded training and held-out
# tensors (`models.datashards.CellData`); the bound stops a wrong description from
# allocating the machine's memory, it is not a limit any real cell comes near
MAX_DATA_TENSORS = 8  # at most 10: `tensors_digest` names them by one digit
MAX_DATA_BYTES = 64 << 30
_DATA_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.uint8, torch.int64, torch.float32, torch.float16)}


@dataclass
class DistContext:
    """This process's place in a multi-process worker (world_size 1 = no DDP)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str = ""
    # rank 0: the cell whose runtime the other ranks hold; they build a new one when a train
    # command names another cell, and that is when they need its fetched data (`roundwork`)
    followers_cell: str = ""

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


def tensors_digest(tensors: Sequence[torch.Tensor]) -> str:
    """The canonical state hash (`protocol.statehash`: dtype, shape and bytes of each) of
    the tensors, named by their position (at most `MAX_DATA_TENSORS`, so one digit each and
    the hash's sorted order is theirs)."""
    return state_hash({str(i): t for i, t in enumerate(tensors)})


def describe_tensors(tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
    """The part of a command that lets the other ranks receive `send_tensors`."""
    return {
        "tensors": [{"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)} for t in tensors],
        "sha256": tensors_digest(tensors),
    }


def send_tensors(ctx: DistContext, tensors: Sequence[torch.Tensor]) -> None:
    """Rank 0: broadcast CPU tensors, after a command carrying `describe_tensors` of them."""
    dev = _comm_device(ctx)
    for t in tensors:
        dist.broadcast(t.detach().contiguous().to(dev), src=0)


def recv_tensors(ctx: DistContext, described: Any) -> list[torch.Tensor]:
    """Ranks > 0: the CPU tensors rank 0 describes (`describe_tensors`) and then sends.
    ValueError for a description out of bounds, or bytes that do not match its digest."""
    items = described.get("tensors") if isinstance(described, dict) else None
    if not isinstance(items, list) or not 0 < len(items) <= MAX_DATA_TENSORS:
        raise ValueError("rank 0 described no tensors, or too many")
    shapes: list[tuple[torch.dtype, tuple[int, ...]]] = []
    total = 0
    for item in items:
        dtype = _DATA_DTYPES.get(str(item.get("dtype"))) if isinstance(item, dict) else None
        shape = item.get("shape") if isinstance(item, dict) else None
        if dtype is None or not isinstance(shape, list) or len(shape) > 8:
            raise ValueError(f"rank 0 described a tensor this rank does not take: {item!r:.200}")
        if not all(isinstance(n, int) and n >= 0 for n in shape):
            raise ValueError(f"rank 0 described a tensor of shape {shape!r:.200}")
        total += math.prod(shape) * dtype.itemsize
        if total > MAX_DATA_BYTES:
            raise ValueError(f"rank 0 described more than {MAX_DATA_BYTES} bytes of tensors")
        shapes.append((dtype, tuple(shape)))
    dev = _comm_device(ctx)
    out = []
    for dtype, shape in shapes:
        buf = torch.empty(shape, dtype=dtype, device=dev)
        dist.broadcast(buf, src=0)
        out.append(buf.cpu())
    if tensors_digest(out) != described.get("sha256"):
        raise ValueError("the tensors rank 0 sent do not match the digest it announced")
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
