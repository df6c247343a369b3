"""Credit rules: which (layer, stage) a worker may send or take next, as plain functions.

No NIXL, no clock: each rule reads or updates a ``Credits`` value and raises a typed error
naming the call to make instead, so the rules are unit-tested without agents.

Flow control
------------
Receive slots are indexed by ``(layer % layers_in_flight, stage)``. There are no ack messages:
each direction's traffic is the other direction's credit.

* Attention -> FFN: the attention side may have at most ``layers_in_flight`` layers per stage
  whose outputs it has not yet taken with ``recv_outputs``, never two in one slot;
  ``send_hidden`` refuses (AfdBadInput) instead of overwriting. The FFN side sends the output of
  (layer, stage) only after it has read that layer's hidden states, so an arrived output is the
  credit that frees the FFN's receive slot.
* FFN -> attention: the FFN side writes the output of (layer, stage) only after the hidden states
  of that layer arrived, and the attention side sends those only after ``recv_outputs`` of the
  layer that last used the slot: the hidden states are the credit for the attention's receive
  slot. So views returned by ``recv_outputs(layer, stage)`` stay valid until ``send_hidden`` of
  the next layer in that slot, and views from ``recv_hidden`` until ``send_output`` of that
  (layer, stage).
* A send staging slot is rewritten only after the local WRITEs out of it completed (bounded).
* Steps do not overlap: ``begin_step`` needs every layer of the previous step answered.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from afd_data.errors import AfdBadInput, AfdProtocolError
from afd_data.notify import Kind, Notice


@dataclasses.dataclass
class Credits:
    """The step in progress and, per stage: the slots holding a layer not yet answered, the
    layers taken this step, and the last layer sent (attention)."""

    outstanding: list[dict[int, int]]  # slot -> layer
    done: list[set[int]]
    last_layer: list[int]
    step: int | None = None
    last_step: int | None = None  # step ids strictly increase within an epoch

    @classmethod
    def empty(cls, num_stages: int) -> Credits:
        stages = range(num_stages)
        return cls([{} for _ in stages], [set() for _ in stages], [-1 for _ in stages])


def reset(credits: Credits) -> None:
    """Forgets the step in progress and the step ids seen (a membership change)."""
    credits.step = None
    credits.last_step = None
    for s in range(len(credits.outstanding)):
        credits.outstanding[s].clear()
        credits.done[s].clear()
        credits.last_layer[s] = -1


def check_next_step(credits: Credits, step_id: int, epoch: int | None) -> None:
    if not isinstance(step_id, int) or step_id < 0:
        raise AfdBadInput(f"step_id must be an integer >= 0, got {step_id!r}")
    if credits.last_step is not None and step_id <= credits.last_step:
        raise AfdBadInput(
            f"step_id {step_id} does not increase (last step {credits.last_step} in epoch "
            f"{epoch}); step ids must strictly increase within an epoch"
        )


def begin_step(credits: Credits, step_id: int) -> None:
    """A new step: layers count from the start again (nothing is outstanding by now)."""
    credits.step = step_id
    credits.last_step = step_id
    for s in range(len(credits.done)):
        credits.last_layer[s] = -1
        credits.done[s].clear()


def check_step_finished(credits: Credits, what: str, answer: str) -> None:
    """Refuses ``what`` while a layer of the step is unanswered; ``answer`` names the call that
    answers one (recv_outputs on the attention side, send_output on the FFN side)."""
    for s, held in enumerate(credits.outstanding):
        if held:
            layer = min(held.values())
            action = answer + f"(layer={layer}, stage={s})"
            raise AfdBadInput(
                f"{what} while step {credits.step} still has layer {layer} stage {s} "
                f"unanswered; call {action} first"
            )


# ---------------------------------------------------------------------------- attention side


def check_send_hidden(
    credits: Credits, slot: int, layer: int, stage: int, layers_in_flight: int
) -> None:
    """Layers increase within a stage, and the FFN's receive slot must have been answered."""
    if layer <= credits.last_layer[stage]:
        raise AfdBadInput(
            f"send_hidden(layer={layer}, stage={stage}) after layer "
            f"{credits.last_layer[stage]} in step {credits.step}: layers must increase"
        )
    outstanding = credits.outstanding[stage]
    if slot in outstanding:
        raise AfdBadInput(
            f"send_hidden(layer={layer}, stage={stage}) would overwrite the FFN's receive "
            f"slot still holding layer {outstanding[slot]}: call recv_outputs(layer="
            f"{outstanding[slot]}, stage={stage}) first, or raise layers_in_flight "
            f"(now {layers_in_flight})"
        )


