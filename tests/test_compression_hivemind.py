"""Our codecs inside hivemind: the adapter alone, then three real
``DecentralizedAverager`` peers on loopback averaging through it.

This goes through hivemind's own averager (not Bagel's data plane) on purpose: it is the
integration the adapter exists for, and it shows how hivemind's all-reduce treats lossy
codecs. Its reducer keeps its own part unencoded and each sender adds an encoded *delta*
(average minus the reducer's decoded copy of the sender's part) to its own original tensor,
so the peers end close but not bit-identical; the test bounds the error and measures the
spread. Bagel's data plane (worker issue) applies identical decoded bytes instead.

Error bound used below, per averaged tensor ``j`` (one part, reduced by one peer): with
``E = max_i error_bound(x_i[j])`` and ``m`` the exact mean, a peer's result is
``x_i + D(E(avg - D(E(x_i))))`` with ``|avg - m| <= E`` and ``|x_i - D(E(x_i))| <= E``, hence
``|result_i - m| <= 4 E + max_i error_bound(m - x_i)`` (each codec's bound grows by at
most the perturbation of its input's magnitude), plus float32 rounding.
"""

from __future__ import annotations

import hashlib
import pickle
import time

import hivemind
import pytest
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.compression.base import CompressionInfo
from hivemind.compression.serialization import _BASE_COMPRESSION_TYPES
from hivemind.proto import runtime_pb2

from bagel.compression import CodecError, get_codec
from bagel.compression.hivemind_adapter import BagelCompression, install, installed, uninstall
from bagel.protocol.discovery import start_dht

SLOT = runtime_pb2.CompressionType.BLOCKWISE_8BIT


@pytest.fixture
def restore_slot():
    original = _BASE_COMPRESSION_TYPES["BLOCKWISE_8BIT"]
    yield
    uninstall()
    assert _BASE_COMPRESSION_TYPES["BLOCKWISE_8BIT"] is original


def test_install_round_trips_every_codec_through_hivemind_serialization(restore_slot) -> None:
    x = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))
    for name in ["fp32", "fp16", "bf16", "int8", "int4:block=64", "int8:stochastic", "topk:0.1"]:
        adapter = install(name)
        assert installed() is adapter
        msg = serialize_torch_tensor(x, SLOT)
        assert msg.compression == SLOT and tuple(msg.size) == (3, 1000)
        out = deserialize_torch_tensor(msg)
        assert out.shape == x.shape and out.dtype == torch.float32
        assert float((out - x).abs().max()) <= adapter.codec.error_bound(x)
    # One installed adapter decodes any of our codecs: the header says which.
    install("int8")
    for name in ["fp16", "int4", "topk:0.5"]:
        msg = BagelCompression(name).compress(x, CompressionInfo.from_tensor(x))
        assert float((deserialize_torch_tensor(msg) - x).abs().max()) <= get_codec(name).error_bound(x)


def test_sender_dtype_is_restored(restore_slot) -> None:
    install("int8")
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        x = torch.randn(100).to(dtype)
        assert deserialize_torch_tensor(serialize_torch_tensor(x, SLOT)).dtype == dtype


def test_extract_refuses_malformed_messages(restore_slot) -> None:
    adapter = install("int8")
    x = torch.randn(10, 10)
    msg = adapter.compress(x, CompressionInfo.from_tensor(x))
    wrong_size = runtime_pb2.Tensor()
    wrong_size.CopyFrom(msg)
    del wrong_size.size[:]
    wrong_size.size.extend([100])
    with pytest.raises(CodecError, match="size"):
        deserialize_torch_tensor(wrong_size)
    garbage = runtime_pb2.Tensor(compression=SLOT, buffer=b"\x00" * 64, size=[4], dtype="float32")
    with pytest.raises(CodecError):
        deserialize_torch_tensor(garbage)
    small = install(BagelCompression("int8", max_elements=50))
    assert small.max_elements == 50
    with pytest.raises(CodecError, match="max_elements"):
        deserialize_torch_tensor(msg)


def test_compression_ratio_and_slot_validation() -> None:
    x = torch.zeros(1 << 20)
    info = CompressionInfo.from_tensor(x)
    assert BagelCompression("int4").estimate_compression_ratio(info) == pytest.approx(0.53125 / 4, rel=1e-3)
    assert BagelCompression("fp16").estimate_compression_ratio(info) == pytest.approx(0.5, rel=1e-3)
    with pytest.raises(ValueError, match="slot"):
        BagelCompression("int8", slot="NONE")
    with pytest.raises(ValueError, match="slot"):
        BagelCompression("int8", slot="NOT_A_SLOT")


