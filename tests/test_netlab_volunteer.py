"""A volunteer without the dataset, on the network test bed (sim/netlab/, root only).

The real coordinator on the public segment serves a folder dataset (PNG files, two classes,
two clusters, so two cells); one real worker behind a NAT runs in a mount namespace where
that folder does not exist. It fetches the shards of the one cell it is given, and only
those (its cache holds exactly the names `models/datashards.py` derives for that cell,
fewer than the run's), trains and commits rounds. Then the volunteer controls of the same
process: SIGUSR1 pauses it (it leaves the run and says so; sent to the process group, it stops nothing else),
SIGUSR2 resumes it (it joins
again and commits further rounds from the state it kept, with its data from the cache).
Tampering and resuming a download are covered in-process by tests/test_datafetch.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bagel.sim.netlab.bed import NetLab, bed_namespaces, missing_prerequisite

REASON = missing_prerequisite()
needs_bed = pytest.mark.skipif(REASON is not None, reason=f"no network test bed here: {REASON}")

SPEC = """
[run]
id = "vol"
seed = 0

[model]
arch = "dit"
preset = "tiny"
image_size = 8
channels = 1
num_classes = 2

[data]
source = "folder"
path = "{path}"
clusters = 2
holdout_fraction = 0.1

[cells]
timestep_ranges = 1
router = false

[diloco]
inner_steps = 4
group_batch = 16
codec = "int8"

[schedule]
min_replicas = 1
max_replicas = 4
lease_s = 4.0
heartbeat_s = 0.5
deadline_slack = 3.0
min_round_s = 1.0

[checkpoint]
every_rounds = 1000
keep = 2
"""


def _folder(root: Path) -> None:
    """Two classes of 8x8 PNGs (digits 0 and 1), one sub-folder each."""
    from PIL import Image
    from sklearn.datasets import load_digits

    d = load_digits()
    for label in (0, 1):
        out = root / f"class{label}"
        out.mkdir(parents=True)
        for i, img in enumerate(d.images[d.target == label][:60]):
            Image.fromarray((img * 255 / 16).astype(np.uint8), mode="L").save(out / f"{i:03d}.png")


def _events(path: Path, kind: str) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        with contextlib.suppress(json.JSONDecodeError):
            rec = json.loads(line)
            if isinstance(rec, dict) and rec.get("event") == kind:
                out.append(rec)
    return out


def _wait(pred: Any, timeout_s: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.3)


@needs_bed
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_worker_without_the_data_fetches_its_cells_shards_trains_pauses_and_resumes(tmp_path: Path) -> None:
    from bagel.models.data import load_dataset
    from bagel.models.datashards import build_shards, cell_shards
    from bagel.protocol.runspec import parse_spec

    hidden = tmp_path / "operator"  # hidden from the worker by a tmpfs mounted over it
    data = hidden / "digits01"
    _folder(data)
    spec_text = SPEC.replace("{path}", str(data))
    spec_file = tmp_path / "spec.toml"
    spec_file.write_text(spec_text)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with NetLab(tag="vo", homes=1, per_home=1, public=0) as lab:

        def start(node: str, argv: list[str]) -> tuple[subprocess.Popen[bytes], Path]:
            log = tmp_path / f"{node}.log"
            with open(log, "ab") as f:
                proc = lab.run_in(node, argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
            return proc, log

        _, coord = start(
            "coord",
            [sys.executable, "-m", "bagel.coordinator", "serve", "--run", str(spec_file),
             "--data-dir", str(tmp_path / "coord"), "--listen", "198.51.100.10:7070",
             "--dht-listen", "/ip4/198.51.100.10/tcp/7071", "--tick-ms", "100"],
        )  # fmt: skip
        join = ""

        def joined() -> bool:
            nonlocal join
            lines = coord.read_text(errors="replace").splitlines() if coord.exists() else []
            join = next((ln.removeprefix("join:").strip() for ln in lines if ln.startswith("join:")), "")
            return bool(join)

        _wait(joined, 120, "the join string", coord)
        cache = tmp_path / "w" / "runs" / "vol" / "datashards"
        worker_cmd = (
            f"mount -t tmpfs tmpfs {hidden} && test ! -e {data} && exec {sys.executable} -m bagel.worker join {join} "
            f"--data-dir {tmp_path / 'w'} --log-json --name home --cpu-threads 1 --max-upload-mbps 50"
        )
        worker, wlog = start("home1-1", ["unshare", "-m", "--propagation", "private", "sh", "-c", worker_cmd])
        _wait(lambda: len(_events(wlog, "committed")) >= 2, 150, "two committed rounds", wlog)

        fetch = _events(wlog, "data-fetch")
        ready = _events(wlog, "data-ready")
        assert len(fetch) == 1 and len(ready) == 1, (fetch, ready)
        cell = fetch[0]["cell"]
        spec = parse_spec(spec_text)
        refs = [r for r, _ in build_shards(load_dataset(spec), spec.guard.eval_samples)]
        mine = {r.sha256 for r in cell_shards(refs, cell)}
        assert {p.name for p in cache.iterdir()} == mine  # exactly this cell's shards, no .part left
        assert len(mine) < len(refs)
        assert ready[0]["fetched_bytes"] == sum(r.nbytes for r in refs if r.sha256 in mine)
        assert ready[0]["fetched_bytes"] < sum(r.nbytes for r in refs)
        assert ready[0]["samples"] == sum(r.count for r in refs if r.sha256 in mine and r.split == "train")
        assert {e["cell"] for e in _events(wlog, "committed")} == {cell}

        # pause (sent to the whole process group: the worker's DHT child ignores it): it
        # leaves the run and says so; resume: it joins again and commits more rounds
        os.killpg(worker.pid, signal.SIGUSR1)
        _wait(lambda: _events(wlog, "paused"), 60, "the paused event", wlog)
        assert _events(wlog, "left"), "a paused worker leaves the run"
        before = len(_events(wlog, "committed"))
        time.sleep(1.0)
        assert len(_events(wlog, "committed")) == before  # nothing trains while paused
        os.kill(worker.pid, signal.SIGUSR2)
        _wait(lambda: _events(wlog, "resumed"), 60, "the resumed event", wlog)
        _wait(lambda: len(_events(wlog, "committed")) >= before + 1, 90, "a commit after resuming", wlog)
        assert len(_events(wlog, "data-fetch")) == 1  # the cell's data stayed in this process
        worker.send_signal(signal.SIGTERM)
        try:
            rc = worker.wait(timeout=60)
        except subprocess.TimeoutExpired:  # say where it hangs: every thread's stack, then fail
            worker.send_signal(signal.SIGQUIT)
            time.sleep(2.0)
            raise AssertionError(f"the worker did not stop:\n{wlog.read_text(errors='replace')[-8000:]}") from None
        assert rc == 0
    assert bed_namespaces("bagelnl-vo-") == []
