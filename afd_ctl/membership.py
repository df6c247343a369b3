"""Who is registered, their role ranks, the membership epoch and the routing.

Plain Python, no gRPC and no I/O: the daemon's servicer translates protos into calls here, and
unit tests drive it directly. Every join and every loss of a routed worker bumps the epoch.

Issue 37: the routing follows `topology`, which a planned change (`afd-ctl scale`) replaces in
`apply_target`. While a change is in progress, workers of the target that the current topology
does not route register as *pending*: they hold their slot but move no epoch, so the serving
set carries on undisturbed until the whole target is there.
"""

from __future__ import annotations

import time
import unicodedata
from dataclasses import dataclass, field

from afd_ctl import routing
from afd_ctl.direct import socket_problem
from afd_ctl.errors import ControlError, invalid
from afd_ctl.fingerprint import ModelFingerprint
from afd_ctl.logs import UNPRINTABLE
from afd_ctl.routing import Role
from afd_ctl.topology import Topology

ATTENTION = Role.ATTENTION
FFN = Role.FFN
ROLES = (ATTENTION, FFN)
MAX_WORKER_ID_CHARS = 256


def hidden_character(text: str) -> int | None:
    """The index of the first character of `text` that prints as nothing or as something else:
    control characters, format characters (zero-width spaces and joiners, bidirectional marks,
    overrides and isolates), line and paragraph separators, spaces other than U+0020,
    surrogates, private-use and unassigned code points. None when there is none."""
    for i, char in enumerate(text):
        category = unicodedata.category(char)
        if category[0] == "C" or category in ("Zl", "Zp") or (category == "Zs" and char != " "):
            return i
        if UNPRINTABLE.match(char):
            return i
    return None


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker says about itself on registration."""

    worker_id: str
    # A Role (or its name, "FFN"; validation refuses any other string).
    role: Role | str
    dp_rank: int = 0
    dp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    data_plane_blob: bytes = b""
    # The model it serves (None: not checked; vLLM workers always send one).
    model: ModelFingerprint | None = None
    # The most attention / FFN ranks its data plane can follow (0: any; issue 37).
    max_attention: int = 0
    max_ffn: int = 0
    # It holds at a fence, drains when leaving and reconnects to a new epoch (issue 37): its
    # loop calls ControllerClient.hold/drained. afd-ctl scale needs every worker to.
    follows_scale: bool = False
    # Attention ranks that run every step together with this one (its block; 0: all of them).
    lockstep_size: int = 0
    # Where it takes or sends step payloads directly on its host (afd_ctl.direct; "": none).
    step_socket: str = ""

    @property
    def role_rank(self) -> int:
        return self.dp_rank * self.tp_size + self.tp_rank


@dataclass
class Worker:
    spec: WorkerSpec
    peer: str
    registered_at_s: float
    session_id: int
    # Last step id accepted from this worker when it publishes (reset on each registration).
    last_step_id: int | None = None
    lost_reason: str = ""
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def worker_id(self) -> str:
        return self.spec.worker_id

    @property
    def role(self) -> str:
        return self.spec.role

    @property
    def role_rank(self) -> int:
        return self.spec.role_rank

    def describe(self) -> str:
        return f"{self.role.lower()} rank {self.role_rank} ({self.worker_id})"


class Membership:
    """The registered workers of one daemon incarnation."""

    def __init__(
        self,
        expect_attention: int,
        expect_ffn: int,
        max_blob_bytes: int = 1 << 20,
        first_epoch: int | None = None,
        ffn_groups: int | None = None,
    ) -> None:
        # The membership every routing call uses (ffn_groups None: min(M, N); afd_ctl.routing),
        # and the one a planned change moves to (issue 37).
        self.topology = Topology(
            expect_attention,
            expect_ffn,
            routing.group_count(expect_attention, expect_ffn, ffn_groups),
        )
        self.target: Topology | None = None
        self.max_blob_bytes = max_blob_bytes
        # Epochs start at the wall clock in ms so a restarted daemon never reuses an epoch.
        self.epoch = int(time.time() * 1000) if first_epoch is None else first_epoch
        self._by_slot: dict[tuple[str, int], Worker] = {}
        self._next_session_id = 1
        self.joins = 0
        self.losses = 0

    # -- queries -------------------------------------------------------------------------
    @property
    def expected(self) -> dict[str, int]:
        return {role: self.topology.count(role) for role in ROLES}

    @property
    def ffn_groups(self) -> int:
        return self.topology.groups

    @property
    def workers(self) -> list[Worker]:
        return sorted(self._by_slot.values(), key=lambda w: (w.role != ATTENTION, w.role_rank))

    def count(self, role: str) -> int:
        """Registered workers of `role` that the current topology routes."""
        limit = self.topology.count(role)
        return sum(1 for (r, rank) in self._by_slot if r == role and rank < limit)

    def routed(self, worker: Worker) -> bool:
        """The current topology has a place for `worker` (else it is pending or leaving)."""
        return worker.role_rank < self.topology.count(worker.role)

    def leaving(self, worker: Worker) -> bool:
        """A change is in progress and its target has no place for `worker`."""
        return self.target is not None and worker.role_rank >= self.target.count(worker.role)

    @property
    def complete(self) -> bool:
        return all(self.count(role) == self.expected[role] for role in ROLES)

    def missing(self, topology: Topology) -> list[tuple[str, int]]:
        """(role, rank) slots of `topology` that no worker holds."""
        return [
            (role, rank)
            for role in ROLES
            for rank in range(topology.count(role))
            if (role, rank) not in self._by_slot
        ]

    def get(self, role: str, role_rank: int) -> Worker | None:
        return self._by_slot.get((role, role_rank))

    def find(self, worker_id: str) -> Worker | None:
        return next((w for w in self._by_slot.values() if w.worker_id == worker_id), None)

    @property
    def attention_dp_size(self) -> int:
        return self.expected[ATTENTION] // self._tp_size(ATTENTION)

    def _tp_size(self, role: str) -> int:
        for (r, _), worker in self._by_slot.items():
            if r == role:
                return worker.spec.tp_size
        return 1

    def routes(self) -> list[tuple[int, list[int]]]:
        m, n = self.expected[ATTENTION], self.expected[FFN]
        return [(a, routing.ffn_ranks_for(a, m, n, groups=self.ffn_groups)) for a in range(m)]

    def sender_ranks(self) -> list[int]:
        return routing.sender_ranks(
            self.expected[ATTENTION], self.expected[FFN], groups=self.ffn_groups
        )

    def is_sender(self, worker: Worker) -> bool:
        return worker.role == ATTENTION and worker.role_rank in self.sender_ranks()

    def peers_of(self, worker: Worker) -> list[Worker]:
        """Registered workers this one exchanges hidden states with, in role-rank order (none
        for a worker the topology does not route yet)."""
        if not self.routed(worker):
            return []
        m, n = self.expected[ATTENTION], self.expected[FFN]
        if worker.role == ATTENTION:
            ranks = routing.ffn_ranks_for(worker.role_rank, m, n, groups=self.ffn_groups)
            role = FFN
        else:
            ranks = routing.attention_ranks_for(worker.role_rank, m, n, groups=self.ffn_groups)
            role = ATTENTION
        return [w for r in ranks if (w := self.get(role, r)) is not None]

    def subscribers_of(self, sender: Worker) -> list[Worker]:
        """FFN workers that receive the payloads `sender` publishes."""
        m, n = self.expected[ATTENTION], self.expected[FFN]
        ranks = routing.subscriber_ranks(sender.role_rank, m, n, groups=self.ffn_groups)
        return [w for f in ranks if (w := self.get(FFN, f))]

    # -- changes -------------------------------------------------------------------------
    def validate(self, spec: WorkerSpec) -> None:
        """Raises ControlError naming the field when `spec` cannot join as given."""
        if spec.role not in ROLES:
            raise invalid(f"role must be ATTENTION or FFN, got {spec.role}")
        if not spec.worker_id:
            raise invalid("worker_id is empty: give every worker a stable identity")
        if len(spec.worker_id) > MAX_WORKER_ID_CHARS:
            raise invalid(f"worker_id is longer than {MAX_WORKER_ID_CHARS} characters")
        bad = hidden_character(spec.worker_id)
        if bad is not None:
            raise invalid(
                f"worker_id has a control or invisible character (U+{ord(spec.worker_id[bad]):04X} "
                f"at index {bad}): use printable characters only, so one id cannot pass for another"
            )
        if (problem := socket_problem(spec.step_socket)) is not None:
            raise invalid(f"step_socket {spec.step_socket[:120]!r} {problem}")
        if spec.dp_size < 1 or spec.tp_size < 1:
            raise invalid(f"dp_size and tp_size must be >= 1, got {spec.dp_size}, {spec.tp_size}")
        if spec.dp_rank >= spec.dp_size:
            raise invalid(f"dp_rank {spec.dp_rank} must be below dp_size {spec.dp_size}")
        if spec.tp_rank >= spec.tp_size:
            raise invalid(f"tp_rank {spec.tp_rank} must be below tp_size {spec.tp_size}")
        expected = self.expected[spec.role]
        flag = "--expect-attention" if spec.role == ATTENTION else "--expect-ffn"
        # A worker may also register for the target of a change in progress (issue 37).
        target = self.target.count(spec.role) if self.target is not None else expected
        if spec.follows_scale:
            # Its size at start-up says nothing after a planned change (issue 37): a worker that
            # registers again (a rejoin, a restarted daemon) is checked by its rank alone.
            if spec.role_rank >= max(expected, target):
                raise invalid(
                    f"{spec.role.lower()} rank {spec.role_rank} is not below the {expected} "
                    f"{spec.role.lower()} workers the daemon expects ({flag} {expected}, or "
                    "afd-ctl scale to more)"
                )
        elif spec.dp_size * spec.tp_size not in (expected, target):
            also = f", nor the {target} of the scale in progress" if target != expected else ""
            raise invalid(
                f"dp_size*tp_size = {spec.dp_size}*{spec.tp_size} does not match the "
                f"{expected} {spec.role.lower()} workers the daemon expects ({flag} {expected}, "
                f"or afd-ctl scale){also}"
            )
        if spec.role == ATTENTION and spec.lockstep_size:
            joins = self.topology
            if self.target is not None and spec.dp_size * spec.tp_size == self.target.attention:
                joins = self.target
            problem = joins.lockstep_problem(spec.lockstep_size)
            if problem is not None:
                raise ControlError("FAILED_PRECONDITION", f"cannot register: {problem}")
        if len(spec.data_plane_blob) > self.max_blob_bytes:
            raise invalid(
                f"data_plane_blob is {len(spec.data_plane_blob)} bytes; "
                f"the limit is {self.max_blob_bytes} bytes"
            )

    def join(self, spec: WorkerSpec, peer: str) -> Worker:
        self.validate(spec)
        slot = (spec.role, spec.role_rank)
        holder = self._by_slot.get(slot)
        if holder is not None:
            raise ControlError(
                "ALREADY_EXISTS",
                f"(role, dp_rank, tp_rank) = ({spec.role}, {spec.dp_rank}, {spec.tp_rank}) is "
                f"held by worker_id {holder.worker_id!r} from {holder.peer}; if that worker is "
                "gone, retry after the liveness timeout",
            )
        self._check_model(spec)
        other = self.find(spec.worker_id)
        if other is not None:
            raise ControlError(
                "ALREADY_EXISTS",
                f"worker_id {spec.worker_id!r} is already registered as {other.describe()} "
                f"from {other.peer}; worker identities must be unique",
            )
        worker = Worker(
            spec=spec,
            peer=peer,
            registered_at_s=time.time(),
            session_id=self._next_session_id,
        )
        self._next_session_id += 1
        self._by_slot[slot] = worker
        if self.routed(worker):  # a pending worker of a change moves no epoch
            self.epoch += 1
        self.joins += 1
        return worker

    def _check_model(self, spec: WorkerSpec) -> None:
        """Every registered worker that says what model it serves serves the same one."""
        if spec.model is None:
            return
        for worker in self._by_slot.values():
            theirs = worker.spec.model
            if theirs is None:
                continue
            differences = spec.model.differences(theirs)
            if differences:
                raise ControlError(
                    "FAILED_PRECONDITION",
                    f"model mismatch: {spec.role.lower()} worker {spec.worker_id!r} serves "
                    f"another model than {worker.describe()}: {'; '.join(differences)} "
                    "(this worker vs the registered one); start both roles from the same "
                    "checkpoint files (config.json included) and --dtype",
                )
            return

    def leave(self, worker: Worker, reason: str) -> bool:
        """Removes `worker` if it still holds its slot; returns whether anything changed."""
        slot = (worker.role, worker.role_rank)
        if self._by_slot.get(slot) is not worker:
            return False
        del self._by_slot[slot]
        worker.lost_reason = reason
        if self.routed(worker):  # a pending worker's loss changes no serving set
            self.epoch += 1
            self.losses += 1
        return True

    # -- planned changes (issue 37; the steps are the controller's, afd_ctl/scaling.py) ----
    def retire(self, worker: Worker) -> None:
        """Takes a leaving worker out with no loss counted; the epoch moves in apply_target."""
        slot = (worker.role, worker.role_rank)
        if self._by_slot.get(slot) is worker:
            del self._by_slot[slot]
            worker.lost_reason = "retired by a planned change"

    def apply_target(self) -> Topology:
        """Routes with the target from now on, in a new epoch; returns the old topology."""
        assert self.target is not None
        old, self.topology, self.target = self.topology, self.target, None
        self.epoch += 1
        return old