def test_unpickling_installs_the_adapter(restore_slot) -> None:
    """What a spawned averager process does with the compression object it receives."""
    uninstall()
    assert installed() is None
    clone = pickle.loads(pickle.dumps(BagelCompression("int4:stochastic", seed=3)))
    assert installed() is clone and clone.codec == get_codec("int4:stochastic") and clone.seed == 3


def test_other_slot_and_uninstall(restore_slot) -> None:
    original = _BASE_COMPRESSION_TYPES["UNIFORM_8BIT"]
    try:
        adapter = install("int8", slot="UNIFORM_8BIT")
        assert installed("UNIFORM_8BIT") is adapter and installed() is None
        x = torch.randn(50)
        msg = serialize_torch_tensor(x, runtime_pb2.CompressionType.UNIFORM_8BIT)
        assert float((deserialize_torch_tensor(msg) - x).abs().max()) <= adapter.codec.error_bound(x)
    finally:
        uninstall("UNIFORM_8BIT")
    assert _BASE_COMPRESSION_TYPES["UNIFORM_8BIT"] is original


# --- three real averagers on loopback -------------------------------------------------

PEERS = 3
PART = 20_000  # values per averaged tensor; each tensor is one part, reduced by one peer
DEADLINE_S = 150.0  # start, matchmaking and all-reduce of one group, on a busy 2-core machine
# Matchmaking on a loaded 2-core machine (hivemind's guide: 3-5 s on a local network). A
# leader's declaration in the DHT expires after MATCHMAKING_S, and with min_group_size =
# target_group_size every peer must have found the leader and had its join accepted within
# one such window, else the group disbands and everybody declares again. The first reply to
# a join request must come within REQUEST_TIMEOUT_S, through two p2p daemons and two Python
# processes each way, any of which may be waiting for a core. Neither slows a run that goes
# well: the leader starts the all-reduce the moment its group is full. hivemind wants
# request_timeout < min_matchmaking_time (its Matchmaking docstring: else it may deadlock).
MATCHMAKING_S = 10.0
REQUEST_TIMEOUT_S = 5.0
ALLREDUCE_TIMEOUT_S = 60.0


@pytest.fixture
def dhts():
    """Three fresh DHT nodes per test: a DHT reused across many averagers' start/shutdown
    cycles was seen to stop serving new averagers on a loaded machine."""
    nodes: list[hivemind.DHT] = []
    try:
        nodes.append(start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
        for _ in range(PEERS - 1):
            nodes.append(start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=nodes[0].get_visible_maddrs()))
        yield nodes
    finally:
        for node in nodes:
            node.shutdown()


