"""Names shared by both ends of the wire: role enums and call-metadata keys."""

from __future__ import annotations

from afd_ctl.routing import Role
from afd_ctl.v1 import afd_pb2

# The wire edge: afd.v1.Role numbers <-> Role.
ROLE_TO_PROTO = {Role.ATTENTION: afd_pb2.ATTENTION, Role.FFN: afd_pb2.FFN}
PROTO_TO_ROLE = {v: k for k, v in ROLE_TO_PROTO.items()}
# Names the registered attention worker on a Publish stream.
WORKER_ID_METADATA = "afd-worker-id"
# Proves the Publish stream comes from the client that registered that worker
# (Registered.publish_secret).
PUBLISH_SECRET_METADATA = "afd-publish-secret"
