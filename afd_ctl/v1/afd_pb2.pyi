from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ATTENTION: _ClassVar[Role]
    FFN: _ClassVar[Role]

class Health(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HEALTH_UNSPECIFIED: _ClassVar[Health]
    SERVING: _ClassVar[Health]
    NOT_SERVING: _ClassVar[Health]
    DRAINING: _ClassVar[Health]
ROLE_UNSPECIFIED: Role
ATTENTION: Role
FFN: Role
HEALTH_UNSPECIFIED: Health
SERVING: Health
NOT_SERVING: Health
DRAINING: Health

class DirectPayload(_message.Message):
    __slots__ = ("payload", "prev_step_id")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    PREV_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    payload: AFDControlPayload
    prev_step_id: int
    def __init__(self, payload: _Optional[_Union[AFDControlPayload, _Mapping]] = ..., prev_step_id: _Optional[int] = ...) -> None: ...

class DPMetadata(_message.Message):
    __slots__ = ("num_tokens_across_dp", "max_tokens_across_dp")
    NUM_TOKENS_ACROSS_DP_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_ACROSS_DP_FIELD_NUMBER: _ClassVar[int]
    num_tokens_across_dp: _containers.RepeatedScalarFieldContainer[int]
    max_tokens_across_dp: int
    def __init__(self, num_tokens_across_dp: _Optional[_Iterable[int]] = ..., max_tokens_across_dp: _Optional[int] = ...) -> None: ...

class AFDControlPayload(_message.Message):
    __slots__ = ("step_id", "epoch", "sender_role_rank", "stages", "is_warmup", "is_graph_capturing", "is_graph_replaying", "is_profile", "stop", "records_only")
    class StagesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: DPMetadata
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[DPMetadata, _Mapping]] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SENDER_ROLE_RANK_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    IS_WARMUP_FIELD_NUMBER: _ClassVar[int]
    IS_GRAPH_CAPTURING_FIELD_NUMBER: _ClassVar[int]
    IS_GRAPH_REPLAYING_FIELD_NUMBER: _ClassVar[int]
    IS_PROFILE_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    RECORDS_ONLY_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    epoch: int
    sender_role_rank: int
    stages: _containers.MessageMap[int, DPMetadata]
    is_warmup: bool
    is_graph_capturing: bool
    is_graph_replaying: bool
    is_profile: bool
    stop: bool
    records_only: bool
    def __init__(self, step_id: _Optional[int] = ..., epoch: _Optional[int] = ..., sender_role_rank: _Optional[int] = ..., stages: _Optional[_Mapping[int, DPMetadata]] = ..., is_warmup: _Optional[bool] = ..., is_graph_capturing: _Optional[bool] = ..., is_graph_replaying: _Optional[bool] = ..., is_profile: _Optional[bool] = ..., stop: _Optional[bool] = ..., records_only: _Optional[bool] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("role", "dp_rank", "dp_size", "tp_rank", "tp_size", "worker_id", "data_plane_blob", "model", "max_attention", "max_ffn", "follows_scale", "lockstep_size", "step_socket")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_BLOB_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    MAX_FFN_FIELD_NUMBER: _ClassVar[int]
    FOLLOWS_SCALE_FIELD_NUMBER: _ClassVar[int]
    LOCKSTEP_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEP_SOCKET_FIELD_NUMBER: _ClassVar[int]
    role: Role
    dp_rank: int
    dp_size: int
    tp_rank: int
    tp_size: int
    worker_id: str
    data_plane_blob: bytes
    model: ModelFingerprint
    max_attention: int
    max_ffn: int
    follows_scale: bool
    lockstep_size: int
    step_socket: str
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., dp_rank: _Optional[int] = ..., dp_size: _Optional[int] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., worker_id: _Optional[str] = ..., data_plane_blob: _Optional[bytes] = ..., model: _Optional[_Union[ModelFingerprint, _Mapping]] = ..., max_attention: _Optional[int] = ..., max_ffn: _Optional[int] = ..., follows_scale: _Optional[bool] = ..., lockstep_size: _Optional[int] = ..., step_socket: _Optional[str] = ...) -> None: ...

