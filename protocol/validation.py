"""Field-by-field validation of every worker request against the run spec.

Every RPC validates every field, and bad input gets a precise status
(INVALID_ARGUMENT) naming the field, never a crash and never a state change. These are
pure functions of (message, spec): the server calls `validate(method, message, spec)`
after the envelope checks (`bagel.protocol.envelope.Verifier`, which owns the header)
and before anything touches the coordinator's state. They raise one `ValidationError`
whose `field` is the dotted path of the offending field (e.g. `profile.samples_per_s[k9.r0]`,
`peer.maddrs[3]`).

Contract notes for senders (the worker, simulated workers, the load generator):
- floats must be finite; a worker whose loss went non-finite reports `failed=True` and
  loss 0 instead of putting NaN on the wire;
- hashes are lowercase hex sha256 (64 chars), as `bagel.protocol.statehash` returns;
- `Heartbeat.inner_step` counts optimizer steps of the round, 0..H;
- a `LocalState` with `committed_round > 0` must carry its state hash; with no cell it
  must be empty (round 0, no hash).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from google.protobuf.message import Message

from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.runspec import MAX_SYNC_DONORS, RunSpec

# Bounds on values no honest worker comes near; they keep arithmetic and storage sane.
MAX_ROUND = 1 << 40
MAX_REDUCE_ATTEMPT = 1000
MAX_ROUND_ATTEMPT = 1 << 20  # re-runs of one round number after aborts
MAX_SAMPLES = 1 << 40
MAX_LOSS = 1e12
MAX_VRAM_BYTES = 1 << 50  # 1 PiB
MAX_DEVICES = 1024
MAX_BANDWIDTH_BYTES_PER_S = 1e13  # 80 Tbit/s
MAX_SAMPLES_PER_S = 1e9
MAX_DURATION_MS = 30 * 24 * 3600 * 1000  # 30 days
MAX_BYTES_COUNTER = 1 << 50
MAX_NAME_CHARS = 64
MAX_DEVICE_NAME_CHARS = 128
MAX_REACHABILITY_DETAIL_CHARS = 300
MAX_VERSION_CHARS = 64
MAX_REASON_CHARS = 512
MAX_MADDRS = 16
MAX_MADDR_CHARS = 256
MAX_JOIN_TOKEN_BYTES = 1024
MAX_AUDIT_CONTRIBUTORS = 256
MAX_AUDIT_NORM = 1e300  # finite: a norm of float32 values of any count is far below it
MAX_POW_CHALLENGE_BYTES = 64
# An accusation (EvidenceRequest): one signed input per contributor of the disputed part.
# bagel.robust.evidence parses within the same bounds.
MAX_EVIDENCE_INPUTS = 256
MAX_EVIDENCE_HEADER_BYTES = 4096
MAX_EVIDENCE_RECEIPT_BYTES = MAX_EVIDENCE_INPUTS * (MAX_EVIDENCE_HEADER_BYTES + 8) + 65536
DEVICE_KINDS = frozenset({"cpu", "cuda", "mps"})

HEX_SHA256_RE = re.compile(r"[0-9a-f]{64}")
# libp2p peer ids in base58btc: "Qm..." (sha256 multihash, 46 chars) or "12D3KooW..."
# (identity multihash of an Ed25519 key, 52 chars); allow the alphabet, bounded length.
PEER_ID_RE = re.compile(r"[1-9A-HJ-NP-Za-km-z]{32,128}")
MADDR_RE = re.compile(r"/[\x21-\x7e]*")  # printable ASCII, no spaces, starts with "/"


_CELLS: dict[int, tuple[RunSpec, frozenset[str]]] = {}


def _cells_of(spec: RunSpec) -> frozenset[str]:
    # spec.cell_ids rebuilds a tuple on every call; the coordinator validates thousands
    # of messages a second against one spec, so keep its cell set (keyed by identity).
    entry = _CELLS.get(id(spec))
    if entry is None or entry[0] is not spec:
        if len(_CELLS) > 64:
            _CELLS.clear()
        entry = _CELLS[id(spec)] = (spec, frozenset(spec.cell_ids))
    return entry[1]


class ValidationError(ValueError):
    """A request field is missing or out of range; maps to gRPC INVALID_ARGUMENT."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


