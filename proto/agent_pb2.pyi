from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TierScope(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_SCOPE_UNSPECIFIED: _ClassVar[TierScope]
    TIER_SCOPE_NODE: _ClassVar[TierScope]
    TIER_SCOPE_SHARED: _ClassVar[TierScope]

class TierHealth(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_HEALTH_UNSPECIFIED: _ClassVar[TierHealth]
    TIER_HEALTH_OK: _ClassVar[TierHealth]
    TIER_HEALTH_FAILING: _ClassVar[TierHealth]
TIER_SCOPE_UNSPECIFIED: TierScope
TIER_SCOPE_NODE: TierScope
TIER_SCOPE_SHARED: TierScope
TIER_HEALTH_UNSPECIFIED: TierHealth
TIER_HEALTH_OK: TierHealth
TIER_HEALTH_FAILING: TierHealth

class RegisterTrainerRequest(_message.Message):
    __slots__ = ("job", "rank", "world_size", "pid", "tiers", "shm_dir", "local_world_size")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    SHM_DIR_FIELD_NUMBER: _ClassVar[int]
    LOCAL_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    world_size: int
    pid: int
    tiers: _containers.RepeatedScalarFieldContainer[str]
    shm_dir: str
    local_world_size: int
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., pid: _Optional[int] = ..., tiers: _Optional[_Iterable[str]] = ..., shm_dir: _Optional[str] = ..., local_world_size: _Optional[int] = ...) -> None: ...

class RegisterTrainerResponse(_message.Message):
    __slots__ = ("agent_id", "tiers")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    tiers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, agent_id: _Optional[str] = ..., tiers: _Optional[_Iterable[str]] = ...) -> None: ...

class SnapshotReadyRequest(_message.Message):
    __slots__ = ("job", "rank", "step", "final", "pid", "world_size", "local_world_size", "generation")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    step: int
    final: bool
    pid: int
    world_size: int
    local_world_size: int
    generation: int
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., final: _Optional[bool] = ..., pid: _Optional[int] = ..., world_size: _Optional[int] = ..., local_world_size: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class SnapshotReadyResponse(_message.Message):
    __slots__ = ("register_again",)
    REGISTER_AGAIN_FIELD_NUMBER: _ClassVar[int]
    register_again: bool
    def __init__(self, register_again: _Optional[bool] = ...) -> None: ...

class GetTierStatusRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class TierStatus(_message.Message):
    __slots__ = ("url", "scope", "health", "last_committed_step", "lag_steps", "lag_seconds", "bytes_persisted", "snapshots_persisted", "last_error", "last_persist_seconds", "last_persist_bytes", "last_committed_generation")
    URL_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    LAST_COMMITTED_STEP_FIELD_NUMBER: _ClassVar[int]
    LAG_STEPS_FIELD_NUMBER: _ClassVar[int]
    LAG_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PERSISTED_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_PERSISTED_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    LAST_PERSIST_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_PERSIST_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_COMMITTED_GENERATION_FIELD_NUMBER: _ClassVar[int]
    url: str
    scope: TierScope
    health: TierHealth
    last_committed_step: int
    lag_steps: int
    lag_seconds: float
    bytes_persisted: int
    snapshots_persisted: int
    last_error: str
    last_persist_seconds: float
    last_persist_bytes: int
    last_committed_generation: int
    def __init__(self, url: _Optional[str] = ..., scope: _Optional[_Union[TierScope, str]] = ..., health: _Optional[_Union[TierHealth, str]] = ..., last_committed_step: _Optional[int] = ..., lag_steps: _Optional[int] = ..., lag_seconds: _Optional[float] = ..., bytes_persisted: _Optional[int] = ..., snapshots_persisted: _Optional[int] = ..., last_error: _Optional[str] = ..., last_persist_seconds: _Optional[float] = ..., last_persist_bytes: _Optional[int] = ..., last_committed_generation: _Optional[int] = ...) -> None: ...

class GetTierStatusResponse(_message.Message):
    __slots__ = ("tiers",)
    TIERS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStatus]
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStatus, _Mapping]]] = ...) -> None: ...

class ListSnapshotsRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class MemorySnapshot(_message.Message):
    __slots__ = ("rank", "step", "sealed", "generation")
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    rank: int
    step: int
    sealed: bool
    generation: int
    def __init__(self, rank: _Optional[int] = ..., step: _Optional[int] = ..., sealed: _Optional[bool] = ..., generation: _Optional[int] = ...) -> None: ...

class TierSteps(_message.Message):
    __slots__ = ("url", "committed_steps", "generation")
    URL_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_STEPS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    url: str
    committed_steps: _containers.RepeatedScalarFieldContainer[int]
    generation: int
    def __init__(self, url: _Optional[str] = ..., committed_steps: _Optional[_Iterable[int]] = ..., generation: _Optional[int] = ...) -> None: ...

class ListSnapshotsResponse(_message.Message):
    __slots__ = ("memory", "tiers")
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    memory: _containers.RepeatedCompositeFieldContainer[MemorySnapshot]
    tiers: _containers.RepeatedCompositeFieldContainer[TierSteps]
    def __init__(self, memory: _Optional[_Iterable[_Union[MemorySnapshot, _Mapping]]] = ..., tiers: _Optional[_Iterable[_Union[TierSteps, _Mapping]]] = ...) -> None: ...

class FetchRestoreRequest(_message.Message):
    __slots__ = ("job", "rank", "step")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    step: int
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class RestoreSource(_message.Message):
    __slots__ = ("url", "step")
    URL_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    url: str
    step: int
    def __init__(self, url: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class FetchRestoreResponse(_message.Message):
    __slots__ = ("sources",)
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    sources: _containers.RepeatedCompositeFieldContainer[RestoreSource]
    def __init__(self, sources: _Optional[_Iterable[_Union[RestoreSource, _Mapping]]] = ...) -> None: ...
