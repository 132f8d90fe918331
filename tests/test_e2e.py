"""End to end, multi-process, on loopback: a real coordinator and real `bagel-worker` processes.

Every process is a subprocess in its own process group
(`bagel.worker.swarm`), so a SIGKILL takes its hivemind DHT child and p2pd daemon with it,
and teardown stops all of them even when an assertion fails. The run is one cell
(one cluster, one timestep range, no router) of the tiny DiT with H = 5 inner steps, int8
pseudo-gradients with error feedback, and 3 s leases, so a round takes a few seconds.

Facts are read from the workers' `--log-json` events (synced / committed / left, with
hashes, contributor counts and bytes) and from `--keep-round-history` checkpoints, one
safetensors file per committed round, which the tests load and compare tensor by tensor.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from bagel.protocol.runspec import parse_spec
from bagel.protocol.statehash import state_hash
from bagel.worker.swarm import CoordinatorProc, Managed, WorkerProc, cleanup, free_port, get_status

pytestmark = pytest.mark.slow

SPEC = """
[run]
id = "e2e"
seed = 0

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
router = false

[diloco]
inner_steps = 10
inner_lr = 0.002
group_batch = 32
codec = "int8"
error_feedback = true

[schedule]
min_replicas = 1
max_replicas = 4
lease_s = 3.0
heartbeat_s = 0.5
deadline_slack = 3.0
min_round_s = 1.0
quorum = 0.5