# ---------------------------------------------------------------------------- field checks


def _int(field: str, value: int, lo: int, hi: int) -> None:
    if not lo <= value <= hi:
        raise ValidationError(field, f"{value} is outside [{lo}, {hi}]")


def _float(field: str, value: float, lo: float, hi: float) -> None:
    if not math.isfinite(value):
        raise ValidationError(field, f"must be finite, got {value}")
    if not lo <= value <= hi:
        raise ValidationError(field, f"{value} is outside [{lo}, {hi}]")


def _text(field: str, value: str, max_chars: int, *, required: bool = False) -> None:
    if required and not value:
        raise ValidationError(field, "required")
    if len(value) > max_chars:
        raise ValidationError(field, f"longer than {max_chars} characters ({len(value)})")
    if value and not value.isprintable():
        raise ValidationError(field, "contains non-printable characters")


def _hash(field: str, value: str, *, required: bool) -> None:
    if not value:
        if required:
            raise ValidationError(field, "required (lowercase hex sha256)")
        return
    if not HEX_SHA256_RE.fullmatch(value):
        raise ValidationError(field, "must be 64 lowercase hex characters (sha256)")


def _cell(field: str, value: str, spec: RunSpec, *, required: bool) -> None:
    if not value:
        if required:
            raise ValidationError(field, "required")
        return
    if value not in _cells_of(spec):
        raise ValidationError(field, f"{value[:40]!r} is not a cell of this run")


def _enum(field: str, value: int, enum: Any) -> None:
    if value not in enum.values() or value == 0:
        raise ValidationError(field, f"{value} is not a defined value (UNSPECIFIED is not allowed)")


def _round(field: str, value: int, *, lo: int) -> None:
    _int(field, value, lo, MAX_ROUND)


def _peer(field: str, peer: pb.PeerAddress) -> None:
    if not PEER_ID_RE.fullmatch(peer.peer_id):
        raise ValidationError(f"{field}.peer_id", "must be a base58 libp2p peer id")
    if len(peer.maddrs) > MAX_MADDRS:
        raise ValidationError(f"{field}.maddrs", f"more than {MAX_MADDRS} addresses ({len(peer.maddrs)})")
    for i, maddr in enumerate(peer.maddrs):
        if len(maddr) > MAX_MADDR_CHARS:
            raise ValidationError(f"{field}.maddrs[{i}]", f"longer than {MAX_MADDR_CHARS} characters")
        if not MADDR_RE.fullmatch(maddr):
            raise ValidationError(f"{field}.maddrs[{i}]", "must be a multiaddr: '/' then printable ASCII, no spaces")


def _local(field: str, local: pb.LocalState, spec: RunSpec) -> None:
    _cell(f"{field}.cell_id", local.cell_id, spec, required=False)
    _round(f"{field}.committed_round", local.committed_round, lo=0)
    _hash(f"{field}.state_hash", local.state_hash, required=local.committed_round > 0)
    if not local.cell_id and (local.committed_round or local.state_hash):
        raise ValidationError(f"{field}.cell_id", "empty, but committed_round/state_hash are set")


def _profile(field: str, profile: pb.WorkerProfile, spec: RunSpec) -> None:
    _text(f"{field}.name", profile.name, MAX_NAME_CHARS)
    if profile.device_kind not in DEVICE_KINDS:
        raise ValidationError(f"{field}.device_kind", f"must be one of {sorted(DEVICE_KINDS)}")
    _text(f"{field}.device_name", profile.device_name, MAX_DEVICE_NAME_CHARS)
    _int(f"{field}.vram_bytes", profile.vram_bytes, 0, MAX_VRAM_BYTES)
    _int(f"{field}.host_memory_bytes", profile.host_memory_bytes, 0, MAX_VRAM_BYTES)
    _int(f"{field}.num_devices", profile.num_devices, 0, MAX_DEVICES)
    _float(f"{field}.link_bandwidth_bytes_per_s", profile.link_bandwidth_bytes_per_s, 0.0, MAX_BANDWIDTH_BYTES_PER_S)
    cells = _cells_of(spec)
    if len(profile.samples_per_s) > len(cells):
        raise ValidationError(f"{field}.samples_per_s", f"more entries than cells ({len(profile.samples_per_s)})")
    for cell_id in sorted(profile.samples_per_s):  # sorted: the reported field is deterministic
        name = f"{field}.samples_per_s[{cell_id[:40]}]"
        if cell_id not in cells:
            raise ValidationError(name, "not a cell of this run")
        _float(name, profile.samples_per_s[cell_id], 0.0, MAX_SAMPLES_PER_S)
    _text(f"{field}.software_version", profile.software_version, MAX_VERSION_CHARS)
    if profile.reachability not in pb.PeerReachability.values():
        raise ValidationError(f"{field}.reachability", f"unknown value {profile.reachability}")
    _text(f"{field}.reachability_detail", profile.reachability_detail, MAX_REACHABILITY_DETAIL_CHARS)


