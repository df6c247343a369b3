"""Names shared by both ends of the wire: role enums and call-metadata keys."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypeAlias

from afd_ctl.routing import Role
from afd_ctl.v1 import afd_pb2

if TYPE_CHECKING:
    import grpc

# A server-side method handler, whatever its message types (interceptors wrap any).
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"

# The wire edge: afd.v1.Role numbers <-> Role (a Role is its name, so either looks it up).
ROLE_TO_PROTO: dict[str, afd_pb2.Role] = {Role.ATTENTION: afd_pb2.ATTENTION, Role.FFN: afd_pb2.FFN}
PROTO_TO_ROLE: dict[int, Role] = {afd_pb2.ATTENTION: Role.ATTENTION, afd_pb2.FFN: Role.FFN}
# Names the registered attention worker on a Publish stream.
WORKER_ID_METADATA = "afd-worker-id"
# Proves the Publish stream comes from the client that registered that worker
# (Registered.publish_secret).
PUBLISH_SECRET_METADATA = "afd-publish-secret"


def text_metadata(pairs: Iterable[tuple[str, str | bytes]] | None) -> dict[str, str]:
    """The text entries of a call's gRPC metadata (binary ones, keys ending in -bin, are
    bytes; none of ours is)."""
    return {key: value for key, value in pairs or () if isinstance(value, str)}


def enum_name(enum: Any, value: int) -> str:
    """`enum`'s name of `value`, or `UNKNOWN_<value>` for a value a newer daemon added (an older
    CLI shows it instead of failing)."""
    try:
        return str(enum.Name(value))
    except ValueError:
        return f"UNKNOWN_{value}"