class ModelFingerprint(_message.Message):
    __slots__ = ("architecture", "num_layers", "hidden_size", "num_routed_experts", "num_shared_experts", "dtype", "weights_digest")
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    architecture: str
    num_layers: int
    hidden_size: int
    num_routed_experts: int
    num_shared_experts: int
    dtype: str
    weights_digest: str
    def __init__(self, architecture: _Optional[str] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_routed_experts: _Optional[int] = ..., num_shared_experts: _Optional[int] = ..., dtype: _Optional[str] = ..., weights_digest: _Optional[str] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "role_rank", "dp_rank", "dp_size", "tp_rank", "tp_size", "peer", "registered_at_s", "step_socket")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ROLE_RANK_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_AT_S_FIELD_NUMBER: _ClassVar[int]
    STEP_SOCKET_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: Role
    role_rank: int
    dp_rank: int
    dp_size: int
    tp_rank: int
    tp_size: int
    peer: str
    registered_at_s: float
    step_socket: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., role_rank: _Optional[int] = ..., dp_rank: _Optional[int] = ..., dp_size: _Optional[int] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., peer: _Optional[str] = ..., registered_at_s: _Optional[float] = ..., step_socket: _Optional[str] = ...) -> None: ...

class Peer(_message.Message):
    __slots__ = ("worker", "data_plane_blob")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_BLOB_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerInfo
    data_plane_blob: bytes
    def __init__(self, worker: _Optional[_Union[WorkerInfo, _Mapping]] = ..., data_plane_blob: _Optional[bytes] = ...) -> None: ...

class Route(_message.Message):
    __slots__ = ("attention_rank", "ffn_ranks")
    ATTENTION_RANK_FIELD_NUMBER: _ClassVar[int]
    FFN_RANKS_FIELD_NUMBER: _ClassVar[int]
    attention_rank: int
    ffn_ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, attention_rank: _Optional[int] = ..., ffn_ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class View(_message.Message):
    __slots__ = ("epoch", "controller_incarnation", "expected_attention", "expected_ffn", "complete", "routes", "sender_ranks", "peers", "ffn_groups", "target", "leaving", "hold", "pending")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FFN_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    SENDER_RANKS_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    FFN_GROUPS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    controller_incarnation: str
    expected_attention: int
    expected_ffn: int
    complete: bool
    routes: _containers.RepeatedCompositeFieldContainer[Route]
    sender_ranks: _containers.RepeatedScalarFieldContainer[int]
    peers: _containers.RepeatedCompositeFieldContainer[Peer]
    ffn_groups: int
    target: Topology
    leaving: bool
    hold: bool
    pending: bool
    def __init__(self, epoch: _Optional[int] = ..., controller_incarnation: _Optional[str] = ..., expected_attention: _Optional[int] = ..., expected_ffn: _Optional[int] = ..., complete: _Optional[bool] = ..., routes: _Optional[_Iterable[_Union[Route, _Mapping]]] = ..., sender_ranks: _Optional[_Iterable[int]] = ..., peers: _Optional[_Iterable[_Union[Peer, _Mapping]]] = ..., ffn_groups: _Optional[int] = ..., target: _Optional[_Union[Topology, _Mapping]] = ..., leaving: _Optional[bool] = ..., hold: _Optional[bool] = ..., pending: _Optional[bool] = ...) -> None: ...

class Topology(_message.Message):
    __slots__ = ("attention", "ffn", "ffn_groups")
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    FFN_FIELD_NUMBER: _ClassVar[int]
    FFN_GROUPS_FIELD_NUMBER: _ClassVar[int]
    attention: int
    ffn: int
    ffn_groups: int
    def __init__(self, attention: _Optional[int] = ..., ffn: _Optional[int] = ..., ffn_groups: _Optional[int] = ...) -> None: ...

