"""DDP inside one worker: 2 gloo processes under torchrun train like one process.

The test launches this very file with `python -m torch.distributed.run --nproc-per-node 2`;
under torchrun, `__main__` below runs one rank: rank 0 sends a JSON command and the round's
starting weights, rank 1 follows (`bagel.worker.ddp.follow`), both run the same inner
round with gradients summed by one gloo all-reduce per step, and each saves its final
weights. The test then checks that both ranks hold bit-identical weights, that they match a
single-process run of the same round (up to float summation order), and that a stop
requested on rank 0 alone ends the round at the same step on both ranks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from bagel.models import datashards
from bagel.models.data import shard
from bagel.protocol.runspec import parse_spec
from bagel.worker import ddp
from bagel.worker.roundwork import share_cell_data
from bagel.worker.trainer import InnerPlan, InnerTrainer, RoundKey, round_indices


class LinearTask:
    def __init__(self, n: int = 256) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 6, generator=g)
        self.y = self.x @ torch.randn(6, 1, generator=g)

    def build_model(self) -> nn.Module:
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

    def train_data(self):
        return self.x, self.y

    def loss(self, model, x, y, generator):
        noise = 0.05 * torch.randn(y.shape, generator=generator)
        return ((model(x) + noise - y) ** 2).mean()


PLAN = InnerPlan(inner_steps=6, micro_batch=8, grad_accum=4)
KEY = RoundKey("run", "k0.r0", 3, 1, 2)


def _train(collective, model: nn.Module, task: LinearTask, plan: InnerPlan, stop=None, on_step=None):
    tr = InnerTrainer(task, model, torch.device("cpu"), lr=0.02, collective=collective)
    return tr.run(KEY, plan, round_indices(shard, KEY, tr.num_train, plan), stop=stop, on_step=on_step)


def _cell_data() -> datashards.CellData:
    g = torch.Generator().manual_seed(5)
    return datashards.CellData(
        torch.rand(20, 1, 8, 8, generator=g), torch.randint(0, 10, (20,), generator=g),
        torch.rand(4, 1, 8, 8, generator=g), torch.arange(4),
    )  # fmt: skip


def _rank_main(out: Path) -> None:
    ctx = ddp.init_from_env("cpu", timeout_s=60)
    task = LinearTask()
    model = task.build_model()
    results: dict[str, object] = {}

    def on_train(cmd):
        plan = InnerPlan(**cmd["plan"])
        ddp.broadcast_model(ctx, model)
        res = _train(ctx, model, task, plan)
        results["train"] = res.samples

    def on_stop_round(cmd):
        plan = InnerPlan(**cmd["plan"])
        res = _train(ctx, model, task, plan)
        results["stopped_steps"] = res.steps

    if ctx.is_leader:
        with torch.no_grad():  # rank 0's weights differ from rank 1's fresh init: the broadcast must fix that
            for p in model.parameters():
                p.add_(0.1)
        ddp.send_command(ctx, {"op": "train", "plan": PLAN.__dict__})
        ddp.broadcast_model(ctx, model)
        results["train"] = _train(ctx, model, task, PLAN).samples
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / f"rank{ctx.rank}.safetensors"))
        ddp.send_command(ctx, {"op": "stop_round", "plan": PLAN.__dict__})
        stop = threading.Event()

        def on_step(p):
            if p.step == 2:
                stop.set()  # only rank 0 sees this; the flag must reach rank 1 through the all-reduce

        res = _train(ctx, model, task, PLAN, stop=stop, on_step=on_step)
        results["stopped_steps"] = res.steps
        # a cell's fetched data: sent when the other ranks are to build the cell, not again
        spec = parse_spec(DDP_SPEC)
        datashards.install(spec, "k0.r0", _cell_data())
        results["shared"] = [share_cell_data(ctx, spec, "k0.r0"), share_cell_data(ctx, spec, "k0.r0")]
        # bytes that do not match the announced digest: rank 1 refuses them
        tensors = list(dataclasses.astuple(_cell_data()))
        ddp.send_command(ctx, {"op": "data", **ddp.describe_tensors(tensors), "sha256": "0" * 64})
        ddp.send_tensors(ctx, tensors)
        ddp.send_command(ctx, {"op": "exit"})
    else:

        def on_train_and_save(cmd):
            on_train(cmd)
            save_file(
                {k: v.contiguous() for k, v in model.state_dict().items()}, str(out / f"rank{ctx.rank}.safetensors")
            )

        def on_data(cmd):
            try:
                got = ddp.recv_tensors(ctx, cmd)
            except ValueError as e:
                results.setdefault("refused", []).append(str(e))
                return
            save_file({f"t{i}": t for i, t in enumerate(got)}, str(out / "rank1-data.safetensors"))

        ddp.follow(ctx, {"train": on_train_and_save, "stop_round": on_stop_round, "data": on_data})
    (out / f"rank{ctx.rank}.json").write_text(json.dumps(results | {"backend": ctx.backend, "world": ctx.world_size}))
    ctx.shutdown()
    # The group is left (barrier, destroy) above, so a crash there still fails the test. Skip
    # the interpreter's own teardown: once in five full runs a rank aborted in it with
    # "terminate called without an active exception" (a C++ thread still joinable when
    # torch's static objects are destroyed), after both ranks had written their results.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.timeout(120)
def test_two_gloo_ranks_train_like_one_process(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", BAGEL_DDP_TEST_OUT=str(tmp_path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        str(Path(__file__)),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r0 = load_file(str(tmp_path / "rank0.safetensors"))
    r1 = load_file(str(tmp_path / "rank1.safetensors"))
    for k in r0:
        assert torch.equal(r0[k], r1[k]), k
    info0 = json.loads((tmp_path / "rank0.json").read_text())
    info1 = json.loads((tmp_path / "rank1.json").read_text())
    assert info0["backend"] == info1["backend"] == "gloo" and info0["world"] == 2
    assert info0["train"] == PLAN.samples  # rank 0 reports the whole worker's samples
    assert info0["stopped_steps"] == info1["stopped_steps"] == 2
    # the fetched data reached rank 1 whole, once; a mismatched digest was refused
    want = list(dataclasses.astuple(_cell_data()))
    nbytes = sum(t.numel() * t.element_size() for t in want)
    assert info0["shared"] == [[True, nbytes], [True, 0]]
    got = load_file(str(tmp_path / "rank1-data.safetensors"))
    assert len(got) == 4 and all(torch.equal(got[f"t{i}"], t) for i, t in enumerate(want))
    assert len(info1["refused"]) == 1 and "digest" in info1["refused"][0]

    # the same round in one process, from rank 0's starting weights
    task = LinearTask()
    model = task.build_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1)
    _train(None, model, task, PLAN)
    single = model.state_dict()
    for k in r0:
        torch.testing.assert_close(r0[k], single[k], rtol=1e-5, atol=1e-6)
    assert not torch.equal(r0["0.weight"], task.build_model().state_dict()["0.weight"])


def test_a_data_description_out_of_bounds_is_refused_before_any_broadcast():
    """Checked before a buffer is allocated or a collective joined (no process group here)."""
    one = {"dtype": "float32", "shape": [2, 3]}
    for bad in (
        None,
        {"tensors": []},
        {"tensors": [one] * (ddp.MAX_DATA_TENSORS + 1)},
        {"tensors": [{"dtype": "bfloat16", "shape": [2]}]},
        {"tensors": [{"dtype": "object", "shape": [2]}]},
        {"tensors": [{"dtype": "float32", "shape": [2, -1]}]},
        {"tensors": [{"dtype": "float32", "shape": [2.5]}]},
        {"tensors": [{"dtype": "float32", "shape": [1] * 9}]},
        {"tensors": [{"dtype": "float32", "shape": [ddp.MAX_DATA_BYTES // 4 + 1]}]},
        {"tensors": [{"dtype": "uint8", "shape": [ddp.MAX_DATA_BYTES]}, {"dtype": "uint8", "shape": [1]}]},
        {"tensors": ["float32"]},
    ):
        with pytest.raises(ValueError):
            ddp.recv_tensors(ddp.DistContext(), bad)
    t = [torch.arange(6.0).reshape(2, 3), torch.tensor([1, 2])]
    d = ddp.describe_tensors(t)
    assert d["tensors"] == [{"dtype": "float32", "shape": [2, 3]}, {"dtype": "int64", "shape": [2]}]
    assert d["sha256"] == ddp.tensors_digest([x.clone() for x in t]) != ddp.tensors_digest([t[0], t[1] + 1])
    assert ddp.tensors_digest([t[0].reshape(3, 2)]) != ddp.tensors_digest([t[0]])  # the shape counts too


DDP_SPEC = """
[run]
id = "ddp"
[model]
arch = "dit"
preset = "tiny"
image_size = 8
channels = 1
num_classes = 10
[data]
source = "digits"
clusters = 1
[cells]
timestep_ranges = 1
router = false
[diloco]
inner_steps = 6
group_batch = 32
codec = "int8"
[schedule]
min_replicas = 1
lease_s = 4.0
heartbeat_s = 0.5
# two gloo ranks share this box's 2 cores with everything else: give rounds time
min_round_s = 6.0
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_worker_with_two_gloo_ranks_commits_rounds(tmp_path):
    """`torchrun --nproc-per-node 2 -m bagel.worker join ...` next to a one-process worker:
    rank 0 talks to the coordinator and the DHT, rank 1 follows it; each round both
    workers end bit-identical (equal hashes in their commit events). The DDP worker has no
    data of its own (`--fetch-data always`), the case of a volunteer without the dataset:
    rank 0 fetches its cell's shards and sends rank 1 the decoded tensors, which rank 1
    checks against their sha256 and must use (it refuses to train on a copy of its own).
    The one-process worker loads the bundled dataset itself, as a rank with a local copy
    does (`cell_task`, the same code on every rank)."""
    import time

    from bagel.worker.swarm import CoordinatorProc, Managed, WorkerProc, cleanup, free_port

    spec = tmp_path / "spec.toml"
    spec.write_text(DDP_SPEC)
    procs: list[Managed] = []
    with cleanup(procs):
        coord = CoordinatorProc.make(spec, tmp_path / "coord", tmp_path / "coord.log")
        procs.append(coord)
        coord.start_and_wait(timeout_s=90)
        single = WorkerProc.make(coord.join, tmp_path / "single", tmp_path / "single.log", name="single")
        procs.append(single)
        single.start()
        fetch = ["--fetch-data", "always"]
        ddp_w = WorkerProc.make(coord.join, tmp_path / "ddp", tmp_path / "ddp.log", name="ddp", extra=fetch)
        ddp_w.argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            "-m",
            *ddp_w.argv[ddp_w.argv.index("bagel.worker") :],
        ]
        procs.append(ddp_w)
        ddp_w.start()

        def both_committed() -> list[int]:
            a = {e["round"]: e for e in single.events("committed")}
            b = {e["round"]: e for e in ddp_w.events("committed")}
            return [r for r in sorted(set(a) & set(b)) if b[r]["samples"] > 0 and a[r]["samples"] > 0]

        deadline = time.monotonic() + 200
        while len(both_committed()) < 2 and time.monotonic() < deadline:
            assert ddp_w.alive(), ddp_w.log_text()[-3000:]
            time.sleep(0.5)
        rounds = both_committed()
        assert len(rounds) >= 2, ddp_w.log_text()[-3000:] + single.log_text()[-2000:]
        a = {e["round"]: e for e in single.events("committed")}
        b = {e["round"]: e for e in ddp_w.events("committed")}
        for r in rounds:
            assert a[r]["hash"] == b[r]["hash"] and a[r]["contributors"] == 2
        prof = ddp_w.events("profile")[0]
        assert prof  # rank 0 profiled and registered for the whole worker
        assert ddp_w.events("data-ready") and not single.events("data-ready")
        sent = ddp_w.events("data-to-ranks")  # once, before rank 1 built the cell's model, never again
        assert [(e["cell"], e["ranks"]) for e in sent] == [("k0.r0", 1)] and sent[0]["nbytes"] > 0, sent
        assert not [e for e in ddp_w.events("data-fetch-failed")], ddp_w.log_text()[-3000:]
        # torchrun forwards SIGTERM to both ranks (rank 1 ignores it and waits for rank 0's
        # exit command); torchrun itself then exits non-zero by design (SignalException),
        # so what is checked is that rank 0 left gracefully and every rank is gone in time
        ddp_w.stop(timeout_s=60)
        assert ddp_w.events("left"), ddp_w.log_text()[-3000:]
        assert "forcefully exiting" not in ddp_w.log_text(), ddp_w.log_text()[-3000:]


if __name__ == "__main__":
    torch.set_num_threads(1)
    _rank_main(Path(os.environ["BAGEL_DDP_TEST_OUT"]))