def peer_inputs(seed: int) -> list[list[torch.Tensor]]:
    """Per peer, PEERS tensors of PART values: Gaussian for one, Student-t-like for another."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(PEERS):
        heavy = torch.randn(PART, generator=g) / torch.randn(PART, generator=g).abs().clamp_min(0.2)
        out.append([torch.randn(PART, generator=g) * (i + 1), heavy, torch.randn(PART, generator=g) + i])
    return out


def average_with_hivemind(dhts: list[hivemind.DHT], codec_name: str, seed: int = 0, attempt: int = 0):
    """Run one hivemind all-reduce over three peers with our codec; return inputs and results.
    `attempt` makes the group's prefix new, so no declaration of an earlier try is matched."""
    adapter = install(BagelCompression(codec_name, seed=seed))  # before the averagers fork
    inputs = peer_inputs(seed)
    averagers = []
    deadline = time.monotonic() + DEADLINE_S  # every wait below is bounded by one deadline
    try:
        for tensors, dht in zip(inputs, dhts, strict=True):
            averager = hivemind.averaging.DecentralizedAverager(
                [t.clone() for t in tensors],
                dht=dht,
                prefix=f"bagel-codec-{hashlib.sha256(codec_name.encode()).hexdigest()[:12]}-{attempt}",  # no '.'s
                target_group_size=PEERS,
                min_group_size=PEERS,
                min_matchmaking_time=MATCHMAKING_S,
                request_timeout=REQUEST_TIMEOUT_S,
                allreduce_timeout=ALLREDUCE_TIMEOUT_S,
                next_chunk_timeout=30.0,
                compression=adapter,
                part_size_bytes=2**30,  # one part per tensor: each tensor has one reducer
                start=False,
            )
            averagers.append(averager)
            try:
                averager.run_in_background(await_ready=True, timeout=max(1.0, deadline - time.monotonic()))
            except TimeoutError:
                pytest.fail(f"averager {len(averagers) - 1} did not start within {DEADLINE_S:g}s of the first")
        # `timeout` bounds the search for a group, retries after a failed all-reduce
        # included; what is left of the deadline after it is one all-reduce's
        search_s = deadline - time.monotonic() - ALLREDUCE_TIMEOUT_S
        assert search_s > 2 * MATCHMAKING_S, "starting the averagers took most of the deadline"
        steps = [a.step(wait=False, timeout=search_s) for a in averagers]
        groups = []
        for i, step in enumerate(steps):
            try:
                groups.append(step.result(timeout=max(1.0, deadline - time.monotonic())))
            except Exception as e:  # the stage says where it stopped: matchmaking or the all-reduce
                stages = [s.stage.name for s in steps]
                pytest.fail(f"averager {i}'s step failed ({type(e).__name__}: {e}); stages of all three: {stages}")
        assert all(g is not None and len(g) == PEERS for g in groups), "the three peers did not form one group"
        results = []
        for a in averagers:
            with a.get_tensors() as tensors:
                results.append([t.clone() for t in tensors])
        return inputs, results
    finally:
        for a in averagers:
            if a.is_alive():
                a.shutdown()


def unaveraged_parts(inputs: list[list[torch.Tensor]], results: list[list[torch.Tensor]]) -> list[tuple[int, int]]:
    """(peer, tensor) whose result is its input, bit for bit: hivemind gave up on that part's
    reducer (its log says "Averaging: received 66.7% results") and kept the peer's own
    values. Any completed part moves: a sender adds a nonzero decoded delta to it."""
    return [(i, j) for i in range(PEERS) for j in range(PEERS) if torch.equal(results[i][j], inputs[i][j])]


def spread_between_peers(results: list[list[torch.Tensor]]) -> float:
    return max(
        float((results[i][j] - results[k][j]).abs().max())
        for j in range(PEERS)
        for i in range(PEERS)
        for k in range(PEERS)
    )


@pytest.mark.slow
@pytest.mark.timeout(2 * DEADLINE_S + 60)
@pytest.mark.parametrize(
    "codec_name", ["fp32", "fp16", "bf16", "int8", "int4", "int8:stochastic", "int4:block=32:stochastic", "topk:0.1"]
)
def test_three_hivemind_peers_average_within_the_codec_bound(dhts, restore_slot, codec_name: str) -> None:
    codec = get_codec(codec_name)
    # hivemind tolerates a reducer that fails mid all-reduce (an error it logs at DEBUG only,
    # seen once on a loaded machine): its senders keep their own values for that part and the
    # step still succeeds. That is hivemind's fault tolerance, not the codec's error, so such
    # a run is said and averaged again once; the bound below holds for every completed part.
    for attempt in range(2):
        inputs, results = average_with_hivemind(dhts, codec_name, attempt=attempt)
        left = unaveraged_parts(inputs, results)
        if not left:
            break
        print(f"\nhivemind left (peer, tensor) {left} unaveraged (a failed reducer); averaging again")
    else:
        pytest.fail(f"hivemind left (peer, tensor) {left} unaveraged in two all-reduces in a row")
    for j in range(PEERS):
        xs = [inputs[i][j] for i in range(PEERS)]
        mean = sum(xs) / PEERS
        e_in = max(codec.error_bound(x) for x in xs)
        bound = 4 * e_in + max(codec.error_bound(mean - x) for x in xs)
        slack = 1e-5 * max(float(x.abs().max()) for x in xs)
        for i in range(PEERS):
            err = float((results[i][j] - mean).abs().max())
            assert err <= bound + slack, f"peer {i} tensor {j}: error {err} > bound {bound}"
    spread = spread_between_peers(results)
    print(f"\nhivemind averager, {codec_name}: max difference between peers = {spread:.3g}")
    if codec.nominal_rel_error() > 0:
        # Lossy codec through hivemind's reducer: peers differ.
        assert spread > 0
