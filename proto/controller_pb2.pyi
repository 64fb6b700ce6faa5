from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Worker(_message.Message):
    __slots__ = ("rank", "pid", "phase", "step", "silent_s", "age_s", "alive")
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SILENT_S_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    pid: int
    phase: str
    step: int
    silent_s: float
    age_s: float
    alive: bool
    def __init__(self, rank: _Optional[int] = ..., pid: _Optional[int] = ..., phase: _Optional[str] = ..., step: _Optional[int] = ..., silent_s: _Optional[float] = ..., age_s: _Optional[float] = ..., alive: _Optional[bool] = ...) -> None: ...

class StepKey(_message.Message):
    __slots__ = ("generation", "step")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    generation: int
    step: int
    def __init__(self, generation: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class TierCommit(_message.Message):
    __slots__ = ("url", "shared", "step", "generation", "held")
    URL_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    url: str
    shared: bool
    step: int
    generation: int
    held: _containers.RepeatedCompositeFieldContainer[StepKey]
    def __init__(self, url: _Optional[str] = ..., shared: _Optional[bool] = ..., step: _Optional[int] = ..., generation: _Optional[int] = ..., held: _Optional[_Iterable[_Union[StepKey, _Mapping]]] = ...) -> None: ...

class Replica(_message.Message):
    __slots__ = ("source", "step", "generation", "ranks")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    source: str
    step: int
    generation: int
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, source: _Optional[str] = ..., step: _Optional[int] = ..., generation: _Optional[int] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class NodeReport(_message.Message):
    __slots__ = ("job", "node", "agent_id", "world_size", "workers", "tiers", "ranks", "seq", "peer_address", "failure_domain", "replicas", "spare")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SPARE_FIELD_NUMBER: _ClassVar[int]
    job: str
    node: str
    agent_id: str
    world_size: int
    workers: _containers.RepeatedCompositeFieldContainer[Worker]
    tiers: _containers.RepeatedCompositeFieldContainer[TierCommit]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    seq: int
    peer_address: str
    failure_domain: str
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    spare: bool
    def __init__(self, job: _Optional[str] = ..., node: _Optional[str] = ..., agent_id: _Optional[str] = ..., world_size: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[Worker, _Mapping]]] = ..., tiers: _Optional[_Iterable[_Union[TierCommit, _Mapping]]] = ..., ranks: _Optional[_Iterable[int]] = ..., seq: _Optional[int] = ..., peer_address: _Optional[str] = ..., failure_domain: _Optional[str] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ..., spare: _Optional[bool] = ...) -> None: ...

class ReportReply(_message.Message):
    __slots__ = ("expired_replicas", "kill_pids", "heartbeat_s", "seq", "common_known", "common", "take_node", "lost_silent_s", "job_over", "taken_by", "join_node")
    EXPIRED_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    KILL_PIDS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_S_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    COMMON_KNOWN_FIELD_NUMBER: _ClassVar[int]
    COMMON_FIELD_NUMBER: _ClassVar[int]
    TAKE_NODE_FIELD_NUMBER: _ClassVar[int]
    LOST_SILENT_S_FIELD_NUMBER: _ClassVar[int]
    JOB_OVER_FIELD_NUMBER: _ClassVar[int]
    TAKEN_BY_FIELD_NUMBER: _ClassVar[int]
    JOIN_NODE_FIELD_NUMBER: _ClassVar[int]
    expired_replicas: _containers.RepeatedScalarFieldContainer[str]
    kill_pids: _containers.RepeatedScalarFieldContainer[int]
    heartbeat_s: float
    seq: int
    common_known: bool
    common: _containers.RepeatedCompositeFieldContainer[StepKey]
    take_node: str
    lost_silent_s: float
    job_over: bool
    taken_by: str
    join_node: str
    def __init__(self, expired_replicas: _Optional[_Iterable[str]] = ..., kill_pids: _Optional[_Iterable[int]] = ..., heartbeat_s: _Optional[float] = ..., seq: _Optional[int] = ..., common_known: _Optional[bool] = ..., common: _Optional[_Iterable[_Union[StepKey, _Mapping]]] = ..., take_node: _Optional[str] = ..., lost_silent_s: _Optional[float] = ..., job_over: _Optional[bool] = ..., taken_by: _Optional[str] = ..., join_node: _Optional[str] = ...) -> None: ...

