from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATUS_UNSPECIFIED: _ClassVar[Status]
    STATUS_OK: _ClassVar[Status]
    STATUS_REJECTED: _ClassVar[Status]
    STATUS_FAILED: _ClassVar[Status]
    STATUS_NOT_AVAILABLE: _ClassVar[Status]
    STATUS_NOT_READY: _ClassVar[Status]

class EvidenceRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVIDENCE_ROLE_UNSPECIFIED: _ClassVar[EvidenceRole]
    EVIDENCE_ROLE_PRIMARY: _ClassVar[EvidenceRole]
    EVIDENCE_ROLE_SHADOW: _ClassVar[EvidenceRole]
STATUS_UNSPECIFIED: Status
STATUS_OK: Status
STATUS_REJECTED: Status
STATUS_FAILED: Status
STATUS_NOT_AVAILABLE: Status
STATUS_NOT_READY: Status
EVIDENCE_ROLE_UNSPECIFIED: EvidenceRole
EVIDENCE_ROLE_PRIMARY: EvidenceRole
EVIDENCE_ROLE_SHADOW: EvidenceRole

class ExchangeTag(_message.Message):
    __slots__ = ("run_id", "cell_id", "round", "reduce_attempt", "group_digest", "round_attempt")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    REDUCE_ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    GROUP_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ROUND_ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    cell_id: str
    round: int
    reduce_attempt: int
    group_digest: str
    round_attempt: int
    def __init__(self, run_id: _Optional[str] = ..., cell_id: _Optional[str] = ..., round: _Optional[int] = ..., reduce_attempt: _Optional[int] = ..., group_digest: _Optional[str] = ..., round_attempt: _Optional[int] = ...) -> None: ...

