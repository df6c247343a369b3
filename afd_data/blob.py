"""The data-plane rendezvous blob: protobuf ``afd.data.v1.DataPlaneBlob``, never pickle.

The control plane carries it opaquely (``RegisterRequest.data_plane_blob``, at most 1 MiB) and
hands it to the worker's peers, which decode it here before connecting.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from google.protobuf.message import DecodeError

from afd_ctl.routing import Role
from afd_data.errors import AfdBadInput
from afd_data.gpu_protocol import GpuEndpoint
from afd_data.v1 import blob_pb2

# 2: stage-major slots (layout.py); a version-1 worker lays its slots out differently.
BLOB_VERSION = 2
MAX_BLOB_BYTES = 1 << 20  # the control plane refuses larger ones


@dataclasses.dataclass(frozen=True)
class PeerBlob:
    """What a peer needs to WRITE into a worker: its NIXL agent and its receive region."""

    agent_name: str
    agent_metadata: bytes
    role: Role
    role_rank: int
    mem_type: str
    recv_addr: int
    recv_bytes: int
    device_id: int
    # TransportConfig.shape_fields() of the worker.
    shape: dict[str, Any]
    # How a peer on the same host maps this worker's buffer (None: NIXL only).
    gpu: GpuEndpoint | None = None


def encode_blob(blob: PeerBlob) -> bytes:
    msg = blob_pb2.DataPlaneBlob(
        version=BLOB_VERSION,
        agent_name=blob.agent_name,
        agent_metadata=blob.agent_metadata,
        role=blob_pb2.Role.Name(Role.parse(blob.role).proto),
        role_rank=blob.role_rank,
        mem_type=blob.mem_type,
        recv_region=blob_pb2.MemoryRegion(
            addr=blob.recv_addr, length=blob.recv_bytes, device_id=blob.device_id
        ),
        shape=blob_pb2.BufferShape(**blob.shape),
    )
    if blob.gpu is not None:
        msg.gpu.CopyFrom(
            blob_pb2.GpuHop(
                host_id=blob.gpu.host_id,
                ipc_handle=blob.gpu.ipc_handle,
                buffer_offset=blob.gpu.buffer_offset,
                flags_offset=blob.gpu.flags_offset,
            )
        )
    data = msg.SerializeToString()
    if len(data) > MAX_BLOB_BYTES:
        raise AfdBadInput(
            f"data-plane blob is {len(data)} bytes, over the control plane's {MAX_BLOB_BYTES}"
        )
    return data


def decode_blob(data: bytes, what: str = "peer blob") -> PeerBlob:
    """Parses and checks a blob; AfdBadInput names what is wrong with it."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise AfdBadInput(f"{what}: expected bytes, got {type(data).__name__}")
    msg = blob_pb2.DataPlaneBlob()
    try:
        msg.ParseFromString(bytes(data))
    except DecodeError as e:
        raise AfdBadInput(f"{what}: not an afd.data.v1.DataPlaneBlob ({e})") from None
    if msg.version != BLOB_VERSION:
        raise AfdBadInput(
            f"{what}: blob version {msg.version}, this worker reads version {BLOB_VERSION}; "
            "run the same afd_data version on every worker"
        )
    missing = [
        name
        for name, ok in (
            ("agent_name", bool(msg.agent_name)),
            ("agent_metadata", bool(msg.agent_metadata)),
            ("role", msg.role in (Role.ATTENTION.proto, Role.FFN.proto)),
            ("mem_type", msg.mem_type in ("DRAM", "VRAM")),
            ("recv_region", msg.HasField("recv_region") and msg.recv_region.length > 0),
            ("shape", msg.HasField("shape")),
        )
        if not ok
    ]
    if missing:
        raise AfdBadInput(f"{what}: missing or invalid field(s) {', '.join(missing)}")
    shape = {f.name: getattr(msg.shape, f.name) for f in blob_pb2.BufferShape.DESCRIPTOR.fields}
    if not shape["ffn_groups"]:  # a worker older than the field routes with the default
        shape["ffn_groups"] = min(shape["num_attention"], shape["num_ffn"])
    shape["gpu_flag_resets"] = shape["gpu_flag_resets"] or "each"  # as older workers did
    return PeerBlob(
        agent_name=msg.agent_name,
        agent_metadata=msg.agent_metadata,
        role=Role.from_proto(msg.role),
        role_rank=msg.role_rank,
        mem_type=msg.mem_type,
        recv_addr=msg.recv_region.addr,
        recv_bytes=msg.recv_region.length,
        device_id=msg.recv_region.device_id,
        shape=shape,
        gpu=_gpu_endpoint(msg, what),
    )


def _gpu_endpoint(msg: Any, what: str) -> GpuEndpoint | None:
    if not msg.HasField("gpu"):
        return None
    gpu = msg.gpu
    if not gpu.host_id or len(gpu.ipc_handle) != 64:
        raise AfdBadInput(f"{what}: gpu: needs a host_id and a 64-byte ipc_handle")
    return GpuEndpoint(gpu.host_id, bytes(gpu.ipc_handle), gpu.buffer_offset, gpu.flags_offset)


# Shape fields that may differ between peers: each side checks them with its own rule.
PER_WORKER_SHAPE = frozenset({"num_stages"})


# What a user changes when a shape field differs, where the field comes from elsewhere.
SHAPE_SOURCES = {
    "ffn_groups": "the FFN groups of the routing: afd-ctl serve --expert-parallel-size, or "
    "TransportConfig.ffn_groups / AFD_DATA_FFN_GROUPS; every worker must use the same",
    "num_layers": "the model's layers (its config's num_hidden_layers); 0 from a worker older "
    "than this field: run one afd-ctl version on every worker",
    "gpu_flag_resets": "AFD_DATA_GPU_FLAG_RESETS (TransportConfig.gpu_flag_resets), auto by "
    "default; every worker must use the same",
}


def shape_mismatches(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """Fields whose values differ, as "name: mine X, peer Y" (and where the field is set)."""
    return [
        f"{name}: this worker {mine[name]!r}, peer {theirs.get(name)!r}"
        + (f" ({SHAPE_SOURCES[name]})" if name in SHAPE_SOURCES else "")
        for name in mine
        if name not in PER_WORKER_SHAPE and theirs.get(name) != mine[name]
    ]
