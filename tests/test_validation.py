"""Validation of every request message: each bad field is named precisely."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.runspec import load_spec
from bagel.protocol.validation import (
    MAX_MADDRS,
    ValidationError,
    validate,
    validate_heartbeat,
    validate_register,
)

SPEC = load_spec(Path(__file__).resolve().parents[1] / "examples" / "digits-2x2.toml")
H = "ab" * 32
PEER_ID = "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"


def good_register() -> pb.RegisterRequest:
    return pb.RegisterRequest(
        profile=pb.WorkerProfile(
            name="gamer-1",
            device_kind="cuda",
            device_name="RTX 4090",
            vram_bytes=24 << 30,
            host_memory_bytes=64 << 30,
            num_devices=1,
            link_bandwidth_bytes_per_s=1e8,
            samples_per_s={"k0.r0": 1200.0, "router": 5000.0},
            software_version="0.1.0",
        ),
        peer=pb.PeerAddress(peer_id=PEER_ID, maddrs=[f"/ip4/127.0.0.1/tcp/4000/p2p/{PEER_ID}"]),
        local=pb.LocalState(cell_id="k0.r1", committed_round=3, state_hash=H),
    )


def good_heartbeat() -> pb.HeartbeatRequest:
    return pb.HeartbeatRequest(
        phase=pb.PHASE_READY,
        cell_id="k1.r0",
        round=4,
        inner_step=50,
        loss=0.3,
        samples=640,
        local=pb.LocalState(cell_id="k1.r0", committed_round=3, state_hash=H),
        reduce_attempt=0,
    )


def good_report() -> pb.ReportRoundRequest:
    return pb.ReportRoundRequest(
        cell_id="router",
        round=7,
        state_hash=H,
        samples=640,
        loss=1.2,
        compute_ms=5000,
        comm_ms=300,
        bytes_sent=1 << 20,
        bytes_received=1 << 20,
        reduce_attempt=1,
    )


def good_upload() -> pb.UploadCheckpointHeader:
    return pb.UploadCheckpointHeader(cell_id="k0.r0", round=2, state_hash=H, total_bytes=12345, sha256="cd" * 32)


GOOD = {
    "Register": good_register,
    "Heartbeat": good_heartbeat,
    "ReportRound": good_report,
    "Leave": lambda: pb.LeaveRequest(reason="ctrl-c"),
    "UploadCheckpoint": good_upload,
    "DownloadCheckpoint": lambda: pb.DownloadCheckpointRequest(cell_id="router", round=0),
}


@pytest.mark.parametrize("method", sorted(GOOD))
def test_good_messages_pass(method):
    validate(method, GOOD[method](), SPEC)


def _set(msg, path: str, value) -> None:
    *parents, leaf = path.split(".")
    for p in parents:
        msg = getattr(msg, p)
    if isinstance(value, list):
        del getattr(msg, leaf)[:]
        getattr(msg, leaf).extend(value)
    elif isinstance(value, dict):
        getattr(msg, leaf).clear()
        getattr(msg, leaf).update(value)
    else:
        setattr(msg, leaf, value)


NAN, INF = float("nan"), float("inf")

BAD = [
    # (method, field path to set, value, field named in the error)
    ("Register", "profile.name", "x" * 65, "profile.name"),
    ("Register", "profile.name", "evil\x1b[2J", "profile.name"),
    ("Register", "profile.device_kind", "tpu", "profile.device_kind"),
    ("Register", "profile.device_kind", "", "profile.device_kind"),
    ("Register", "profile.device_name", "g" * 129, "profile.device_name"),
    ("Register", "profile.vram_bytes", -1, "profile.vram_bytes"),
    ("Register", "profile.vram_bytes", 1 << 51, "profile.vram_bytes"),
    ("Register", "profile.host_memory_bytes", -1, "profile.host_memory_bytes"),
    ("Register", "profile.host_memory_bytes", 1 << 51, "profile.host_memory_bytes"),
    ("Register", "profile.num_devices", -2, "profile.num_devices"),
    ("Register", "profile.link_bandwidth_bytes_per_s", NAN, "profile.link_bandwidth_bytes_per_s"),
    ("Register", "profile.link_bandwidth_bytes_per_s", -5.0, "profile.link_bandwidth_bytes_per_s"),
    ("Register", "profile.samples_per_s", {"k9.r9": 10.0}, "profile.samples_per_s[k9.r9]"),
    ("Register", "profile.samples_per_s", {"k0.r0": INF}, "profile.samples_per_s[k0.r0]"),
    ("Register", "profile.samples_per_s", {"k0.r0": -1.0}, "profile.samples_per_s[k0.r0]"),
    ("Register", "profile.software_version", "v" * 65, "profile.software_version"),
    ("Register", "profile.reachability", 7, "profile.reachability"),
    ("Register", "profile.reachability_detail", "r" * 301, "profile.reachability_detail"),
    ("Register", "peer.peer_id", "", "peer.peer_id"),
    ("Register", "peer.peer_id", "0OIl" * 10, "peer.peer_id"),
    ("Register", "peer.maddrs", ["ip4/1.2.3.4"], "peer.maddrs[0]"),
    ("Register", "peer.maddrs", ["/ip4/1.2.3.4", "/ip4/1 .2"], "peer.maddrs[1]"),
    ("Register", "peer.maddrs", ["/" + "a" * 256], "peer.maddrs[0]"),
    ("Register", "peer.maddrs", ["/ip4/1.2.3.4"] * (MAX_MADDRS + 1), "peer.maddrs"),
    ("Register", "local.cell_id", "k7.r0", "local.cell_id"),
    ("Register", "local.committed_round", -1, "local.committed_round"),
    ("Register", "local.state_hash", "AB" * 32, "local.state_hash"),
    ("Register", "local.state_hash", "", "local.state_hash"),  # round 3 needs its hash
    ("Register", "join_token", b"t" * 1025, "join_token"),
    ("Heartbeat", "phase", 0, "phase"),
    ("Heartbeat", "phase", 99, "phase"),
    ("Heartbeat", "cell_id", "", "cell_id"),  # PHASE_READY needs a cell
    ("Heartbeat", "cell_id", "nope", "cell_id"),
    ("Heartbeat", "round", 0, "round"),
    ("Heartbeat", "round", -3, "round"),
    ("Heartbeat", "round", 1 << 41, "round"),
    ("Heartbeat", "inner_step", 51, "inner_step"),  # H = 50 in the example spec
    ("Heartbeat", "inner_step", -1, "inner_step"),
    ("Heartbeat", "loss", NAN, "loss"),
    ("Heartbeat", "loss", -INF, "loss"),
    ("Heartbeat", "samples", -1, "samples"),
    ("Heartbeat", "local.state_hash", "abc", "local.state_hash"),
    ("Heartbeat", "reduce_attempt", -1, "reduce_attempt"),
    ("Heartbeat", "reduce_attempt", 1001, "reduce_attempt"),
    ("Heartbeat", "round_attempt", -1, "round_attempt"),
    ("Heartbeat", "round_attempt", (1 << 20) + 1, "round_attempt"),
    ("ReportRound", "cell_id", "", "cell_id"),
    ("ReportRound", "cell_id", "k0.r2", "cell_id"),
    ("ReportRound", "round", 0, "round"),
    ("ReportRound", "state_hash", "", "state_hash"),
    ("ReportRound", "state_hash", "g" * 64, "state_hash"),
    ("ReportRound", "samples", -10, "samples"),
    ("ReportRound", "loss", INF, "loss"),
    ("ReportRound", "compute_ms", -1, "compute_ms"),
    ("ReportRound", "comm_ms", 10**12, "comm_ms"),
    ("ReportRound", "bytes_sent", -1, "bytes_sent"),
    ("ReportRound", "bytes_received", 1 << 51, "bytes_received"),
    ("ReportRound", "reason", "r" * 513, "reason"),
    ("ReportRound", "reduce_attempt", -1, "reduce_attempt"),
    ("ReportRound", "data_ms", -1, "data_ms"),
    ("ReportRound", "forward_backward_ms", 10**12, "forward_backward_ms"),
    ("ReportRound", "optimizer_ms", -5, "optimizer_ms"),
    ("ReportRound", "encode_ms", 1 << 62, "encode_ms"),
    ("ReportRound", "exchange_ms", -1, "exchange_ms"),
    ("ReportRound", "outer_step_ms", 10**13, "outer_step_ms"),
    ("ReportRound", "waiting_ms", -1, "waiting_ms"),
    ("ReportRound", "cuda_free_bytes", -1, "cuda_free_bytes"),
    ("ReportRound", "cuda_peak_allocated_bytes", 1 << 51, "cuda_peak_allocated_bytes"),
    ("ReportRound", "rss_bytes", 1 << 62, "rss_bytes"),
    ("Leave", "reason", "r" * 513, "reason"),
    ("Leave", "reason", "line\nbreak", "reason"),
    ("UploadCheckpoint", "cell_id", "", "cell_id"),
    ("UploadCheckpoint", "round", 0, "round"),
    ("UploadCheckpoint", "state_hash", "", "state_hash"),
    ("UploadCheckpoint", "total_bytes", 0, "total_bytes"),
    ("UploadCheckpoint", "total_bytes", (2 << 30) + 1, "total_bytes"),
    ("UploadCheckpoint", "sha256", "cd" * 31, "sha256"),
    ("DownloadCheckpoint", "cell_id", "", "cell_id"),
    ("DownloadCheckpoint", "cell_id", "k0.r0 ", "cell_id"),
    ("DownloadCheckpoint", "round", -1, "round"),
]


@pytest.mark.parametrize("method,path,value,field", BAD, ids=[f"{m}-{p}-{i}" for i, (m, p, _, _) in enumerate(BAD)])
def test_bad_field_is_named(method, path, value, field):
    msg = GOOD[method]()
    _set(msg, path, value)
    with pytest.raises(ValidationError) as err:
        validate(method, msg, SPEC)
    assert err.value.field == field
    assert err.value.reason
    assert str(err.value).startswith(field)


def test_a_register_carries_the_declared_memory_into_the_core():
    from bagel.coordinator.translate import register_event
    from bagel.protocol.cellmemory import MemoryBudget

    ev = register_event("w", good_register())
    assert (ev.profile.vram_bytes, ev.profile.host_memory_bytes) == (24 << 30, 64 << 30)
    prof = ev.profile
    assert MemoryBudget.of(prof.device_kind, prof.vram_bytes, prof.host_memory_bytes) == MemoryBudget(
        24 << 30, 64 << 30
    )


def test_register_requires_profile_and_peer():
    msg = good_register()
    msg.ClearField("profile")
    with pytest.raises(ValidationError) as err:
        validate_register(msg, SPEC)
    assert err.value.field == "profile"
    msg = good_register()
    msg.ClearField("peer")
    with pytest.raises(ValidationError) as err:
        validate_register(msg, SPEC)
    assert err.value.field == "peer"


def test_local_state_without_cell_must_be_empty():
    msg = good_register()
    msg.local.cell_id = ""
    with pytest.raises(ValidationError) as err:
        validate_register(msg, SPEC)
    assert err.value.field == "local.cell_id"
    msg.local.Clear()
    validate_register(msg, SPEC)


def test_idle_heartbeat_without_cell_or_round_is_fine():
    validate_heartbeat(pb.HeartbeatRequest(phase=pb.PHASE_IDLE), SPEC)
    validate_heartbeat(pb.HeartbeatRequest(phase=pb.PHASE_SYNCING, cell_id="router"), SPEC)


def test_failed_report_needs_no_hash():
    msg = good_report()
    msg.failed, msg.state_hash, msg.reason = True, "", "all-reduce timed out"
    validate("ReportRound", msg, SPEC)


def test_join_token_and_pow_fields_are_bounded():
    """A permissioned Register without a token is well-formed (the coordinator answers the
    missing credential UNAUTHENTICATED, tests/test_admission_tokens.py); oversized fields are not."""
    spec = dataclasses.replace(
        SPEC, security=dataclasses.replace(SPEC.security, mode="permissioned", operator_public_key="x")
    )
    msg = good_register()
    validate_register(msg, spec)
    msg.join_token = b"t" * 1025
    with pytest.raises(ValidationError) as err:
        validate_register(msg, spec)
    assert err.value.field == "join_token"
    msg.join_token = b"token"
    msg.pow_challenge = b"c" * 65
    with pytest.raises(ValidationError) as err:
        validate_register(msg, spec)
    assert err.value.field == "pow_challenge"
    msg.pow_challenge = b"c" * 32
    validate_register(msg, spec)


def test_unknown_method():
    with pytest.raises(ValueError):
        validate("GetStatus", pb.GetStatusRequest(), SPEC)