# ---------------------------------------------------------------------------- messages


def validate_register(req: pb.RegisterRequest, spec: RunSpec) -> None:
    """Profile, peer address (required: peers find each other through it), local state, token."""
    if not req.HasField("profile"):
        raise ValidationError("profile", "required")
    _profile("profile", req.profile, spec)
    if not req.HasField("peer"):
        raise ValidationError("peer", "required")
    _peer("peer", req.peer)
    _local("local", req.local, spec)
    if len(req.join_token) > MAX_JOIN_TOKEN_BYTES:
        raise ValidationError("join_token", f"longer than {MAX_JOIN_TOKEN_BYTES} bytes")
    # a missing token is not a malformed field but a missing credential: the coordinator
    # answers it UNAUTHENTICATED (bagel.protocol.jointoken.TokenMissing)
    if len(req.pow_challenge) > MAX_POW_CHALLENGE_BYTES:
        raise ValidationError("pow_challenge", f"longer than {MAX_POW_CHALLENGE_BYTES} bytes")


_ACTIVE_PHASES = (pb.PHASE_TRAINING, pb.PHASE_READY, pb.PHASE_REDUCING)


def validate_heartbeat(req: pb.HeartbeatRequest, spec: RunSpec) -> None:
    """Phase defined; training/ready/reducing phases name a cell and a round >= 1."""
    _enum("phase", req.phase, pb.Phase)
    active = req.phase in _ACTIVE_PHASES
    _cell("cell_id", req.cell_id, spec, required=active)
    _round("round", req.round, lo=1 if active else 0)
    _int("inner_step", req.inner_step, 0, spec.diloco.inner_steps)
    _float("loss", req.loss, 0.0, MAX_LOSS)
    _int("samples", req.samples, 0, MAX_SAMPLES)
    _local("local", req.local, spec)
    _int("reduce_attempt", req.reduce_attempt, 0, MAX_REDUCE_ATTEMPT)
    _int("round_attempt", req.round_attempt, 0, MAX_ROUND_ATTEMPT)
    if len(req.donor_rates) > MAX_SYNC_DONORS:
        raise ValidationError("donor_rates", f"{len(req.donor_rates)} entries, a sync names at most {MAX_SYNC_DONORS}")
    for i, d in enumerate(req.donor_rates):
        _text(f"donor_rates[{i}].worker_id", d.worker_id, MAX_NAME_CHARS, required=True)
        _int(f"donor_rates[{i}].nbytes", d.nbytes, 0, MAX_BYTES_COUNTER)
        _int(f"donor_rates[{i}].ms", d.ms, 0, MAX_DURATION_MS)


MAX_WATCH_WAIT_MS = 60_000  # a longer hold is refused, not capped: no worker asks for one


def validate_watch_instruction(req: pb.WatchInstructionRequest, spec: RunSpec) -> None:
    """A hold of 0..MAX_WATCH_WAIT_MS; any 64-bit tag (an unknown one answers at once)."""
    _int("wait_ms", req.wait_ms, 0, MAX_WATCH_WAIT_MS)


