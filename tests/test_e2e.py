"""End to end, multi-process, on loopback: a real coordinator and real `bagel-worker` processes.

Every process is a subprocess in its own process group
(`bagel.worker.swarm`), so a SIGKILL takes its hivemind DHT child and p2pd daemon with it,
and teardown stops all of them even when an assertion fails. The run is one cell
(one cluster, one timestep range, no router) of the tiny DiT with H = 5 inner steps, int8
pseudo-gradients with error feedback, and 3 s leases, so a round takes a few seconds.

The spec keeps an average of the committed weights (`[ema]`), so every comparison of
replicas below also compares their `ema.*` tensors: across holders, after a late joiner's
sync and across a coordinator restart.

Facts are read from the workers' `--log-json` events (synced / committed / left, with
hashes, contributor counts and bytes) and from `--keep-round-history` checkpoints, one
safetensors file per committed round, which the tests load and compare tensor by tensor.
"""

from __future__ import annotations

import os
import signal
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

[ema]
decay = 0.9
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
        self.dht_port = free_port()  # fixed, as in production: the join string survives a restart
        self.coordinator: CoordinatorProc | None = None
        self.workers: dict[str, WorkerProc] = {}
        self.restarts: dict[str, int] = {}

    def start_coordinator(self, *extra: str) -> CoordinatorProc:
        n = sum(1 for p in self.procs if p.name == "coordinator")
        c = CoordinatorProc.make(
            self.spec_path,
            self.root / "coord",
            self.root / f"coord{n}.log",
            port=self.port,
            dht_port=self.dht_port,
            extra=extra,
        )
        self.procs.append(c)
        c.start_and_wait(timeout_s=90)
        self.coordinator = c
        return c

    def start_worker(self, name: str, *extra: str, throttle: float = 1.0, join: str = "") -> WorkerProc:
        assert self.coordinator is not None
        n = self.restarts.get(name, -1) + 1
        self.restarts[name] = n
        w = WorkerProc.make(
            join or self.coordinator.join,
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
    assert any(k.startswith("ema.") for k in ref), "the state keeps no average of the weights"
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


def stop_report(p: Managed) -> str:
    """What a worker's stop did: its phase when told to stop, each step's seconds (the
    `stop-steps` event), a step that overran, and the watchdog's line, which names the step
    it was in if the stop ran past its bound."""
    lines = p.log_text().splitlines()
    phases = [line for line in lines if '"event": "step"' in line]
    keep = [
        line
        for line in lines
        if any(k in line for k in ('"event": "stopping"', '"event": "stop-step', "graceful stop took more"))
    ]
    return "\n".join([*(["last progress: " + phases[-1]] if phases else []), *keep]) or "(no stop events)"


def stop_all_workers(s: Swarm) -> None:
    for w in s.workers.values():
        if w.alive():
            rc = w.stop(timeout_s=40)
            assert rc == 0, f"{w.name} did not exit cleanly (rc {rc}):\n{stop_report(w)}\n--- log tail\n{_tail(w)}"
            assert w.events("left"), f"{w.name} exited without Leave:\n{stop_report(w)}"


# ---------------------------------------------------------------------------- three workers, bit-identical


@pytest.mark.timeout(240)
def test_three_workers_commit_bit_identical_rounds(swarm: Swarm):
    s = swarm
    coord = s.start_coordinator("--metrics-listen", "127.0.0.1:0")
    coord_metrics = coord.wait_for_line("metrics:", 30)
    names = ["a", "b", "c"]
    for n in names:
        s.start_worker(n, *(("--metrics-listen", "127.0.0.1:0") if n == "a" else ()))

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
    assert_real_round_metrics(s.workers["a"].events("metrics")[0]["url"], coord_metrics)
    stop_all_workers(s)
    assert_time_accounted(s, names)
    assert_no_place_while_profiling(s, names)


def assert_no_place_while_profiling(s: Swarm, names: list[str]) -> None:
    """A worker's first contact only learns the spec, and measuring its speed takes a while:
    it steps aside meanwhile, so no round opens with it as a member before it has measured
    (its `profile` event) and registered again."""
    from bagel.coordinator.store import Store

    store = Store.open_readonly(s.root / "coord")
    try:
        records = store.round_records()
    finally:
        store.close()
    assert records
    for n in names:
        w = s.workers[n]
        wid = w.events("identity")[0]["worker_id"]
        measured_ms = w.events("profile")[0]["ts"] * 1000.0 - 5.0  # the log's ts has ms resolution
        for r in records:
            if any(m.worker_id == wid for m in r.members):
                assert r.opened_ms >= measured_ms, f"{n} was planned into {r.cell_id} round {r.round} while profiling"


def assert_time_accounted(s: Swarm, names: list[str]) -> None:
    """The demo report's utilisation and goodput, from these real workers' events: every
    second of a worker's wall time is in one bucket, each committed training and exchanged."""
    from bagel.worker.demo import time_accounts, time_markdown

    per, swarm = time_accounts({n: s.workers[n].events() for n in names})
    for n in names:
        t = per[n]
        assert t["wall_s"] > 0 and sum(t["buckets_s"].values()) == pytest.approx(t["wall_s"], abs=0.05), t
        assert t["buckets_s"]["committed"] > 0 and t["buckets_s"]["comm"] > 0, t
        assert 0 < t["goodput"] <= t["utilisation"] <= 1, t
    assert swarm["buckets_s"]["committed"] == pytest.approx(sum(per[n]["buckets_s"]["committed"] for n in names))
    table = "\n".join(time_markdown(per, swarm))
    assert all(f"| {n} | " in table for n in names) and "| **swarm** |" in table


def assert_real_round_metrics(worker_url: str, coordinator_url: str) -> None:
    """What real workers measured reaches both endpoints: every phase but `waiting` took
    time (a round may start its exchange the moment it is ready), and bytes are counted."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        return {
            (x.name, tuple(sorted(x.labels.items()))): x.value
            for fam in text_string_to_metric_families(text)
            for x in fam.samples
        }

    # `data` (indexing the in-memory digits) can be under half a millisecond a round, and the
    # report carries whole milliseconds: it is exported, but may read 0 on an idle machine
    w = scrape(worker_url)
    assert w[("bagel_worker_step_seconds_total", (("phase", "data"),))] >= 0
    for phase in ("forward_backward", "optimizer", "encode", "exchange", "outer_step"):
        assert w[("bagel_worker_step_seconds_total", (("phase", phase),))] > 0, phase
    assert w[("bagel_worker_bytes_total", (("direction", "sent"), ("kind", "exchange")))] > 0
    assert w[("bagel_worker_memory_bytes", (("kind", "rss"),))] > 50 << 20
    assert w[("bagel_worker_denoising_samples_per_second", ())] > 0
    c = scrape(coordinator_url)
    assert c[("bagel_step_seconds_total", (("cell", CELL), ("phase", "data"), ("worker_class", "cpu")))] >= 0
    for phase in ("forward_backward", "optimizer", "exchange", "outer_step"):
        got = c[("bagel_step_seconds_total", (("cell", CELL), ("phase", phase), ("worker_class", "cpu")))]
        assert got > 0, phase
    assert c[("bagel_denoising_samples_per_second", (("cell", CELL), ("worker_class", "cpu")))] > 0
    assert c[("bagel_worker_memory_bytes", (("kind", "rss_max"), ("worker_class", "cpu")))] > 50 << 20


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
    assert [e["cached"] for e in s.workers["c"].events("profile")] == [False]  # a new data dir: measured
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
    # the same machine, run and settings: its measurement is reused, with the memory read again
    assert [e["cached"] for e in s.workers["c"].events("profile")] == [True]
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
    # what the joiner measured of its donors (it reports them with its heartbeats): bytes
    # from the workers that held the state, and the time their requests ran
    for e in synced:
        rates = e["donor_rates"]
        holders = {x["worker_id"] for n in ("a", "b") for x in s.events(n, "identity")}
        assert rates and set(rates) <= holders, e
        assert all(r["bytes"] > 0 and r["ms"] >= 0 for r in rates.values()), e
    assert s.commits("a")[j]["hash"].startswith(last_sync["hash"])  # verified against the committed hash
    # it takes part in the exchange of the round right after that state (as a zero-weight
    # catch-up contributor if it synced after that round started, else with its samples)
    assert first == j + 1, f"synced round {j} but first committed round {first}"
    s.wait(f"all report round {j + 1}", lambda: j + 1 in committed_by_all(s, ["a", "b", "late"]), timeout_s=30)
    assert_replicas_identical(s, ["a", "b", "late"], j + 1)
    # a sync that ended while round j + 1 trained is admitted into it late (the next data
    # shard, a smaller batch); the round then commits with its samples, bit-identical
    late_trains = [e for e in s.events("late", "train") if e.get("late")]
    if late_trains and late_trains[0]["round"] == j + 1:
        assert s.commits("late")[j + 1]["samples"] > 0, late_trains[0]
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


def live_in_group(pgid: int) -> list[int]:
    """Processes of process group `pgid` that still run (zombies, which hold no port or lock, excluded)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(entry.name))
    return pids


