"""A membership's shape: how many attention and FFN workers, and how the FFN ones are grouped.

The daemon serves one `Topology` at a time (each epoch has one) and, while a planned change is
in progress (`afd-ctl scale`, issue 37), holds a second one as its target. `Topology.of` checks
a target against the routing rules (afd_ctl.routing) and says, in one line, which rule a bad
one breaks. Plain Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from afd_ctl.routing import Role, group_count, lockstep_conflict
from afd_ctl.v1 import afd_pb2

# Far above any deployment; a typo (--ffn 10000) is refused rather than waited for.
MAX_WORKERS_PER_ROLE = 4096


@dataclass(frozen=True)
class Topology:
    """M attention and N FFN workers in g FFN groups (each of N / g workers, splitting the
    experts; attention rank a feeds group a % g)."""

    attention: int
    ffn: int
    groups: int

    @classmethod
    def of(cls, attention: int, ffn: int, expert_parallel_size: int = 0) -> Topology:
        """The topology of M:N with FFN groups of E workers (0: the default, min(M, N)
        groups). ValueError in one line that names the rule a bad target breaks."""
        m, n, e = attention, ffn, expert_parallel_size
        for name, value in (("attention", m), ("ffn", n), ("expert-parallel size", e)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a whole number, got {value!r}")
        if m < 1 or n < 1:
            raise ValueError(
                f"{m}:{n} leaves a role without workers (rule: at least one attention and one "
                "FFN worker); `afd-ctl stop` shuts a deployment down"
            )
        if max(m, n) > MAX_WORKERS_PER_ROLE:
            raise ValueError(
                f"{m}:{n} asks for more than {MAX_WORKERS_PER_ROLE} workers of a role (rule: "
                f"at most {MAX_WORKERS_PER_ROLE} per role)"
            )
        if not e:
            return cls(m, n, group_count(m, n))
        if e > n or n % e:
            raise ValueError(
                f"expert-parallel size {e} does not divide the {n} FFN workers (rule: E divides "
                f"N, every FFN group has E workers); use a divisor of {n}"
            )
        if n // e > m:
            low = next(d for d in range(-(-n // m), n + 1) if n % d == 0)
            raise ValueError(
                f"{n} FFN workers in groups of {e} make {n // e} groups for {m} attention "
                f"worker(s) (rule: FFN groups N / E must not exceed the attention workers M); "
                f"use an expert-parallel size of at least {low}, or more attention workers"
            )
        return cls(m, n, n // e)

    @classmethod
    def from_proto(cls, message: afd_pb2.Topology) -> Topology:
        return cls(message.attention, message.ffn, message.ffn_groups)

    def count(self, role: str) -> int:
        return self.attention if role == Role.ATTENTION else self.ffn

    @property
    def expert_parallel_size(self) -> int:
        return self.ffn // self.groups

    @property
    def label(self) -> str:
        """ "2:4 (2 ffn groups of 2)"."""
        plural = "s" if self.groups > 1 else ""
        return (
            f"{self.attention}:{self.ffn} ({self.groups} ffn group{plural} of "
            f"{self.expert_parallel_size})"
        )

    def lockstep_problem(self, lockstep_size: int) -> str | None:
        """Why attention workers that run their steps in blocks of `lockstep_size` ranks
        cannot serve in this topology (two blocks would share an FFN group), or None."""
        conflict = lockstep_conflict(self.attention, self.groups, lockstep_size)
        if conflict is None:
            return None
        a, b = conflict
        alone = "each steps on its own"
        if lockstep_size > 1:
            alone = f"they are in different blocks of {lockstep_size} data-parallel ranks"
        return (
            f"{self.label} makes attention ranks {a} and {b} share an FFN group, but {alone} "
            "(rule: attention ranks that share an FFN group run every step together, as the "
            "data-parallel ranks of one vLLM server do; one `vllm serve --afd-role attention` "
            "of DP size 1 needs an FFN group of its own): use at least as many FFN groups as "
            f"attention servers, e.g. --ffn {self.attention * self.expert_parallel_size} with "
            f"--expert-parallel-size {self.expert_parallel_size}"
        )

    def to_proto(self) -> afd_pb2.Topology:
        return afd_pb2.Topology(attention=self.attention, ffn=self.ffn, ffn_groups=self.groups)