def validate_report_round(req: pb.ReportRoundRequest, spec: RunSpec) -> None:
    """A successful report carries a hash; a failed one may not, and says why."""
    _cell("cell_id", req.cell_id, spec, required=True)
    _round("round", req.round, lo=1)
    _hash("state_hash", req.state_hash, required=not req.failed)
    _int("samples", req.samples, 0, MAX_SAMPLES)
    _float("loss", req.loss, 0.0, MAX_LOSS)
    _int("compute_ms", req.compute_ms, 0, MAX_DURATION_MS)
    _int("comm_ms", req.comm_ms, 0, MAX_DURATION_MS)
    _int("bytes_sent", req.bytes_sent, 0, MAX_BYTES_COUNTER)
    _int("bytes_received", req.bytes_received, 0, MAX_BYTES_COUNTER)
    _text("reason", req.reason, MAX_REASON_CHARS)
    _int("reduce_attempt", req.reduce_attempt, 0, MAX_REDUCE_ATTEMPT)
    # the commit guard's measurements: optional, and when present finite and >= 0
    for name in ("heldout_loss", "heldout_loss_base"):
        if req.HasField(name):
            _float(name, getattr(req, name), 0.0, MAX_LOSS)
    if req.HasField("audit"):
        _audit("audit", req.audit, spec)
    _round_metrics(req)
    _peer_rates(req, spec)


def _peer_rates(req: pb.ReportRoundRequest, spec: RunSpec) -> None:
    """At most one entry per peer of an exchange (the audit's bound on its senders), each
    naming a peer once, with bytes and milliseconds in range. Whether the peer was a
    contributor of the exchange is the core's to check (it reads only those)."""
    most = max(MAX_AUDIT_CONTRIBUTORS, spec.schedule.max_replicas)
    if len(req.peer_rates) > most:
        raise ValidationError("peer_rates", f"{len(req.peer_rates)} entries, an exchange has at most {most} peers")
    seen: set[str] = set()
    for i, r in enumerate(req.peer_rates):
        _text(f"peer_rates[{i}].worker_id", r.worker_id, MAX_NAME_CHARS, required=True)
        if r.worker_id in seen:
            raise ValidationError(f"peer_rates[{i}].worker_id", f"{r.worker_id!r} named twice")
        seen.add(r.worker_id)
        _int(f"peer_rates[{i}].nbytes", r.nbytes, 0, MAX_BYTES_COUNTER)
        _int(f"peer_rates[{i}].ms", r.ms, 0, MAX_DURATION_MS)


# The round metrics a report carries (`coordinator/metrics.py` exports them): each phase
# within MAX_DURATION_MS, memory within MAX_VRAM_BYTES; the coordinator also clamps what it
# bills to the round's span, so a liar inflates no cost beyond the time the round was open.
REPORT_PHASE_FIELDS = (
    "data_ms",
    "forward_backward_ms",
    "optimizer_ms",
    "encode_ms",
    "exchange_ms",
    "outer_step_ms",
    "waiting_ms",
)
REPORT_MEMORY_FIELDS = ("cuda_free_bytes", "cuda_peak_allocated_bytes", "rss_bytes")


def _round_metrics(req: pb.ReportRoundRequest) -> None:
    for name in REPORT_PHASE_FIELDS:
        _int(name, getattr(req, name), 0, MAX_DURATION_MS)
    for name in REPORT_MEMORY_FIELDS:
        _int(name, getattr(req, name), 0, MAX_VRAM_BYTES)
    total = sum(getattr(req, name) for name in REPORT_PHASE_FIELDS)
    if total > MAX_DURATION_MS:
        raise ValidationError("data_ms", f"the phases sum to {total} ms, over {MAX_DURATION_MS}")


def _audit(field: str, a: pb.AuditPart, spec: RunSpec) -> None:
    """A bounded number of entries, each sender once, finite
    statistics, and sketches that fit the run's sketch blocks."""
    # a bound no exchange comes near (a cell has at most max_replicas workers, but a report
    # refused for an edge case of the placement would cost its round: the core checks the rest)
    most = max(MAX_AUDIT_CONTRIBUTORS, spec.schedule.max_replicas)
    blocks = spec.audit.sketch_blocks
    _int(f"{field}.part", a.part, 0, most - 1)
    _int(f"{field}.first_block", a.first_block, 0, blocks - 1)
    if len(a.senders) > most:
        raise ValidationError(f"{field}.senders", f"{len(a.senders)} entries, a cell has at most {most} contributors")
    seen: set[str] = set()
    for i, x in enumerate(a.senders):
        f = f"{field}.senders[{i}]"
        _text(f"{f}.sender", x.sender, MAX_NAME_CHARS, required=True)
        if x.sender in seen:
            raise ValidationError(f"{f}.sender", f"{x.sender!r} appears twice")
        seen.add(x.sender)
        _float(f"{f}.norm", x.norm, 0.0, MAX_AUDIT_NORM)
        _float(f"{f}.max_cosine", x.max_cosine, -1.0 - 1e-6, 1.0 + 1e-6)
        _text(f"{f}.nearest", x.nearest, MAX_NAME_CHARS)
        _text(f"{f}.excluded", x.excluded, MAX_REASON_CHARS)
        _float(f"{f}.loss_gain", x.loss_gain, -MAX_LOSS, MAX_LOSS)
        _float(f"{f}.loss_gain_random", x.loss_gain_random, -MAX_LOSS, MAX_LOSS)
        if a.first_block + len(x.sketch) > blocks:
            raise ValidationError(f"{f}.sketch", f"{len(x.sketch)} blocks from {a.first_block}, the run has {blocks}")