@pytest.mark.timeout(300)
def test_coordinator_sigkill_mid_round_loses_no_committed_round(swarm: Swarm):
    """SIGKILL to the coordinator's pid alone (`kill -9 PID`), then a restart on the same data
    dir and flags: its DHT child and p2p daemon exit by themselves (so the port, the peer id
    and the data dir's lock are free again), the join string is byte-identical, the running
    workers re-attach and commit further rounds, nothing committed is lost, and a worker
    started afterwards with the old join string joins and commits."""
    s = swarm
    old_join = s.start_coordinator().join
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
    killed = s.coordinator
    os.kill(killed.pid, signal.SIGKILL)
    assert killed.proc is not None and killed.proc.wait(timeout=10) == -signal.SIGKILL
    seen = {n: dict(s.commits(n)) for n in names}
    deadline = time.monotonic() + 10  # its DHT child and p2pd exit with it
    while live_in_group(killed.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not live_in_group(killed.pid), f"left running after the coordinator's SIGKILL: {live_in_group(killed.pid)}"
    assert "the join string names only loopback addresses" in killed.log_text()  # the swarm lives on 127.0.0.1
    killed.kill()  # nothing is left to kill; clears the group for the teardown
    time.sleep(1.0)  # workers keep training and retry with backoff meanwhile
    assert s.start_coordinator().join == old_join  # same data dir, port and flags: byte-identical
    s.start_worker("c", throttle=SLOW, join=old_join)  # a newcomer with the string printed before the crash
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
    # the newcomer registered with the old string and commits the same states as the others
    joined = s.wait("the newcomer commits a round", lambda: min(s.commits("c"), default=None), timeout_s=120)
    # the running workers re-attached: both commit rounds after the restart, and no round
    # was committed twice with different hashes
    last = s.wait("a and b commit after the restart", lambda: [r for r in committed_by_all(s, names) if r > before], 60)
    for r in set(s.commits("a")) & set(s.commits("b")):
        assert s.commits("a")[r]["hash"] == s.commits("b")[r]["hash"], r
    assert_replicas_identical(s, names, last[-1])
    s.wait(f"a, b and c report round {joined}", lambda: joined in committed_by_all(s, ["a", "b", "c"]), 60)
    assert_replicas_identical(s, ["a", "b", "c"], joined)
    stop_all_workers(s)
    # the restarted coordinator's newest checkpoint is what sample and export read: the
    # average of the weights of a committed round, byte for byte what the workers hold
    from bagel.coordinator.committed import load_committed

    cw = load_committed(s.root / "coord").cells[CELL]
    assert cw.ema and cw.round > before
    # any worker that committed that round holds it (the one that uploaded it at least)
    holders = [n for n in ("a", "b", "c") if cw.round in s.commits(n)]
    assert holders, f"no worker reports the checkpoint's round {cw.round}"
    held = s.history(holders[0], cw.round)
    for n, t in cw.weights.items():
        assert torch.equal(t, held["ema." + n]), n
