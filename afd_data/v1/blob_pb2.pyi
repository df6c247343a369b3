from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ATTENTION: _ClassVar[Role]
    FFN: _ClassVar[Role]
ROLE_UNSPECIFIED: Role
ATTENTION: Role
FFN: Role

class BufferShape(_message.Message):
    __slots__ = ("hidden_size", "dtype", "router_width", "router_dtype", "max_tokens_per_peer", "num_stages", "layers_in_flight", "num_attention", "num_ffn", "attention_tp_size", "ffn_groups", "max_attention", "max_ffn", "num_layers", "gpu_flag_resets")
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ROUTER_WIDTH_FIELD_NUMBER: _ClassVar[int]
    ROUTER_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_PEER_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGES_FIELD_NUMBER: _ClassVar[int]
    LAYERS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    NUM_FFN_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    FFN_GROUPS_FIELD_NUMBER: _ClassVar[int]
    MAX_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    MAX_FFN_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    GPU_FLAG_RESETS_FIELD_NUMBER: _ClassVar[int]
    hidden_size: int
    dtype: str
    router_width: int
    router_dtype: str
    max_tokens_per_peer: int
    num_stages: int
    layers_in_flight: int
    num_attention: int
    num_ffn: int
    attention_tp_size: int
    ffn_groups: int
    max_attention: int
    max_ffn: int
    num_layers: int
    gpu_flag_resets: str
    def __init__(self, hidden_size: _Optional[int] = ..., dtype: _Optional[str] = ..., router_width: _Optional[int] = ..., router_dtype: _Optional[str] = ..., max_tokens_per_peer: _Optional[int] = ..., num_stages: _Optional[int] = ..., layers_in_flight: _Optional[int] = ..., num_attention: _Optional[int] = ..., num_ffn: _Optional[int] = ..., attention_tp_size: _Optional[int] = ..., ffn_groups: _Optional[int] = ..., max_attention: _Optional[int] = ..., max_ffn: _Optional[int] = ..., num_layers: _Optional[int] = ..., gpu_flag_resets: _Optional[str] = ...) -> None: ...

class MemoryRegion(_message.Message):
    __slots__ = ("addr", "length", "device_id")
    ADDR_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    addr: int
    length: int
    device_id: int
    def __init__(self, addr: _Optional[int] = ..., length: _Optional[int] = ..., device_id: _Optional[int] = ...) -> None: ...

class DataPlaneBlob(_message.Message):
    __slots__ = ("version", "agent_name", "agent_metadata", "role", "role_rank", "mem_type", "recv_region", "shape", "gpu")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ROLE_RANK_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    RECV_REGION_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    version: int
    agent_name: str
    agent_metadata: bytes
    role: Role
    role_rank: int
    mem_type: str
    recv_region: MemoryRegion
    shape: BufferShape
    gpu: GpuHop
    def __init__(self, version: _Optional[int] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., role: _Optional[_Union[Role, str]] = ..., role_rank: _Optional[int] = ..., mem_type: _Optional[str] = ..., recv_region: _Optional[_Union[MemoryRegion, _Mapping]] = ..., shape: _Optional[_Union[BufferShape, _Mapping]] = ..., gpu: _Optional[_Union[GpuHop, _Mapping]] = ...) -> None: ...

class GpuHop(_message.Message):
    __slots__ = ("host_id", "ipc_handle", "buffer_offset", "flags_offset")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    BUFFER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    FLAGS_OFFSET_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    ipc_handle: bytes
    buffer_offset: int
    flags_offset: int
    def __init__(self, host_id: _Optional[str] = ..., ipc_handle: _Optional[bytes] = ..., buffer_offset: _Optional[int] = ..., flags_offset: _Optional[int] = ...) -> None: ...