def hidden_sent(credits: Credits, slot: int, layer: int, stage: int) -> None:
    credits.outstanding[stage][slot] = layer
    credits.last_layer[stage] = layer


def check_recv_outputs(credits: Credits, slot: int, layer: int, stage: int) -> None:
    if credits.outstanding[stage].get(slot) != layer:
        raise AfdBadInput(
            f"recv_outputs(layer={layer}, stage={stage}): no hidden states of that layer "
            f"are awaiting an output in step {credits.step}; call send_hidden first"
        )


def outputs_taken(credits: Credits, slot: int, layer: int, stage: int) -> None:
    del credits.outstanding[stage][slot]
    credits.done[stage].add(layer)


def check_output_notice(credits: Credits, n: Notice, slot: int) -> None:
    """An output must answer a layer this rank sent in the current step (``slot`` is the
    notice's receive slot)."""
    if n.step != credits.step or credits.outstanding[n.stage].get(slot) != n.layer:
        raise AfdProtocolError(
            f"{n.describe()}: unknown step/layer, this rank is at step {credits.step} and awaits "
            f"layers {sorted(credits.outstanding[n.stage].values())} of stage {n.stage}; "
            "dropped (is the FFN side running another step?)"
        )


# ---------------------------------------------------------------------------- FFN side


def check_recv_hidden(credits: Credits, slot: int, layer: int, stage: int) -> None:
    held = credits.outstanding[stage].get(slot)
    if held is not None:
        raise AfdBadInput(
            f"recv_hidden(layer={layer}, stage={stage}): receive slot still holds layer "
            f"{held}; call send_output(layer={held}, stage={stage}) first"
        )
    if layer in credits.done[stage]:
        raise AfdBadInput(f"recv_hidden(layer={layer}, stage={stage}) twice in step {credits.step}")


def hidden_taken(credits: Credits, slot: int, layer: int, stage: int) -> None:
    credits.outstanding[stage][slot] = layer
    credits.done[stage].add(layer)


def check_send_output(credits: Credits, slot: int, layer: int, stage: int) -> None:
    if credits.outstanding[stage].get(slot) != layer:
        raise AfdBadInput(
            f"send_output(layer={layer}, stage={stage}): hidden states of that layer were "
            f"not received in step {credits.step}; call recv_hidden first"
        )


def output_sent(credits: Credits, slot: int, stage: int) -> None:
    del credits.outstanding[stage][slot]


def check_hidden_notice(credits: Credits, n: Notice) -> None:
    """Hidden states of an older step, or of a layer already taken, are refused; a newer step's
    may arrive before its begin_step and are kept."""
    step = credits.step
    if step is not None and (
        n.step < step or (n.step == step and n.layer in credits.done[n.stage])
    ):
        raise AfdProtocolError(
            f"{n.describe()}: unknown step, this rank is at step {step}"
            + (f" and already took layer {n.layer}" if n.step == step else "")
            + "; dropped (is the attention side replaying an old step?)"
        )


# ---------------------------------------------------------------------------- either side


def check_arrival(credits: Credits, slot_of: Callable[[int, int], int], n: Notice) -> None:
    """The inbox's credit check of an arriving notification of the kind this role receives
    (``slot_of(layer, stage)`` is the receive slot): outputs on the attention side, hidden
    states on the FFN side."""
    if n.kind is Kind.OUTPUT:
        check_output_notice(credits, n, slot_of(n.layer, n.stage))
    else:
        check_hidden_notice(credits, n)
