"""The notification that rides on every WRITE: what landed, for which step, from whom.

A fixed 34-byte little-endian struct, cheap to build per transfer and to match on arrival:
magic ``AFD1``, kind, stage, source role rank, layer, rows, epoch, step.
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

from afd_data.errors import AfdProtocolError

MAGIC = b"AFD1"
_WIRE = struct.Struct("<4sBBIIIQQ")


class Kind(enum.IntEnum):
    HIDDEN = 1  # attention -> FFN hidden states (and router columns)
    OUTPUT = 2  # FFN -> attention output
    PROBE = 3  # liveness probe while waiting; carries no data and is ignored on arrival


class Notice(NamedTuple):
    kind: Kind
    epoch: int
    step: int
    layer: int
    stage: int
    src_rank: int
    rows: int

    def describe(self) -> str:
        return (
            f"{self.kind.name.lower()} notification epoch {self.epoch} step {self.step} "
            f"layer {self.layer} stage {self.stage} from rank {self.src_rank} ({self.rows} rows)"
        )


def pack(kind: Kind, epoch: int, step: int, layer: int, stage: int, src: int, rows: int) -> bytes:
    return _WIRE.pack(MAGIC, kind, stage, src, layer, rows, epoch, step)


def unpack(msg: bytes, sender: str) -> Notice:
    """Parses one notification; AfdProtocolError if it is not ours."""
    if len(msg) != _WIRE.size or not msg.startswith(MAGIC):
        raise AfdProtocolError(
            f"agent {sender!r} sent a notification that is not an afd data-plane message "
            f"({len(msg)} bytes, starts {bytes(msg[:8])!r}); is another NIXL user sharing the "
            "agent, or is the peer running another afd_data version?"
        )
    _, kind, stage, src, layer, rows, epoch, step = _WIRE.unpack(msg)
    try:
        kind = Kind(kind)
    except ValueError:
        raise AfdProtocolError(f"agent {sender!r} sent unknown notification kind {kind}") from None
    return Notice(kind, epoch, step, layer, stage, src, rows)
