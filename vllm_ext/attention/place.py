"""Where one attention server's ranks sit among the attention ranks afd-ctl routes.

Two kinds of deployment, told apart by the server's data-parallel size:

- One server of data-parallel size D (`vllm serve --data-parallel-size D`) holds every
  attention rank, 0..D-1 (its DP rank each). Its ranks run every step together (vLLM's dummy
  batches keep an idle one stepping), so they may share an FFN group.
- Several servers of DP size 1 (issue 37: attention instances, each with its own API behind a
  load balancer, joining and leaving with `afd-ctl scale`): each is one attention rank, its
  `afd attention_rank`, and steps on its own. afd-ctl gives each its own FFN group (the
  registration's lockstep size 1 says why: afd_ctl.routing.lockstep_conflict), and a step's
  token counts name this rank's rows only; the FFN groups of the other ranks never read them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AttentionPlace:
    """This server's first attention rank, its DP size, and the attention ranks afd-ctl routes
    now (a planned change updates it at each reconnect)."""

    first_rank: int
    dp_size: int
    num_attention: int

    @classmethod
    def of(
        cls, attention_rank: int, dp_size: int, tp_size: int, num_attention: int
    ) -> AttentionPlace:
        """ValueError naming the setting when this server cannot take part in an M-rank
        deployment as configured."""
        if dp_size > 1:
            if attention_rank:
                raise ValueError(
                    f"afd attention_rank {attention_rank} is for servers of data parallel size 1 "
                    f"(each its own attention rank); this one has {dp_size}, whose DP ranks are "
                    "attention ranks 0.."
                    f"{dp_size - 1}: leave attention_rank unset"
                )
            if num_attention != dp_size:
                raise ValueError(
                    f"afd-ctl expects {num_attention} attention ranks but this server has data "
                    f"parallel size {dp_size} (one attention rank per data-parallel rank: TP "
                    f"rank 0 of each TP group of {tp_size} exchanges for it); start afd-ctl "
                    f"with --expect-attention {dp_size}"
                )
        elif attention_rank >= num_attention:
            raise ValueError(
                f"afd attention_rank {attention_rank} is not below the {num_attention} attention "
                "rank(s) afd-ctl expects (nor those of an `afd-ctl scale` in progress): give each "
                f"attention server its own rank 0..{num_attention - 1}, or scale first (afd-ctl "
                f"scale --attention {attention_rank + 1} ...)"
            )
        return cls(attention_rank, dp_size, num_attention)

    def role_rank(self, dp_rank: int) -> int:
        return self.first_rank + dp_rank

    @property
    def lockstep_size(self) -> int:
        """How many attention ranks step together with each of this server's (afd-ctl's rule)."""
        return self.dp_size

    def registered_size(self) -> int:
        """The registration's dp_size: the attention ranks of the deployment (afd-ctl checks
        it against the membership it expects)."""
        return self.dp_size if self.dp_size > 1 else self.num_attention

    def counts(self, server_counts: list[int]) -> list[int]:
        """One step's token counts per attention rank afd-ctl routes, from this server's (one
        per DP rank): another server's ranks count 0 (no FFN group this one feeds waits for
        them)."""
        if self.dp_size > 1 or self.num_attention == 1:
            return list(server_counts)
        counts = [0] * self.num_attention
        counts[self.first_rank] = server_counts[0]
        return counts


def worker_id_of(base: str, role_rank: int, dp_size: int, tp_rank: int, tp_size: int) -> str:
    """ "attention-dp<rank>" by default (its attention rank); a given id gets -dp<r> / -tp<r>
    when the server has several."""
    worker_id = base or f"attention-dp{role_rank}"
    if base and dp_size > 1:
        worker_id += f"-dp{role_rank}"
    if tp_size > 1:
        worker_id += f"-tp{tp_rank}"
    return worker_id