class Registered(_message.Message):
    __slots__ = ("worker", "view", "is_sender", "publish_secret")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    IS_SENDER_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_SECRET_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerInfo
    view: View
    is_sender: bool
    publish_secret: str
    def __init__(self, worker: _Optional[_Union[WorkerInfo, _Mapping]] = ..., view: _Optional[_Union[View, _Mapping]] = ..., is_sender: _Optional[bool] = ..., publish_secret: _Optional[str] = ...) -> None: ...

class MembershipEvent(_message.Message):
    __slots__ = ("kind", "worker", "reason", "view", "at_s")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[MembershipEvent.Kind]
        PEER_JOINED: _ClassVar[MembershipEvent.Kind]
        PEER_LOST: _ClassVar[MembershipEvent.Kind]
        SET_COMPLETE: _ClassVar[MembershipEvent.Kind]
        STOP: _ClassVar[MembershipEvent.Kind]
        DAEMON_DRAINING: _ClassVar[MembershipEvent.Kind]
        TARGET_SET: _ClassVar[MembershipEvent.Kind]
        FENCE: _ClassVar[MembershipEvent.Kind]
        SCALED: _ClassVar[MembershipEvent.Kind]
        RETIRED: _ClassVar[MembershipEvent.Kind]
        CHANGE_ABORTED: _ClassVar[MembershipEvent.Kind]
    KIND_UNSPECIFIED: MembershipEvent.Kind
    PEER_JOINED: MembershipEvent.Kind
    PEER_LOST: MembershipEvent.Kind
    SET_COMPLETE: MembershipEvent.Kind
    STOP: MembershipEvent.Kind
    DAEMON_DRAINING: MembershipEvent.Kind
    TARGET_SET: MembershipEvent.Kind
    FENCE: MembershipEvent.Kind
    SCALED: MembershipEvent.Kind
    RETIRED: MembershipEvent.Kind
    CHANGE_ABORTED: MembershipEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    AT_S_FIELD_NUMBER: _ClassVar[int]
    kind: MembershipEvent.Kind
    worker: WorkerInfo
    reason: str
    view: View
    at_s: float
    def __init__(self, kind: _Optional[_Union[MembershipEvent.Kind, str]] = ..., worker: _Optional[_Union[WorkerInfo, _Mapping]] = ..., reason: _Optional[str] = ..., view: _Optional[_Union[View, _Mapping]] = ..., at_s: _Optional[float] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("register", "heartbeat", "leave", "timings", "trace", "drained", "fenced")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    FENCED_FIELD_NUMBER: _ClassVar[int]
    register: RegisterRequest
    heartbeat: Heartbeat
    leave: Leave
    timings: StepTimings
    trace: TraceSpans
    drained: Drained
    fenced: Fenced
    def __init__(self, register: _Optional[_Union[RegisterRequest, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., leave: _Optional[_Union[Leave, _Mapping]] = ..., timings: _Optional[_Union[StepTimings, _Mapping]] = ..., trace: _Optional[_Union[TraceSpans, _Mapping]] = ..., drained: _Optional[_Union[Drained, _Mapping]] = ..., fenced: _Optional[_Union[Fenced, _Mapping]] = ...) -> None: ...

class Drained(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class Fenced(_message.Message):
    __slots__ = ("epoch", "last_step_id")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    last_step_id: int
    def __init__(self, epoch: _Optional[int] = ..., last_step_id: _Optional[int] = ...) -> None: ...

class StepTimings(_message.Message):
    __slots__ = ("first_step_id", "last_step_id", "steps", "busy_wall_s", "compute_s", "wait_s", "send_s", "bytes", "tokens", "layers", "step_compute_s", "step_wait_s", "step_tokens", "warmup", "exchange_path")
    FIRST_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    BUSY_WALL_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    SEND_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    STEP_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    STEP_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WARMUP_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_PATH_FIELD_NUMBER: _ClassVar[int]
    first_step_id: int
    last_step_id: int
    steps: int
    busy_wall_s: float
    compute_s: float
    wait_s: float
    send_s: float
    bytes: int
    tokens: int
    layers: int
    step_compute_s: _containers.RepeatedScalarFieldContainer[float]
    step_wait_s: _containers.RepeatedScalarFieldContainer[float]
    step_tokens: _containers.RepeatedScalarFieldContainer[int]
    warmup: bool
    exchange_path: str
    def __init__(self, first_step_id: _Optional[int] = ..., last_step_id: _Optional[int] = ..., steps: _Optional[int] = ..., busy_wall_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., wait_s: _Optional[float] = ..., send_s: _Optional[float] = ..., bytes: _Optional[int] = ..., tokens: _Optional[int] = ..., layers: _Optional[int] = ..., step_compute_s: _Optional[_Iterable[float]] = ..., step_wait_s: _Optional[_Iterable[float]] = ..., step_tokens: _Optional[_Iterable[int]] = ..., warmup: _Optional[bool] = ..., exchange_path: _Optional[str] = ...) -> None: ...

class TraceStart(_message.Message):
    __slots__ = ("trace_id", "first_step_id", "steps", "daemon_sent_s")
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DAEMON_SENT_S_FIELD_NUMBER: _ClassVar[int]
    trace_id: int
    first_step_id: int
    steps: int
    daemon_sent_s: float
    def __init__(self, trace_id: _Optional[int] = ..., first_step_id: _Optional[int] = ..., steps: _Optional[int] = ..., daemon_sent_s: _Optional[float] = ...) -> None: ...

class TraceSpan(_message.Message):
    __slots__ = ("name", "step_id", "start_s", "end_s", "layer")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    START_S_FIELD_NUMBER: _ClassVar[int]
    END_S_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    name: str
    step_id: int
    start_s: float
    end_s: float
    layer: int
    def __init__(self, name: _Optional[str] = ..., step_id: _Optional[int] = ..., start_s: _Optional[float] = ..., end_s: _Optional[float] = ..., layer: _Optional[int] = ...) -> None: ...

class TraceSpans(_message.Message):
    __slots__ = ("trace_id", "worker_received_s", "worker_sent_s", "spans")
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_RECEIVED_S_FIELD_NUMBER: _ClassVar[int]
    WORKER_SENT_S_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    trace_id: int
    worker_received_s: float
    worker_sent_s: float
    spans: _containers.RepeatedCompositeFieldContainer[TraceSpan]
    def __init__(self, trace_id: _Optional[int] = ..., worker_received_s: _Optional[float] = ..., worker_sent_s: _Optional[float] = ..., spans: _Optional[_Iterable[_Union[TraceSpan, _Mapping]]] = ...) -> None: ...

class Leave(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class SessionMessage(_message.Message):
    __slots__ = ("registered", "payload", "event", "heartbeat", "trace_start")
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    TRACE_START_FIELD_NUMBER: _ClassVar[int]
    registered: Registered
    payload: AFDControlPayload
    event: MembershipEvent
    heartbeat: Heartbeat
    trace_start: TraceStart
    def __init__(self, registered: _Optional[_Union[Registered, _Mapping]] = ..., payload: _Optional[_Union[AFDControlPayload, _Mapping]] = ..., event: _Optional[_Union[MembershipEvent, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., trace_start: _Optional[_Union[TraceStart, _Mapping]] = ...) -> None: ...

class PublishRejected(_message.Message):
    __slots__ = ("step_id", "code", "message", "reason")
    class Reason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        REASON_UNSPECIFIED: _ClassVar[PublishRejected.Reason]
        NOT_A_SENDER: _ClassVar[PublishRejected.Reason]
        WRONG_SENDER_RANK: _ClassVar[PublishRejected.Reason]
        STALE_EPOCH: _ClassVar[PublishRejected.Reason]
        STEP_NOT_INCREASING: _ClassVar[PublishRejected.Reason]
        INVALID_STAGES: _ClassVar[PublishRejected.Reason]
        SET_INCOMPLETE: _ClassVar[PublishRejected.Reason]
        SESSION_ENDED: _ClassVar[PublishRejected.Reason]
        INVALID_FLAGS: _ClassVar[PublishRejected.Reason]
        STEP_ID_OUT_OF_RANGE: _ClassVar[PublishRejected.Reason]
    REASON_UNSPECIFIED: PublishRejected.Reason
    NOT_A_SENDER: PublishRejected.Reason
    WRONG_SENDER_RANK: PublishRejected.Reason
    STALE_EPOCH: PublishRejected.Reason
    STEP_NOT_INCREASING: PublishRejected.Reason
    INVALID_STAGES: PublishRejected.Reason
    SET_INCOMPLETE: PublishRejected.Reason
    SESSION_ENDED: PublishRejected.Reason
    INVALID_FLAGS: PublishRejected.Reason
    STEP_ID_OUT_OF_RANGE: PublishRejected.Reason
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    code: int
    message: str
    reason: PublishRejected.Reason
    def __init__(self, step_id: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., reason: _Optional[_Union[PublishRejected.Reason, str]] = ...) -> None: ...

class AFDControlPayloads(_message.Message):
    __slots__ = ("payloads",)
    PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    payloads: _containers.RepeatedCompositeFieldContainer[AFDControlPayload]
    def __init__(self, payloads: _Optional[_Iterable[_Union[AFDControlPayload, _Mapping]]] = ...) -> None: ...

class PublishAck(_message.Message):
    __slots__ = ("rejected",)
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    rejected: PublishRejected
    def __init__(self, rejected: _Optional[_Union[PublishRejected, _Mapping]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RoleCount(_message.Message):
    __slots__ = ("role", "expected", "registered")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    role: Role
    expected: int
    registered: int
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., expected: _Optional[int] = ..., registered: _Optional[int] = ...) -> None: ...

class SubscriberLag(_message.Message):
    __slots__ = ("worker_id", "queued", "last_step_id", "queue_capacity")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    queued: int
    last_step_id: int
    queue_capacity: int
    def __init__(self, worker_id: _Optional[str] = ..., queued: _Optional[int] = ..., last_step_id: _Optional[int] = ..., queue_capacity: _Optional[int] = ...) -> None: ...

class TapLag(_message.Message):
    __slots__ = ("peer", "include_payloads", "queued", "queue_capacity", "delivered", "last_step_id")
    PEER_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    QUEUE_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    peer: str
    include_payloads: bool
    queued: int
    queue_capacity: int
    delivered: int
    last_step_id: int
    def __init__(self, peer: _Optional[str] = ..., include_payloads: _Optional[bool] = ..., queued: _Optional[int] = ..., queue_capacity: _Optional[int] = ..., delivered: _Optional[int] = ..., last_step_id: _Optional[int] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("health", "epoch", "controller_incarnation", "roles", "last_step_id", "steps_relayed", "payloads_rejected", "subscribers", "uptime_s", "listen", "recent_events", "health_state", "taps", "loads", "ffn_groups", "current", "change", "epoch_history", "last_change")
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    STEPS_RELAYED_FIELD_NUMBER: _ClassVar[int]
    PAYLOADS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBERS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    LISTEN_FIELD_NUMBER: _ClassVar[int]
    RECENT_EVENTS_FIELD_NUMBER: _ClassVar[int]
    HEALTH_STATE_FIELD_NUMBER: _ClassVar[int]
    TAPS_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    FFN_GROUPS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    CHANGE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_HISTORY_FIELD_NUMBER: _ClassVar[int]
    LAST_CHANGE_FIELD_NUMBER: _ClassVar[int]
    health: str
    epoch: int
    controller_incarnation: str
    roles: _containers.RepeatedCompositeFieldContainer[RoleCount]
    last_step_id: int
    steps_relayed: int
    payloads_rejected: int
    subscribers: _containers.RepeatedCompositeFieldContainer[SubscriberLag]
    uptime_s: float
    listen: str
    recent_events: _containers.RepeatedCompositeFieldContainer[MembershipEvent]
    health_state: Health
    taps: _containers.RepeatedCompositeFieldContainer[TapLag]
    loads: _containers.RepeatedCompositeFieldContainer[WorkerLoad]
    ffn_groups: int
    current: Topology
    change: ScaleChange
    epoch_history: _containers.RepeatedCompositeFieldContainer[EpochRecord]
    last_change: str
    def __init__(self, health: _Optional[str] = ..., epoch: _Optional[int] = ..., controller_incarnation: _Optional[str] = ..., roles: _Optional[_Iterable[_Union[RoleCount, _Mapping]]] = ..., last_step_id: _Optional[int] = ..., steps_relayed: _Optional[int] = ..., payloads_rejected: _Optional[int] = ..., subscribers: _Optional[_Iterable[_Union[SubscriberLag, _Mapping]]] = ..., uptime_s: _Optional[float] = ..., listen: _Optional[str] = ..., recent_events: _Optional[_Iterable[_Union[MembershipEvent, _Mapping]]] = ..., health_state: _Optional[_Union[Health, str]] = ..., taps: _Optional[_Iterable[_Union[TapLag, _Mapping]]] = ..., loads: _Optional[_Iterable[_Union[WorkerLoad, _Mapping]]] = ..., ffn_groups: _Optional[int] = ..., current: _Optional[_Union[Topology, _Mapping]] = ..., change: _Optional[_Union[ScaleChange, _Mapping]] = ..., epoch_history: _Optional[_Iterable[_Union[EpochRecord, _Mapping]]] = ..., last_change: _Optional[str] = ...) -> None: ...

class ScaleChange(_message.Message):
    __slots__ = ("target", "phase", "started_at_s", "fence_at_s", "waiting_for", "reason")
    class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PHASE_UNSPECIFIED: _ClassVar[ScaleChange.Phase]
        GATHER: _ClassVar[ScaleChange.Phase]
        FENCE: _ClassVar[ScaleChange.Phase]
    PHASE_UNSPECIFIED: ScaleChange.Phase
    GATHER: ScaleChange.Phase
    FENCE: ScaleChange.Phase
    TARGET_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_S_FIELD_NUMBER: _ClassVar[int]
    FENCE_AT_S_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    target: Topology
    phase: ScaleChange.Phase
    started_at_s: float
    fence_at_s: float
    waiting_for: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    def __init__(self, target: _Optional[_Union[Topology, _Mapping]] = ..., phase: _Optional[_Union[ScaleChange.Phase, str]] = ..., started_at_s: _Optional[float] = ..., fence_at_s: _Optional[float] = ..., waiting_for: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ...) -> None: ...

class EpochRecord(_message.Message):
    __slots__ = ("epoch", "at_s", "topology", "reason", "pause_s", "complete")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    AT_S_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PAUSE_S_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    at_s: float
    topology: Topology
    reason: str
    pause_s: float
    complete: bool
    def __init__(self, epoch: _Optional[int] = ..., at_s: _Optional[float] = ..., topology: _Optional[_Union[Topology, _Mapping]] = ..., reason: _Optional[str] = ..., pause_s: _Optional[float] = ..., complete: _Optional[bool] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("worker_id", "role", "role_rank", "steps", "reports", "utilisation", "waiting_share", "compute_ms_per_step", "wait_ms_per_step", "send_ms_per_step", "tokens_per_step", "bytes_per_step", "layers", "reports_dropped", "warmup_steps", "warmup_compute_s", "last_refusal", "exchange_path")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ROLE_RANK_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    UTILISATION_FIELD_NUMBER: _ClassVar[int]
    WAITING_SHARE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    SEND_MS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    REPORTS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    WARMUP_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    LAST_REFUSAL_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_PATH_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: Role
    role_rank: int
    steps: int
    reports: int
    utilisation: float
    waiting_share: float
    compute_ms_per_step: float
    wait_ms_per_step: float
    send_ms_per_step: float
    tokens_per_step: float
    bytes_per_step: float
    layers: int
    reports_dropped: int
    warmup_steps: int
    warmup_compute_s: float
    last_refusal: str
    exchange_path: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., role_rank: _Optional[int] = ..., steps: _Optional[int] = ..., reports: _Optional[int] = ..., utilisation: _Optional[float] = ..., waiting_share: _Optional[float] = ..., compute_ms_per_step: _Optional[float] = ..., wait_ms_per_step: _Optional[float] = ..., send_ms_per_step: _Optional[float] = ..., tokens_per_step: _Optional[float] = ..., bytes_per_step: _Optional[float] = ..., layers: _Optional[int] = ..., reports_dropped: _Optional[int] = ..., warmup_steps: _Optional[int] = ..., warmup_compute_s: _Optional[float] = ..., last_refusal: _Optional[str] = ..., exchange_path: _Optional[str] = ...) -> None: ...

class GetTimingsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerTimings(_message.Message):
    __slots__ = ("load", "window")
    LOAD_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    load: WorkerLoad
    window: _containers.RepeatedCompositeFieldContainer[StepTimings]
    def __init__(self, load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., window: _Optional[_Iterable[_Union[StepTimings, _Mapping]]] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("workers", "window_reports")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_REPORTS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerTimings]
    window_reports: int
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerTimings, _Mapping]]] = ..., window_reports: _Optional[int] = ...) -> None: ...

class TraceRequest(_message.Message):
    __slots__ = ("steps", "timeout_s")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    steps: int
    timeout_s: float
    def __init__(self, steps: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class WorkerTrace(_message.Message):
    __slots__ = ("worker", "spans", "offset_s", "offset_error_s")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_S_FIELD_NUMBER: _ClassVar[int]
    OFFSET_ERROR_S_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerInfo
    spans: _containers.RepeatedCompositeFieldContainer[TraceSpan]
    offset_s: float
    offset_error_s: float
    def __init__(self, worker: _Optional[_Union[WorkerInfo, _Mapping]] = ..., spans: _Optional[_Iterable[_Union[TraceSpan, _Mapping]]] = ..., offset_s: _Optional[float] = ..., offset_error_s: _Optional[float] = ...) -> None: ...

class TraceResult(_message.Message):
    __slots__ = ("first_step_id", "steps", "workers", "missing", "problems")
    FIRST_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    first_step_id: int
    steps: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerTrace]
    missing: _containers.RepeatedScalarFieldContainer[str]
    problems: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, first_step_id: _Optional[int] = ..., steps: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerTrace, _Mapping]]] = ..., missing: _Optional[_Iterable[str]] = ..., problems: _Optional[_Iterable[str]] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: Role
    def __init__(self, role: _Optional[_Union[Role, str]] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...

class TapRequest(_message.Message):
    __slots__ = ("include_payloads",)
    INCLUDE_PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    include_payloads: bool
    def __init__(self, include_payloads: _Optional[bool] = ...) -> None: ...

class TapEvent(_message.Message):
    __slots__ = ("payload", "membership")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_FIELD_NUMBER: _ClassVar[int]
    payload: AFDControlPayload
    membership: MembershipEvent
    def __init__(self, payload: _Optional[_Union[AFDControlPayload, _Mapping]] = ..., membership: _Optional[_Union[MembershipEvent, _Mapping]] = ...) -> None: ...

class StopRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class StopResponse(_message.Message):
    __slots__ = ("ffn_workers_told",)
    FFN_WORKERS_TOLD_FIELD_NUMBER: _ClassVar[int]
    ffn_workers_told: int
    def __init__(self, ffn_workers_told: _Optional[int] = ...) -> None: ...

class ScaleRequest(_message.Message):
    __slots__ = ("attention", "ffn", "expert_parallel_size", "reason")
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    FFN_FIELD_NUMBER: _ClassVar[int]
    EXPERT_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    attention: int
    ffn: int
    expert_parallel_size: int
    reason: str
    def __init__(self, attention: _Optional[int] = ..., ffn: _Optional[int] = ..., expert_parallel_size: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ScaleResponse(_message.Message):
    __slots__ = ("current", "target", "message")
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    current: Topology
    target: Topology
    message: str
    def __init__(self, current: _Optional[_Union[Topology, _Mapping]] = ..., target: _Optional[_Union[Topology, _Mapping]] = ..., message: _Optional[str] = ...) -> None: ...
