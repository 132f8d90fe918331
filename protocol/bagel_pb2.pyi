from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PeerReachability(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PEER_REACHABILITY_UNKNOWN: _ClassVar[PeerReachability]
    PEER_REACHABILITY_DIRECT: _ClassVar[PeerReachability]
    PEER_REACHABILITY_RELAYED: _ClassVar[PeerReachability]
    PEER_REACHABILITY_UNREACHABLE: _ClassVar[PeerReachability]

class Order(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ORDER_UNSPECIFIED: _ClassVar[Order]
    ORDER_WAIT: _ClassVar[Order]
    ORDER_SYNC: _ClassVar[Order]
    ORDER_TRAIN: _ClassVar[Order]
    ORDER_REDUCE: _ClassVar[Order]
    ORDER_LEAVE: _ClassVar[Order]

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    PHASE_IDLE: _ClassVar[Phase]
    PHASE_SYNCING: _ClassVar[Phase]
    PHASE_TRAINING: _ClassVar[Phase]
    PHASE_READY: _ClassVar[Phase]
    PHASE_REDUCING: _ClassVar[Phase]

class Verdict(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERDICT_UNSPECIFIED: _ClassVar[Verdict]
    VERDICT_PENDING: _ClassVar[Verdict]
    VERDICT_COMMITTED: _ClassVar[Verdict]
    VERDICT_RESYNC: _ClassVar[Verdict]
    VERDICT_ABORTED: _ClassVar[Verdict]
PEER_REACHABILITY_UNKNOWN: PeerReachability
PEER_REACHABILITY_DIRECT: PeerReachability
PEER_REACHABILITY_RELAYED: PeerReachability
PEER_REACHABILITY_UNREACHABLE: PeerReachability
ORDER_UNSPECIFIED: Order
ORDER_WAIT: Order
ORDER_SYNC: Order
ORDER_TRAIN: Order
ORDER_REDUCE: Order
ORDER_LEAVE: Order
PHASE_UNSPECIFIED: Phase
PHASE_IDLE: Phase
PHASE_SYNCING: Phase
PHASE_TRAINING: Phase
PHASE_READY: Phase
PHASE_REDUCING: Phase
VERDICT_UNSPECIFIED: Verdict
VERDICT_PENDING: Verdict
VERDICT_COMMITTED: Verdict
VERDICT_RESYNC: Verdict
VERDICT_ABORTED: Verdict

class SignedRequest(_message.Message):
    __slots__ = ("payload", "signature", "public_key")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    signature: bytes
    public_key: bytes
    def __init__(self, payload: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., public_key: _Optional[bytes] = ...) -> None: ...

class RequestHeader(_message.Message):
    __slots__ = ("run_id", "method", "timestamp_unix_ms", "nonce")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    method: str
    timestamp_unix_ms: int
    nonce: bytes
    def __init__(self, run_id: _Optional[str] = ..., method: _Optional[str] = ..., timestamp_unix_ms: _Optional[int] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class PeerAddress(_message.Message):
    __slots__ = ("peer_id", "maddrs")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    MADDRS_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    maddrs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, peer_id: _Optional[str] = ..., maddrs: _Optional[_Iterable[str]] = ...) -> None: ...

class WorkerProfile(_message.Message):
    __slots__ = ("name", "device_kind", "device_name", "vram_bytes", "num_devices", "link_bandwidth_bytes_per_s", "samples_per_s", "software_version", "host_memory_bytes", "reachability", "reachability_detail")
    class SamplesPerSEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    VRAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_DEVICES_FIELD_NUMBER: _ClassVar[int]
    LINK_BANDWIDTH_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_VERSION_FIELD_NUMBER: _ClassVar[int]
    HOST_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_DETAIL_FIELD_NUMBER: _ClassVar[int]
    name: str
    device_kind: str
    device_name: str
    vram_bytes: int
    num_devices: int
    link_bandwidth_bytes_per_s: float
    samples_per_s: _containers.ScalarMap[str, float]
    software_version: str
    host_memory_bytes: int
    reachability: PeerReachability
    reachability_detail: str
    def __init__(self, name: _Optional[str] = ..., device_kind: _Optional[str] = ..., device_name: _Optional[str] = ..., vram_bytes: _Optional[int] = ..., num_devices: _Optional[int] = ..., link_bandwidth_bytes_per_s: _Optional[float] = ..., samples_per_s: _Optional[_Mapping[str, float]] = ..., software_version: _Optional[str] = ..., host_memory_bytes: _Optional[int] = ..., reachability: _Optional[_Union[PeerReachability, str]] = ..., reachability_detail: _Optional[str] = ...) -> None: ...

class LocalState(_message.Message):
    __slots__ = ("cell_id", "committed_round", "state_hash")
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_ROUND_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    cell_id: str
    committed_round: int
    state_hash: str
    def __init__(self, cell_id: _Optional[str] = ..., committed_round: _Optional[int] = ..., state_hash: _Optional[str] = ...) -> None: ...

class Member(_message.Message):
    __slots__ = ("worker_id", "peer", "max_samples", "no_reduce", "part_weight")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    MAX_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    NO_REDUCE_FIELD_NUMBER: _ClassVar[int]
    PART_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    peer: PeerAddress
    max_samples: int
    no_reduce: bool
    part_weight: int
    def __init__(self, worker_id: _Optional[str] = ..., peer: _Optional[_Union[PeerAddress, _Mapping]] = ..., max_samples: _Optional[int] = ..., no_reduce: _Optional[bool] = ..., part_weight: _Optional[int] = ...) -> None: ...

class RoundPlan(_message.Message):
    __slots__ = ("inner_steps", "micro_batch", "grad_accum", "deadline_unix_ms", "members", "late_from")
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    GRAD_ACCUM_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    LATE_FROM_FIELD_NUMBER: _ClassVar[int]
    inner_steps: int
    micro_batch: int
    grad_accum: int
    deadline_unix_ms: int
    members: _containers.RepeatedCompositeFieldContainer[Member]
    late_from: int
    def __init__(self, inner_steps: _Optional[int] = ..., micro_batch: _Optional[int] = ..., grad_accum: _Optional[int] = ..., deadline_unix_ms: _Optional[int] = ..., members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., late_from: _Optional[int] = ...) -> None: ...

class Donor(_message.Message):
    __slots__ = ("worker_id", "peer", "checkpoint_round", "expected_bytes_per_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ROUND_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    peer: PeerAddress
    checkpoint_round: int
    expected_bytes_per_s: float
    def __init__(self, worker_id: _Optional[str] = ..., peer: _Optional[_Union[PeerAddress, _Mapping]] = ..., checkpoint_round: _Optional[int] = ..., expected_bytes_per_s: _Optional[float] = ...) -> None: ...

class Instruction(_message.Message):
    __slots__ = ("order", "cell_id", "round", "committed_round", "committed_hash", "plan", "contributors", "donor", "upload_checkpoint", "reason", "reduce_attempt", "round_attempt", "donors", "tag", "reduce_deadline_unix_ms")
    ORDER_FIELD_NUMBER: _ClassVar[int]
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_ROUND_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_HASH_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    DONOR_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REDUCE_ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    ROUND_ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    DONORS_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    REDUCE_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    order: Order
    cell_id: str
    round: int
    committed_round: int
    committed_hash: str
    plan: RoundPlan
    contributors: _containers.RepeatedCompositeFieldContainer[Member]
    donor: Donor
    upload_checkpoint: bool
    reason: str
    reduce_attempt: int
    round_attempt: int
    donors: _containers.RepeatedCompositeFieldContainer[Donor]
    tag: int
    reduce_deadline_unix_ms: int
    def __init__(self, order: _Optional[_Union[Order, str]] = ..., cell_id: _Optional[str] = ..., round: _Optional[int] = ..., committed_round: _Optional[int] = ..., committed_hash: _Optional[str] = ..., plan: _Optional[_Union[RoundPlan, _Mapping]] = ..., contributors: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., donor: _Optional[_Union[Donor, _Mapping]] = ..., upload_checkpoint: _Optional[bool] = ..., reason: _Optional[str] = ..., reduce_attempt: _Optional[int] = ..., round_attempt: _Optional[int] = ..., donors: _Optional[_Iterable[_Union[Donor, _Mapping]]] = ..., tag: _Optional[int] = ..., reduce_deadline_unix_ms: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("header", "profile", "peer", "local", "join_token", "pow_challenge", "pow_nonce")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    JOIN_TOKEN_FIELD_NUMBER: _ClassVar[int]
    POW_CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    POW_NONCE_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    profile: WorkerProfile
    peer: PeerAddress
    local: LocalState
    join_token: bytes
    pow_challenge: bytes
    pow_nonce: int
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ..., profile: _Optional[_Union[WorkerProfile, _Mapping]] = ..., peer: _Optional[_Union[PeerAddress, _Mapping]] = ..., local: _Optional[_Union[LocalState, _Mapping]] = ..., join_token: _Optional[bytes] = ..., pow_challenge: _Optional[bytes] = ..., pow_nonce: _Optional[int] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("worker_id", "lease_expires_unix_ms", "heartbeat_interval_ms", "spec_toml", "spec_hash", "instruction", "init_sha256")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    SPEC_TOML_FIELD_NUMBER: _ClassVar[int]
    SPEC_HASH_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    INIT_SHA256_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    lease_expires_unix_ms: int
    heartbeat_interval_ms: int
    spec_toml: str
    spec_hash: str
    instruction: Instruction
    init_sha256: str
    def __init__(self, worker_id: _Optional[str] = ..., lease_expires_unix_ms: _Optional[int] = ..., heartbeat_interval_ms: _Optional[int] = ..., spec_toml: _Optional[str] = ..., spec_hash: _Optional[str] = ..., instruction: _Optional[_Union[Instruction, _Mapping]] = ..., init_sha256: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("header", "phase", "cell_id", "round", "inner_step", "loss", "samples", "local", "reduce_attempt", "round_attempt", "donor_rates")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    INNER_STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    REDUCE_ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    ROUND_ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    DONOR_RATES_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    phase: Phase
    cell_id: str
    round: int
    inner_step: int
    loss: float
    samples: int
    local: LocalState
    reduce_attempt: int
    round_attempt: int
    donor_rates: _containers.RepeatedCompositeFieldContainer[DonorRate]
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ..., phase: _Optional[_Union[Phase, str]] = ..., cell_id: _Optional[str] = ..., round: _Optional[int] = ..., inner_step: _Optional[int] = ..., loss: _Optional[float] = ..., samples: _Optional[int] = ..., local: _Optional[_Union[LocalState, _Mapping]] = ..., reduce_attempt: _Optional[int] = ..., round_attempt: _Optional[int] = ..., donor_rates: _Optional[_Iterable[_Union[DonorRate, _Mapping]]] = ...) -> None: ...

class WatchInstructionRequest(_message.Message):
    __slots__ = ("header", "known_tag", "wait_ms")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    KNOWN_TAG_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    known_tag: int
    wait_ms: int
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ..., known_tag: _Optional[int] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class WatchInstructionResponse(_message.Message):
    __slots__ = ("instruction", "changed")
    INSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    instruction: Instruction
    changed: bool
    def __init__(self, instruction: _Optional[_Union[Instruction, _Mapping]] = ..., changed: _Optional[bool] = ...) -> None: ...

class DonorRate(_message.Message):
    __slots__ = ("worker_id", "nbytes", "ms")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    MS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    nbytes: int
    ms: int
    def __init__(self, worker_id: _Optional[str] = ..., nbytes: _Optional[int] = ..., ms: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_expires_unix_ms", "instruction")
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    lease_expires_unix_ms: int
    instruction: Instruction
    def __init__(self, lease_expires_unix_ms: _Optional[int] = ..., instruction: _Optional[_Union[Instruction, _Mapping]] = ...) -> None: ...

class ReportRoundRequest(_message.Message):
    __slots__ = ("header", "cell_id", "round", "state_hash", "samples", "loss", "compute_ms", "comm_ms", "bytes_sent", "bytes_received", "failed", "reason", "reduce_attempt", "audit", "heldout_loss", "heldout_loss_base", "data_ms", "forward_backward_ms", "optimizer_ms", "encode_ms", "exchange_ms", "outer_step_ms", "waiting_ms", "cuda_free_bytes", "cuda_peak_allocated_bytes", "rss_bytes", "peer_rates")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    COMM_MS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REDUCE_ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    AUDIT_FIELD_NUMBER: _ClassVar[int]
    HELDOUT_LOSS_FIELD_NUMBER: _ClassVar[int]
    HELDOUT_LOSS_BASE_FIELD_NUMBER: _ClassVar[int]
    DATA_MS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_BACKWARD_MS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_MS_FIELD_NUMBER: _ClassVar[int]
    ENCODE_MS_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_MS_FIELD_NUMBER: _ClassVar[int]
    OUTER_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    WAITING_MS_FIELD_NUMBER: _ClassVar[int]
    CUDA_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CUDA_PEAK_ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEER_RATES_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    cell_id: str
    round: int
    state_hash: str
    samples: int
    loss: float
    compute_ms: int
    comm_ms: int
    bytes_sent: int
    bytes_received: int
    failed: bool
    reason: str
    reduce_attempt: int
    audit: AuditPart
    heldout_loss: float
    heldout_loss_base: float
    data_ms: int
    forward_backward_ms: int
    optimizer_ms: int
    encode_ms: int
    exchange_ms: int
    outer_step_ms: int
    waiting_ms: int
    cuda_free_bytes: int
    cuda_peak_allocated_bytes: int
    rss_bytes: int
    peer_rates: _containers.RepeatedCompositeFieldContainer[PeerRate]
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ..., cell_id: _Optional[str] = ..., round: _Optional[int] = ..., state_hash: _Optional[str] = ..., samples: _Optional[int] = ..., loss: _Optional[float] = ..., compute_ms: _Optional[int] = ..., comm_ms: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., failed: _Optional[bool] = ..., reason: _Optional[str] = ..., reduce_attempt: _Optional[int] = ..., audit: _Optional[_Union[AuditPart, _Mapping]] = ..., heldout_loss: _Optional[float] = ..., heldout_loss_base: _Optional[float] = ..., data_ms: _Optional[int] = ..., forward_backward_ms: _Optional[int] = ..., optimizer_ms: _Optional[int] = ..., encode_ms: _Optional[int] = ..., exchange_ms: _Optional[int] = ..., outer_step_ms: _Optional[int] = ..., waiting_ms: _Optional[int] = ..., cuda_free_bytes: _Optional[int] = ..., cuda_peak_allocated_bytes: _Optional[int] = ..., rss_bytes: _Optional[int] = ..., peer_rates: _Optional[_Iterable[_Union[PeerRate, _Mapping]]] = ...) -> None: ...

class PeerRate(_message.Message):
    __slots__ = ("worker_id", "nbytes", "ms")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    MS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    nbytes: int
    ms: int
    def __init__(self, worker_id: _Optional[str] = ..., nbytes: _Optional[int] = ..., ms: _Optional[int] = ...) -> None: ...

class AuditPart(_message.Message):
    __slots__ = ("part", "first_block", "senders")
    PART_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    SENDERS_FIELD_NUMBER: _ClassVar[int]
    part: int
    first_block: int
    senders: _containers.RepeatedCompositeFieldContainer[AuditSender]
    def __init__(self, part: _Optional[int] = ..., first_block: _Optional[int] = ..., senders: _Optional[_Iterable[_Union[AuditSender, _Mapping]]] = ...) -> None: ...

class AuditSender(_message.Message):
    __slots__ = ("sender", "norm", "max_cosine", "nearest", "excluded", "sketch", "loss_gain", "loss_gain_random", "loss_measured")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    NORM_FIELD_NUMBER: _ClassVar[int]
    MAX_COSINE_FIELD_NUMBER: _ClassVar[int]
    NEAREST_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    SKETCH_FIELD_NUMBER: _ClassVar[int]
    LOSS_GAIN_FIELD_NUMBER: _ClassVar[int]
    LOSS_GAIN_RANDOM_FIELD_NUMBER: _ClassVar[int]
    LOSS_MEASURED_FIELD_NUMBER: _ClassVar[int]
    sender: str
    norm: float
    max_cosine: float
    nearest: str
    excluded: str
    sketch: _containers.RepeatedScalarFieldContainer[int]
    loss_gain: float
    loss_gain_random: float
    loss_measured: bool
    def __init__(self, sender: _Optional[str] = ..., norm: _Optional[float] = ..., max_cosine: _Optional[float] = ..., nearest: _Optional[str] = ..., excluded: _Optional[str] = ..., sketch: _Optional[_Iterable[int]] = ..., loss_gain: _Optional[float] = ..., loss_gain_random: _Optional[float] = ..., loss_measured: _Optional[bool] = ...) -> None: ...

class ReportRoundResponse(_message.Message):
    __slots__ = ("verdict", "instruction")
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    verdict: Verdict
    instruction: Instruction
    def __init__(self, verdict: _Optional[_Union[Verdict, str]] = ..., instruction: _Optional[_Union[Instruction, _Mapping]] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("header", "reason", "offer_checkpoint")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    OFFER_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    reason: str
    offer_checkpoint: bool
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ..., reason: _Optional[str] = ..., offer_checkpoint: _Optional[bool] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ("upload_first", "instruction")
    UPLOAD_FIRST_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    upload_first: bool
    instruction: Instruction
    def __init__(self, upload_first: _Optional[bool] = ..., instruction: _Optional[_Union[Instruction, _Mapping]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ("auth",)
    AUTH_FIELD_NUMBER: _ClassVar[int]
    auth: SignedRequest
    def __init__(self, auth: _Optional[_Union[SignedRequest, _Mapping]] = ...) -> None: ...

class StatusAuthRequest(_message.Message):
    __slots__ = ("header",)
    HEADER_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "name", "state", "cell_id", "phase", "lease_expires_unix_ms", "reputation", "samples_per_s", "vram_bytes", "rounds_contributed", "host_memory_bytes", "last_heartbeat_unix_ms", "reachability", "reachability_detail")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    REPUTATION_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    VRAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_CONTRIBUTED_FIELD_NUMBER: _ClassVar[int]
    HOST_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_DETAIL_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    name: str
    state: str
    cell_id: str
    phase: Phase
    lease_expires_unix_ms: int
    reputation: float
    samples_per_s: float
    vram_bytes: int
    rounds_contributed: int
    host_memory_bytes: int
    last_heartbeat_unix_ms: int
    reachability: PeerReachability
    reachability_detail: str
    def __init__(self, worker_id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[str] = ..., cell_id: _Optional[str] = ..., phase: _Optional[_Union[Phase, str]] = ..., lease_expires_unix_ms: _Optional[int] = ..., reputation: _Optional[float] = ..., samples_per_s: _Optional[float] = ..., vram_bytes: _Optional[int] = ..., rounds_contributed: _Optional[int] = ..., host_memory_bytes: _Optional[int] = ..., last_heartbeat_unix_ms: _Optional[int] = ..., reachability: _Optional[_Union[PeerReachability, str]] = ..., reachability_detail: _Optional[str] = ...) -> None: ...

class CellStatus(_message.Message):
    __slots__ = ("cell_id", "kind", "round", "round_state", "committed_round", "committed_hash", "members", "target_share", "actual_share", "last_loss", "latest_checkpoint_round", "samples_committed", "sample_target", "samples_per_s", "last_commit_unix_ms", "rollbacks")
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ROUND_STATE_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_ROUND_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_HASH_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    TARGET_SHARE_FIELD_NUMBER: _ClassVar[int]
    ACTUAL_SHARE_FIELD_NUMBER: _ClassVar[int]
    LAST_LOSS_FIELD_NUMBER: _ClassVar[int]
    LATEST_CHECKPOINT_ROUND_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_TARGET_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    LAST_COMMIT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ROLLBACKS_FIELD_NUMBER: _ClassVar[int]
    cell_id: str
    kind: str
    round: int
    round_state: str
    committed_round: int
    committed_hash: str
    members: _containers.RepeatedScalarFieldContainer[str]
    target_share: float
    actual_share: float
    last_loss: float
    latest_checkpoint_round: int
    samples_committed: int
    sample_target: int
    samples_per_s: float
    last_commit_unix_ms: int
    rollbacks: int
    def __init__(self, cell_id: _Optional[str] = ..., kind: _Optional[str] = ..., round: _Optional[int] = ..., round_state: _Optional[str] = ..., committed_round: _Optional[int] = ..., committed_hash: _Optional[str] = ..., members: _Optional[_Iterable[str]] = ..., target_share: _Optional[float] = ..., actual_share: _Optional[float] = ..., last_loss: _Optional[float] = ..., latest_checkpoint_round: _Optional[int] = ..., samples_committed: _Optional[int] = ..., sample_target: _Optional[int] = ..., samples_per_s: _Optional[float] = ..., last_commit_unix_ms: _Optional[int] = ..., rollbacks: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("run_id", "spec_hash", "now_unix_ms", "workers", "cells", "detailed", "worker_counts", "started_unix_ms")
    class WorkerCountsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_HASH_FIELD_NUMBER: _ClassVar[int]
    NOW_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    CELLS_FIELD_NUMBER: _ClassVar[int]
    DETAILED_FIELD_NUMBER: _ClassVar[int]
    WORKER_COUNTS_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    spec_hash: str
    now_unix_ms: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    cells: _containers.RepeatedCompositeFieldContainer[CellStatus]
    detailed: bool
    worker_counts: _containers.ScalarMap[str, int]
    started_unix_ms: int
    def __init__(self, run_id: _Optional[str] = ..., spec_hash: _Optional[str] = ..., now_unix_ms: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., cells: _Optional[_Iterable[_Union[CellStatus, _Mapping]]] = ..., detailed: _Optional[bool] = ..., worker_counts: _Optional[_Mapping[str, int]] = ..., started_unix_ms: _Optional[int] = ...) -> None: ...

class UploadCheckpointHeader(_message.Message):
    __slots__ = ("header", "cell_id", "round", "state_hash", "total_bytes", "sha256")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    cell_id: str
    round: int
    state_hash: str
    total_bytes: int
    sha256: str
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ..., cell_id: _Optional[str] = ..., round: _Optional[int] = ..., state_hash: _Optional[str] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class CheckpointUploadChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: SignedRequest
    data: bytes
    def __init__(self, header: _Optional[_Union[SignedRequest, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class UploadCheckpointResponse(_message.Message):
    __slots__ = ("stored", "round")
    STORED_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    stored: bool
    round: int
    def __init__(self, stored: _Optional[bool] = ..., round: _Optional[int] = ...) -> None: ...

class DownloadCheckpointRequest(_message.Message):
    __slots__ = ("header", "cell_id", "round")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    cell_id: str
    round: int
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ..., cell_id: _Optional[str] = ..., round: _Optional[int] = ...) -> None: ...

class CheckpointInfo(_message.Message):
    __slots__ = ("cell_id", "round", "state_hash", "total_bytes", "sha256")
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    cell_id: str
    round: int
    state_hash: str
    total_bytes: int
    sha256: str
    def __init__(self, cell_id: _Optional[str] = ..., round: _Optional[int] = ..., state_hash: _Optional[str] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class CheckpointDownloadChunk(_message.Message):
    __slots__ = ("info", "data")
    INFO_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    info: CheckpointInfo
    data: bytes
    def __init__(self, info: _Optional[_Union[CheckpointInfo, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class AdmissionChallengeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AdmissionChallengeResponse(_message.Message):
    __slots__ = ("run_id", "challenge", "pow_bits", "expires_unix_ms", "token_required")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    POW_BITS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    challenge: bytes
    pow_bits: int
    expires_unix_ms: int
    token_required: bool
    def __init__(self, run_id: _Optional[str] = ..., challenge: _Optional[bytes] = ..., pow_bits: _Optional[int] = ..., expires_unix_ms: _Optional[int] = ..., token_required: _Optional[bool] = ...) -> None: ...

class JoinToken(_message.Message):
    __slots__ = ("claims", "signature")
    CLAIMS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    claims: bytes
    signature: bytes
    def __init__(self, claims: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class JoinTokenClaims(_message.Message):
    __slots__ = ("run_id", "token_id", "name", "issued_unix_ms", "expires_unix_ms", "uses")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ISSUED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    USES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    token_id: bytes
    name: str
    issued_unix_ms: int
    expires_unix_ms: int
    uses: int
    def __init__(self, run_id: _Optional[str] = ..., token_id: _Optional[bytes] = ..., name: _Optional[str] = ..., issued_unix_ms: _Optional[int] = ..., expires_unix_ms: _Optional[int] = ..., uses: _Optional[int] = ...) -> None: ...

class EvidenceInput(_message.Message):
    __slots__ = ("contribution_header", "payload")
    CONTRIBUTION_HEADER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    contribution_header: bytes
    payload: bytes
    def __init__(self, contribution_header: _Optional[bytes] = ..., payload: _Optional[bytes] = ...) -> None: ...

class EvidenceRequest(_message.Message):
    __slots__ = ("header", "receipt", "receipt_signature", "reducer_public_key", "inputs")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    REDUCER_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    receipt: bytes
    receipt_signature: bytes
    reducer_public_key: bytes
    inputs: _containers.RepeatedCompositeFieldContainer[EvidenceInput]
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ..., receipt: _Optional[bytes] = ..., receipt_signature: _Optional[bytes] = ..., reducer_public_key: _Optional[bytes] = ..., inputs: _Optional[_Iterable[_Union[EvidenceInput, _Mapping]]] = ...) -> None: ...

class AccuseResponse(_message.Message):
    __slots__ = ("convicted", "reason")
    CONVICTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    convicted: str
    reason: str
    def __init__(self, convicted: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class DataManifestRequest(_message.Message):
    __slots__ = ("header", "cell_id", "partition_only")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    PARTITION_ONLY_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    cell_id: str
    partition_only: bool
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ..., cell_id: _Optional[str] = ..., partition_only: _Optional[bool] = ...) -> None: ...

class DataShardRef(_message.Message):
    __slots__ = ("sha256", "nbytes", "split", "cluster", "count")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    nbytes: int
    split: str
    cluster: int
    count: int
    def __init__(self, sha256: _Optional[str] = ..., nbytes: _Optional[int] = ..., split: _Optional[str] = ..., cluster: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class DataManifest(_message.Message):
    __slots__ = ("cell_id", "cluster_manifest_sha256", "shards", "train_count", "heldout_count")
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_COUNT_FIELD_NUMBER: _ClassVar[int]
    HELDOUT_COUNT_FIELD_NUMBER: _ClassVar[int]
    cell_id: str
    cluster_manifest_sha256: str
    shards: _containers.RepeatedCompositeFieldContainer[DataShardRef]
    train_count: int
    heldout_count: int
    def __init__(self, cell_id: _Optional[str] = ..., cluster_manifest_sha256: _Optional[str] = ..., shards: _Optional[_Iterable[_Union[DataShardRef, _Mapping]]] = ..., train_count: _Optional[int] = ..., heldout_count: _Optional[int] = ...) -> None: ...

class FetchDataShardRequest(_message.Message):
    __slots__ = ("header", "sha256", "offset")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    sha256: str
    offset: int
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ..., sha256: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class DataShardChunk(_message.Message):
    __slots__ = ("offset", "data", "total_bytes")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    total_bytes: int
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., total_bytes: _Optional[int] = ...) -> None: ...