class HoldersRequest(_message.Message):
    __slots__ = ("job", "node", "hop", "failure_domain", "named")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    HOP_FIELD_NUMBER: _ClassVar[int]
    FAILURE_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    NAMED_FIELD_NUMBER: _ClassVar[int]
    job: str
    node: str
    hop: int
    failure_domain: str
    named: str
    def __init__(self, job: _Optional[str] = ..., node: _Optional[str] = ..., hop: _Optional[int] = ..., failure_domain: _Optional[str] = ..., named: _Optional[str] = ...) -> None: ...

class PeerHolder(_message.Message):
    __slots__ = ("node", "address")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node: str
    address: str
    def __init__(self, node: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class HoldersReply(_message.Message):
    __slots__ = ("assigned", "read_from", "reported", "lost")
    ASSIGNED_FIELD_NUMBER: _ClassVar[int]
    READ_FROM_FIELD_NUMBER: _ClassVar[int]
    REPORTED_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    assigned: PeerHolder
    read_from: PeerHolder
    reported: bool
    lost: bool
    def __init__(self, assigned: _Optional[_Union[PeerHolder, _Mapping]] = ..., read_from: _Optional[_Union[PeerHolder, _Mapping]] = ..., reported: _Optional[bool] = ..., lost: _Optional[bool] = ...) -> None: ...

class JobStatusRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node", "agent_id", "last_seen_s", "lost", "workers", "peer_address", "failure_domain", "replicas", "spare", "taking")
    NODE_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_S_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SPARE_FIELD_NUMBER: _ClassVar[int]
    TAKING_FIELD_NUMBER: _ClassVar[int]
    node: str
    agent_id: str
    last_seen_s: float
    lost: bool
    workers: _containers.RepeatedCompositeFieldContainer[Worker]
    peer_address: str
    failure_domain: str
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    spare: bool
    taking: str
    def __init__(self, node: _Optional[str] = ..., agent_id: _Optional[str] = ..., last_seen_s: _Optional[float] = ..., lost: _Optional[bool] = ..., workers: _Optional[_Iterable[_Union[Worker, _Mapping]]] = ..., peer_address: _Optional[str] = ..., failure_domain: _Optional[str] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ..., spare: _Optional[bool] = ..., taking: _Optional[str] = ...) -> None: ...

class GlobalCommit(_message.Message):
    __slots__ = ("url", "step", "generation")
    URL_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    url: str
    step: int
    generation: int
    def __init__(self, url: _Optional[str] = ..., step: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class Detection(_message.Message):
    __slots__ = ("kind", "node", "rank", "age_s", "action", "spare")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    SPARE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    node: str
    rank: int
    age_s: float
    action: str
    spare: str
    def __init__(self, kind: _Optional[str] = ..., node: _Optional[str] = ..., rank: _Optional[int] = ..., age_s: _Optional[float] = ..., action: _Optional[str] = ..., spare: _Optional[str] = ...) -> None: ...

class JobStatusReply(_message.Message):
    __slots__ = ("policy", "nodes", "commits", "detections")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    COMMITS_FIELD_NUMBER: _ClassVar[int]
    DETECTIONS_FIELD_NUMBER: _ClassVar[int]
    policy: str
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStatus]
    commits: _containers.RepeatedCompositeFieldContainer[GlobalCommit]
    detections: _containers.RepeatedCompositeFieldContainer[Detection]
    def __init__(self, policy: _Optional[str] = ..., nodes: _Optional[_Iterable[_Union[NodeStatus, _Mapping]]] = ..., commits: _Optional[_Iterable[_Union[GlobalCommit, _Mapping]]] = ..., detections: _Optional[_Iterable[_Union[Detection, _Mapping]]] = ...) -> None: ...