def validate_leave(req: pb.LeaveRequest, spec: RunSpec) -> None:
    _text("reason", req.reason, MAX_REASON_CHARS)


def validate_upload_header(req: pb.UploadCheckpointHeader, spec: RunSpec) -> None:
    """A committed round (>= 1) of a real cell, with its hash, size and file sha256."""
    _cell("cell_id", req.cell_id, spec, required=True)
    _round("round", req.round, lo=1)
    _hash("state_hash", req.state_hash, required=True)
    _int("total_bytes", req.total_bytes, 1, spec.checkpoint.max_bytes)
    _hash("sha256", req.sha256, required=True)


def validate_download_request(req: pb.DownloadCheckpointRequest, spec: RunSpec) -> None:
    """round 0 = the latest checkpoint."""
    _cell("cell_id", req.cell_id, spec, required=True)
    _round("round", req.round, lo=0)


def validate_data_manifest_request(req: pb.DataManifestRequest, spec: RunSpec) -> None:
    _cell("cell_id", req.cell_id, spec, required=True)


def validate_fetch_data_shard(req: pb.FetchDataShardRequest, spec: RunSpec) -> None:
    """A shard by its sha256 name; the offset is checked against the shard's size by the store."""
    _hash("sha256", req.sha256, required=True)
    _int("offset", req.offset, 0, 1 << 40)


def validate_evidence(req: pb.EvidenceRequest, spec: RunSpec) -> None:
    """Sizes only: what the evidence proves is checked by `bagel.robust.evidence.adjudicate`."""
    if not 0 < len(req.receipt) <= MAX_EVIDENCE_RECEIPT_BYTES:
        raise ValidationError("receipt", f"{len(req.receipt)} bytes, expected 1..{MAX_EVIDENCE_RECEIPT_BYTES}")
    if len(req.receipt_signature) != 64:
        raise ValidationError("receipt_signature", f"{len(req.receipt_signature)} bytes, expected 64")
    if len(req.reducer_public_key) != 32:
        raise ValidationError("reducer_public_key", f"{len(req.reducer_public_key)} bytes, expected 32")
    if not 0 < len(req.inputs) <= MAX_EVIDENCE_INPUTS:
        raise ValidationError("inputs", f"{len(req.inputs)} inputs, expected 1..{MAX_EVIDENCE_INPUTS}")
    for i, e in enumerate(req.inputs):
        if not 0 < len(e.contribution_header) <= MAX_EVIDENCE_HEADER_BYTES:
            raise ValidationError(f"inputs[{i}].contribution_header", f"{len(e.contribution_header)} bytes")


VALIDATORS: dict[str, Callable[[Any, RunSpec], None]] = {
    "Register": validate_register,
    "Heartbeat": validate_heartbeat,
    "ReportRound": validate_report_round,
    "Leave": validate_leave,
    "UploadCheckpoint": validate_upload_header,
    "DownloadCheckpoint": validate_download_request,
    "Accuse": validate_evidence,
    "GetDataManifest": validate_data_manifest_request,
    "FetchDataShard": validate_fetch_data_shard,
    "WatchInstruction": validate_watch_instruction,
}


def validate(method: str, message: Message, spec: RunSpec) -> None:
    """Validate the payload of RPC `method` (the envelope already checked its header)."""
    try:
        check = VALIDATORS[method]
    except KeyError:
        raise ValueError(f"unknown method {method!r}") from None
    check(message, spec)