class ContributionHeader(_message.Message):
    __slots__ = ("tag", "sender", "part", "num_parts", "total_numel", "part_numel", "layout_digest", "codec", "weight", "payload_nbytes", "sender_public_key", "payload_sha256", "signature")
    TAG_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    NUM_PARTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NUMEL_FIELD_NUMBER: _ClassVar[int]
    PART_NUMEL_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_NBYTES_FIELD_NUMBER: _ClassVar[int]
    SENDER_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SHA256_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    tag: ExchangeTag
    sender: str
    part: int
    num_parts: int
    total_numel: int
    part_numel: int
    layout_digest: str
    codec: str
    weight: float
    payload_nbytes: int
    sender_public_key: bytes
    payload_sha256: bytes
    signature: bytes
    def __init__(self, tag: _Optional[_Union[ExchangeTag, _Mapping]] = ..., sender: _Optional[str] = ..., part: _Optional[int] = ..., num_parts: _Optional[int] = ..., total_numel: _Optional[int] = ..., part_numel: _Optional[int] = ..., layout_digest: _Optional[str] = ..., codec: _Optional[str] = ..., weight: _Optional[float] = ..., payload_nbytes: _Optional[int] = ..., sender_public_key: _Optional[bytes] = ..., payload_sha256: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class Exclusion(_message.Message):
    __slots__ = ("sender", "reason")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    sender: str
    reason: str
    def __init__(self, sender: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ReducedHeader(_message.Message):
    __slots__ = ("status", "reason", "tag", "part", "payload_nbytes", "included", "excluded", "total_weight", "reducer_rule", "missing", "receipt", "receipt_signature", "reducer_public_key")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_NBYTES_FIELD_NUMBER: _ClassVar[int]
    INCLUDED_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    REDUCER_RULE_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    REDUCER_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    status: Status
    reason: str
    tag: ExchangeTag
    part: int
    payload_nbytes: int
    included: _containers.RepeatedScalarFieldContainer[str]
    excluded: _containers.RepeatedCompositeFieldContainer[Exclusion]
    total_weight: float
    reducer_rule: str
    missing: _containers.RepeatedScalarFieldContainer[str]
    receipt: bytes
    receipt_signature: bytes
    reducer_public_key: bytes
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., reason: _Optional[str] = ..., tag: _Optional[_Union[ExchangeTag, _Mapping]] = ..., part: _Optional[int] = ..., payload_nbytes: _Optional[int] = ..., included: _Optional[_Iterable[str]] = ..., excluded: _Optional[_Iterable[_Union[Exclusion, _Mapping]]] = ..., total_weight: _Optional[float] = ..., reducer_rule: _Optional[str] = ..., missing: _Optional[_Iterable[str]] = ..., receipt: _Optional[bytes] = ..., receipt_signature: _Optional[bytes] = ..., reducer_public_key: _Optional[bytes] = ...) -> None: ...

class EvidenceReceipt(_message.Message):
    __slots__ = ("tag", "part", "reducer", "role", "result_sha256", "inputs", "excluded", "reducer_rule", "codec", "total_numel", "layout_digest")
    TAG_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    REDUCER_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    RESULT_SHA256_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    REDUCER_RULE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NUMEL_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    tag: ExchangeTag
    part: int
    reducer: str
    role: EvidenceRole
    result_sha256: bytes
    inputs: _containers.RepeatedCompositeFieldContainer[ContributionHeader]
    excluded: _containers.RepeatedCompositeFieldContainer[Exclusion]
    reducer_rule: str
    codec: str
    total_numel: int
    layout_digest: str
    def __init__(self, tag: _Optional[_Union[ExchangeTag, _Mapping]] = ..., part: _Optional[int] = ..., reducer: _Optional[str] = ..., role: _Optional[_Union[EvidenceRole, str]] = ..., result_sha256: _Optional[bytes] = ..., inputs: _Optional[_Iterable[_Union[ContributionHeader, _Mapping]]] = ..., excluded: _Optional[_Iterable[_Union[Exclusion, _Mapping]]] = ..., reducer_rule: _Optional[str] = ..., codec: _Optional[str] = ..., total_numel: _Optional[int] = ..., layout_digest: _Optional[str] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("run_id", "cell_id", "committed_round", "state_hash", "offset", "length", "pieces_only")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_ROUND_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    PIECES_ONLY_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    cell_id: str
    committed_round: int
    state_hash: str
    offset: int
    length: int
    pieces_only: bool
    def __init__(self, run_id: _Optional[str] = ..., cell_id: _Optional[str] = ..., committed_round: _Optional[int] = ..., state_hash: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., pieces_only: _Optional[bool] = ...) -> None: ...

class StateInfo(_message.Message):
    __slots__ = ("status", "reason", "cell_id", "committed_round", "state_hash", "total_nbytes", "sha256", "chunk_nbytes", "range_offset", "range_nbytes", "piece_nbytes", "piece_sha256")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_ROUND_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NBYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    CHUNK_NBYTES_FIELD_NUMBER: _ClassVar[int]
    RANGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    RANGE_NBYTES_FIELD_NUMBER: _ClassVar[int]
    PIECE_NBYTES_FIELD_NUMBER: _ClassVar[int]
    PIECE_SHA256_FIELD_NUMBER: _ClassVar[int]
    status: Status
    reason: str
    cell_id: str
    committed_round: int
    state_hash: str
    total_nbytes: int
    sha256: str
    chunk_nbytes: int
    range_offset: int
    range_nbytes: int
    piece_nbytes: int
    piece_sha256: bytes
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., reason: _Optional[str] = ..., cell_id: _Optional[str] = ..., committed_round: _Optional[int] = ..., state_hash: _Optional[str] = ..., total_nbytes: _Optional[int] = ..., sha256: _Optional[str] = ..., chunk_nbytes: _Optional[int] = ..., range_offset: _Optional[int] = ..., range_nbytes: _Optional[int] = ..., piece_nbytes: _Optional[int] = ..., piece_sha256: _Optional[bytes] = ...) -> None: ...

class UpdatesRequest(_message.Message):
    __slots__ = ("run_id", "cell_id", "held_round", "held_hash", "committed_round", "state_hash")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    HELD_ROUND_FIELD_NUMBER: _ClassVar[int]
    HELD_HASH_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_ROUND_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    cell_id: str
    held_round: int
    held_hash: str
    committed_round: int
    state_hash: str
    def __init__(self, run_id: _Optional[str] = ..., cell_id: _Optional[str] = ..., held_round: _Optional[int] = ..., held_hash: _Optional[str] = ..., committed_round: _Optional[int] = ..., state_hash: _Optional[str] = ...) -> None: ...

class RoundUpdate(_message.Message):
    __slots__ = ("round", "codec", "part_numel", "part_nbytes", "part_sha256")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    PART_NUMEL_FIELD_NUMBER: _ClassVar[int]
    PART_NBYTES_FIELD_NUMBER: _ClassVar[int]
    PART_SHA256_FIELD_NUMBER: _ClassVar[int]
    round: int
    codec: str
    part_numel: _containers.RepeatedScalarFieldContainer[int]
    part_nbytes: _containers.RepeatedScalarFieldContainer[int]
    part_sha256: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, round: _Optional[int] = ..., codec: _Optional[str] = ..., part_numel: _Optional[_Iterable[int]] = ..., part_nbytes: _Optional[_Iterable[int]] = ..., part_sha256: _Optional[_Iterable[bytes]] = ...) -> None: ...

class UpdatesInfo(_message.Message):
    __slots__ = ("status", "reason", "cell_id", "held_round", "committed_round", "state_hash", "chunk_nbytes", "rounds")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    HELD_ROUND_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_ROUND_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    CHUNK_NBYTES_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    reason: str
    cell_id: str
    held_round: int
    committed_round: int
    state_hash: str
    chunk_nbytes: int
    rounds: _containers.RepeatedCompositeFieldContainer[RoundUpdate]
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., reason: _Optional[str] = ..., cell_id: _Optional[str] = ..., held_round: _Optional[int] = ..., committed_round: _Optional[int] = ..., state_hash: _Optional[str] = ..., chunk_nbytes: _Optional[int] = ..., rounds: _Optional[_Iterable[_Union[RoundUpdate, _Mapping]]] = ...) -> None: ...
