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
STATUS_UNSPECIFIED: Status
STATUS_OK: Status
STATUS_REJECTED: Status
STATUS_FAILED: Status
STATUS_NOT_AVAILABLE: Status
STATUS_NOT_READY: Status

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
    __slots__ = ("tag", "sender", "part", "num_parts", "total_numel", "part_numel", "layout_digest", "codec", "weight", "payload_nbytes")
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
    def __init__(self, tag: _Optional[_Union[ExchangeTag, _Mapping]] = ..., sender: _Optional[str] = ..., part: _Optional[int] = ..., num_parts: _Optional[int] = ..., total_numel: _Optional[int] = ..., part_numel: _Optional[int] = ..., layout_digest: _Optional[str] = ..., codec: _Optional[str] = ..., weight: _Optional[float] = ..., payload_nbytes: _Optional[int] = ...) -> None: ...

class Exclusion(_message.Message):
    __slots__ = ("sender", "reason")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    sender: str
    reason: str
    def __init__(self, sender: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ReducedHeader(_message.Message):
    __slots__ = ("status", "reason", "tag", "part", "payload_nbytes", "included", "excluded", "total_weight", "reducer_rule", "missing")
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
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., reason: _Optional[str] = ..., tag: _Optional[_Union[ExchangeTag, _Mapping]] = ..., part: _Optional[int] = ..., payload_nbytes: _Optional[int] = ..., included: _Optional[_Iterable[str]] = ..., excluded: _Optional[_Iterable[_Union[Exclusion, _Mapping]]] = ..., total_weight: _Optional[float] = ..., reducer_rule: _Optional[str] = ..., missing: _Optional[_Iterable[str]] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("run_id", "cell_id", "committed_round", "state_hash")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_ROUND_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    cell_id: str
    committed_round: int
    state_hash: str
    def __init__(self, run_id: _Optional[str] = ..., cell_id: _Optional[str] = ..., committed_round: _Optional[int] = ..., state_hash: _Optional[str] = ...) -> None: ...

class StateInfo(_message.Message):
    __slots__ = ("status", "reason", "cell_id", "committed_round", "state_hash", "total_nbytes", "sha256", "chunk_nbytes")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_ROUND_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NBYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    CHUNK_NBYTES_FIELD_NUMBER: _ClassVar[int]
    status: Status
    reason: str
    cell_id: str
    committed_round: int
    state_hash: str
    total_nbytes: int
    sha256: str
    chunk_nbytes: int
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., reason: _Optional[str] = ..., cell_id: _Optional[str] = ..., committed_round: _Optional[int] = ..., state_hash: _Optional[str] = ..., total_nbytes: _Optional[int] = ..., sha256: _Optional[str] = ..., chunk_nbytes: _Optional[int] = ...) -> None: ...