[checkpoint]
every_rounds = 2
keep = 3
"""
CELL = "k0.r0"
# A sleep-based slowdown (no extra CPU) for the tests where a worker must sync within one
# round: on this box a tiny-model round is otherwise about as short as a state transfer,
# far from the minutes-long rounds of a real run.
SLOW = 3.0


class Swarm:
    """One coordinator plus workers under tmp_path; `procs` is torn down by `cleanup`."""

    def __init__(self, root: Path, procs: list[Managed]) -> None:
        self.root = root
        self.procs = procs
        self.spec_path = root / "spec.toml"
        self.spec_path.write_text(SPEC)
        self.port = free_port()
        self.coordinator: CoordinatorProc | None = None
        self.workers: dict[str, WorkerProc] = {}
        self.restarts: dict[str, int] = {}

    def start_coordinator(self) -> CoordinatorProc:
        n = sum(1 for p in self.procs if p.name == "coordinator")
        c = CoordinatorProc.make(self.spec_path, self.root / "coord", self.root / f"coord{n}.log", port=self.port)
        self.procs.append(c)
        c.start_and_wait(timeout_s=90)
        self.coordinator = c
        return c

    def start_worker(self, name: str, *extra: str, throttle: float = 1.0) -> WorkerProc:
        assert self.coordinator is not None
        n = self.restarts.get(name, -1) + 1
        self.restarts[name] = n
        w = WorkerProc.make(
            self.coordinator.join,
            self.root / name,
            self.root / f"{name}.{n}.log",
            name=name,
            throttle=throttle,
            extra=["--keep-round-history", "--reduce-timeout-s", "20", *extra],
        )
        self.procs.append(w)
        w.start()
        self.workers[name] = w
        return w

    def events(self, name: str, kind: str) -> list[dict[str, Any]]:
        """Events of every incarnation of worker `name`."""
        out = []
        for p in self.procs:
            if isinstance(p, WorkerProc) and p.name == name:
                out += p.events(kind)
        return out

    def commits(self, name: str) -> dict[int, dict[str, Any]]:
        return {e["round"]: e for e in self.events(name, "committed")}

    def status(self) -> Any:
        assert self.coordinator is not None
        # signed with the daemon's own key: the detailed view, which lists the workers
        return get_status(
            self.coordinator.endpoint,
            tls_fingerprint=self.coordinator.tls_fingerprint,
            key=self.root / "coord" / "coordinator.key",
        )

    def committed_round(self) -> int:
        try:
            return next(c.committed_round for c in self.status().cells if c.cell_id == CELL)
        except Exception:  # the coordinator is restarting
            return -1

    def history(self, name: str, rnd: int) -> dict[str, torch.Tensor]:
        path = self.root / name / "runs" / "e2e" / "history" / f"{CELL}.r{rnd}.safetensors"
        tensors = load_file(str(path))
        return {k: v for k, v in tensors.items() if not k.startswith("e.")}

    def wait(self, what: str, cond: Callable[[], Any], timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            v = cond()
            if v:
                return v
            for p in self.procs:
                if p is self.coordinator and not p.alive():
                    raise AssertionError(f"coordinator died:\n{p.log_text()[-3000:]}")
            time.sleep(0.5)
        logs = "\n".join(f"--- {p.name} ({p.log_path.name})\n{_tail(p)}" for p in self.procs)
        raise AssertionError(f"timed out after {timeout_s}s waiting for: {what}\n{logs}")


def _tail(p: Managed) -> str:
    lines = [line for line in p.log_text().splitlines() if '"event": "step"' not in line]
    return "\n".join(lines[-15:])


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[Swarm]:
    procs: list[Managed] = []
    with cleanup(procs):
        yield Swarm(tmp_path, procs)


def full_rounds(s: Swarm, names: list[str]) -> list[int]:
    """Rounds that every one of `names` committed as a weighted contributor of len(names)."""
    per = [s.commits(n) for n in names]
    common = set(per[0])
    for c in per[1:]:
        common &= set(c)
    return sorted(r for r in common if all(c[r]["contributors"] == len(names) and c[r]["samples"] > 0 for c in per))


def committed_by_all(s: Swarm, names: list[str]) -> list[int]:
    """Rounds that every one of `names` committed, as a weighted or a catch-up contributor."""
    common = set(s.commits(names[0]))
    for n in names[1:]:
        common &= set(s.commits(n))
    return sorted(common)


def consecutive(rounds: list[int], k: int) -> list[int]:
    for i in range(len(rounds) - k + 1):
        if rounds[i + k - 1] - rounds[i] == k - 1:
            return rounds[i : i + k]
    return []


def assert_replicas_identical(s: Swarm, names: list[str], rnd: int) -> str:
    """Equal hashes in the commit events, and equal tensors in the per-round checkpoints."""
    hashes = {s.commits(n)[rnd]["hash"] for n in names}
    assert len(hashes) == 1, f"round {rnd}: workers report different hashes {hashes}"
    ref = s.history(names[0], rnd)
    assert state_hash(ref) == next(iter(hashes))
    for n in names[1:]:
        other = s.history(n, rnd)
        assert set(other) == set(ref)
        for k in ref:
            assert torch.equal(ref[k], other[k]), f"round {rnd}: {n} differs from {names[0]} in {k}"
    return next(iter(hashes))


def heldout_loss(state: dict[str, torch.Tensor] | None) -> float:
    from bagel.models.experts import cell_task
    from bagel.worker.diloco import CellState

    task = cell_task(parse_spec(SPEC), CELL)
    model = task.build_model()
    if state is not None:
        CellState.from_flat(state).load_into(model)
    x, y = task.heldout_data()
    return task.eval_loss(model, x, y, seed=0)


def stop_all_workers(s: Swarm) -> None:
    for w in s.workers.values():
        if w.alive():
            assert w.stop(timeout_s=40) == 0, f"{w.name} did not exit cleanly:\n{_tail(w)}"
            assert w.events("left"), f"{w.name} exited without Leave"


# ---------------------------------------------------------------------------- three workers, bit-identical


@pytest.mark.timeout(240)
def test_three_workers_commit_bit_identical_rounds(swarm: Swarm):
    s = swarm
    s.start_coordinator()
    names = ["a", "b", "c"]
    for n in names:
        s.start_worker(n)

    # 3 consecutive rounds that all 3 replicas committed (a member that misses a freeze
    # still applies the round as a zero-weight catch-up contributor), one of them with
    # all 3 contributing samples
    def window() -> list[int]:
        rounds = committed_by_all(s, names)
        full = set(full_rounds(s, names))
        for i in range(len(rounds) - 2):
            w = rounds[i : i + 3]
            if w[2] - w[0] == 2 and full & set(w):
                return w
        return []

    rounds = s.wait("3 consecutive rounds committed by all 3 workers", window, timeout_s=180)
    for r in rounds:
        assert_replicas_identical(s, names, r)
        for n in names:
            c = s.commits(n)[r]
            # bytes are counted, and int8 pseudo-gradients are far smaller than the fp32 state:
            # verified reducers send every part to its primary and its shadow, about
            # 3 (k-1)/k x enc(n) = 2 x state/4 at k = 3 (1.5x the plain butterfly's 4/3 x state/4)
            assert c["bytes_sent"] > 0 and c["bytes_received"] > 0
            state_nbytes = sum(t.numel() * 4 for k, t in s.history(n, r).items() if k.startswith("w."))
            assert c["bytes_sent"] < 0.6 * state_nbytes
    assert s.committed_round() >= rounds[-1]
    initial = heldout_loss(None)
    first = heldout_loss(s.history("a", rounds[0]))
    last = heldout_loss(s.history("a", rounds[-1]))
    assert initial > first > last, f"held-out loss did not go down: {initial:.4f} -> {first:.4f} -> {last:.4f}"
    stop_all_workers(s)


# ---------------------------------------------------------------------------- a SIGKILLed worker


@pytest.mark.timeout(300)
def test_sigkilled_worker_round_commits_without_it_and_it_rejoins(swarm: Swarm):
    s = swarm
    s.start_coordinator()
    names = ["a", "b", "c"]
    for n in names:
        s.start_worker(n, throttle=SLOW)
    s.wait("a round committed by all 3", lambda: full_rounds(s, names), timeout_s=150)

    def training_now() -> int | None:  # "c" started a round it has not finished: mid-round
        trains = s.events("c", "train")
        readies = {e["round"] for e in s.events("c", "ready")}
        if trains and trains[-1]["round"] not in readies:
            return int(trains[-1]["round"])
        return None

    killed_round = s.wait("c mid-round", training_now, timeout_s=60)
    s.workers["c"].kill()
    # that round (or its re-run) commits with the two survivors
    survivors = s.wait(
        "a round >= the killed one committed by a and b only",
        lambda: [r for r in full_rounds(s, ["a", "b"]) if r >= killed_round],
        timeout_s=60,
    )
    assert_replicas_identical(s, ["a", "b"], survivors[0])
    assert killed_round not in s.commits("c")

    s.start_worker("c", throttle=SLOW)
    reg = s.wait("c re-registered", lambda: s.workers["c"].events("registered"), timeout_s=90)
    assert s.workers["c"].events("resumed") or s.workers["c"].events("synced")
    at_restart = max(s.commits("a"))  # the last round committed before c came back

    def rejoined() -> list[int]:
        return [r for r in s.commits("c") if r > at_restart and r in s.commits("a")]

    back = s.wait("c commits a round again", rejoined, timeout_s=90)
    assert back[0] <= at_restart + 2, f"c took part again only in round {back[0]}, restarted after {at_restart}"
    s.wait(f"a, b and c all report round {back[0]}", lambda: back[0] in committed_by_all(s, names), timeout_s=30)
    assert_replicas_identical(s, ["a", "b", "c"], back[0])
    assert reg


# ---------------------------------------------------------------------------- a late joiner


@pytest.mark.timeout(300)
def test_late_joiner_syncs_from_a_peer_and_contributes_next_round(swarm: Swarm):
    s = swarm
    s.start_coordinator()
    for n in ("a", "b"):
        s.start_worker(n, throttle=SLOW)
    s.wait("round 5 committed", lambda: s.committed_round() >= 5, timeout_s=180)
    s.start_worker("late", throttle=SLOW)
    # The joiner's first commit, and the state it started that round from. A sync can go
    # stale before it is used: the round that was open when the joiner registered has a
    # fixed member set, so when it commits first the joiner syncs again from a donor.
    first = s.wait("the joiner commits a round", lambda: min(s.commits("late"), default=None), timeout_s=120)
    synced = [e for e in s.events("late", "synced") if e["round"] < first]
    assert synced, f"the joiner committed round {first} without a sync before it"
    last_sync = synced[-1]
    j = last_sync["round"]
    assert j >= 5
    assert all(e["source"].startswith("donor ") for e in synced), synced  # from a peer, not the checkpoint
    assert s.commits("a")[j]["hash"].startswith(last_sync["hash"])  # verified against the committed hash
    # it takes part in the exchange of the round right after that state (as a zero-weight
    # catch-up contributor if it synced after that round started, else with its samples)
    assert first == j + 1, f"synced round {j} but first committed round {first}"
    s.wait(f"all report round {j + 1}", lambda: j + 1 in committed_by_all(s, ["a", "b", "late"]), timeout_s=30)
    assert_replicas_identical(s, ["a", "b", "late"], j + 1)
    # and then trains: a round it contributes samples to, bit-identical with the others
    weighted = s.wait(
        "the joiner contributes samples",
        lambda: [
            r for r, c in s.commits("late").items() if c["samples"] > 0 and r in committed_by_all(s, ["a", "b", "late"])
        ],
        timeout_s=90,
    )
    assert_replicas_identical(s, ["a", "b", "late"], weighted[0])


# ---------------------------------------------------------------------------- a SIGKILLed coordinator


@pytest.mark.timeout(300)
def test_coordinator_sigkill_mid_round_loses_no_committed_round(swarm: Swarm):
    s = swarm
    s.start_coordinator()
    names = ["a", "b"]
    for n in names:
        s.start_worker(n, throttle=SLOW)
    s.wait("2 rounds committed by both", lambda: len(full_rounds(s, names)) >= 2, timeout_s=180)

    def mid_round() -> bool:
        st = s.status()
        return any(c.cell_id == CELL and c.round_state in ("training", "reducing") for c in st.cells)

    s.wait("a round in progress", mid_round, timeout_s=60)
    before = s.committed_round()
    assert s.coordinator is not None
    s.coordinator.kill()
    seen = {n: dict(s.commits(n)) for n in names}
    time.sleep(2.0)  # workers keep training and retry with backoff meanwhile
    s.start_coordinator()  # same data dir and port
    after = s.wait(
        "the restarted coordinator commits 2 more rounds",
        lambda: s.committed_round() >= before + 2 and s.committed_round(),
        timeout_s=120,
    )
    assert after >= before + 2
    for n in names:
        commits = s.commits(n)
        for r, c in seen[n].items():  # nothing a worker saw committed was lost or changed
            assert commits[r]["hash"] == c["hash"]
    # no round committed twice with different hashes, and the replicas agree after the restart
    for r in set(s.commits("a")) & set(s.commits("b")):
        assert s.commits("a")[r]["hash"] == s.commits("b")[r]["hash"], r
    last = max(set(s.commits("a")) & set(s.commits("b")))
    assert last > before
    assert_replicas_identical(s, names, last)
    stop_all_workers(s)
