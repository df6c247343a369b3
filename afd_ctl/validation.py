"""Checks one AFDControlPayload against the membership before it is relayed.

Every refusal is a ControlError whose message names the field and says what was expected, so
the sender can fix it; nothing is relayed and no state changes when a check fails.
"""

from __future__ import annotations

from afd_ctl.errors import ControlError, invalid
from afd_ctl.membership import Worker
from afd_ctl.report_checks import MAX_STEP_ID
from afd_ctl.v1 import afd_pb2

MAX_STAGES = 2


def invalid_stages(message: str) -> ControlError:
    return invalid(message, "INVALID_STAGES")


def validate_payload(
    payload: afd_pb2.AFDControlPayload,
    *,
    sender: Worker,
    is_sender: bool,
    epoch: int,
    attention_dp_size: int,
) -> None:
    if not is_sender:
        raise ControlError(
            "PERMISSION_DENIED",
            f"{sender.describe()} is not a designated sender; only attention role ranks below "
            "the number of FFN groups (afd-ctl status) publish payloads",
            "NOT_A_SENDER",
        )
    if payload.sender_role_rank != sender.role_rank:
        raise ControlError(
            "PERMISSION_DENIED",
            f"sender_role_rank {payload.sender_role_rank} does not match the publishing "
            f"worker's role rank {sender.role_rank}",
            "WRONG_SENDER_RANK",
        )
    if payload.epoch != epoch:
        raise ControlError(
            "FAILED_PRECONDITION",
            f"epoch {payload.epoch} is stale; the current membership epoch is {epoch} "
            "(a worker joined or was lost): refresh the view and resend",
            "STALE_EPOCH",
        )
    if sender.last_step_id is not None and payload.step_id <= sender.last_step_id:
        raise invalid(
            f"step_id {payload.step_id} does not increase; the last accepted step_id from "
            f"attention rank {sender.role_rank} is {sender.last_step_id}",
            "STEP_NOT_INCREASING",
        )
    if payload.step_id > MAX_STEP_ID:
        raise invalid(
            f"step_id {payload.step_id} is above 2^62; step ids count steps from 1 (restart "
            "the attention worker to start again)",
            "STEP_ID_OUT_OF_RANGE",
        )
    _validate_flags(payload)
    stages = payload.stages
    if len(stages) > MAX_STAGES:
        raise invalid_stages(
            f"stages has {len(stages)} entries {sorted(stages)}; at most {MAX_STAGES} "
            "(stage 0, and stage 1 under dual-batch overlap)"
        )
    if not stages and not payload.stop:
        raise invalid_stages(
            "stages is empty; every step needs stage 0 (only a stop payload may omit it)"
        )
    for index in stages:
        if index >= MAX_STAGES:
            raise invalid_stages(f"stages key {index} is out of range; stage keys are 0 and 1")
    if stages and 0 not in stages:
        raise invalid_stages(f"stages keys {sorted(stages)} skip stage 0")
    for index in sorted(stages):
        _validate_stage(index, stages[index], attention_dp_size)


def _validate_flags(payload: afd_pb2.AFDControlPayload) -> None:
    """Flags that cannot hold together: the FFN side would not know what to do."""
    if payload.records_only and not payload.is_graph_capturing:
        raise invalid(
            "records_only is set without is_graph_capturing; it marks a FULL-graph capture "
            "step (set both, or neither)",
            "INVALID_FLAGS",
        )
    if payload.is_graph_capturing and payload.is_graph_replaying:
        raise invalid(
            "is_graph_capturing and is_graph_replaying are both set; a step captures a CUDA "
            "graph or replays one, not both",
            "INVALID_FLAGS",
        )
    if payload.records_only and payload.is_profile:
        raise invalid(
            "records_only is set with is_profile; a profile run captures no graph (records_only "
            "marks a FULL-graph capture step)",
            "INVALID_FLAGS",
        )


def _validate_stage(index: int, meta: afd_pb2.DPMetadata, dp_size: int) -> None:
    counts = meta.num_tokens_across_dp
    name = f"stages[{index}]"
    if len(counts) != dp_size:
        raise invalid_stages(
            f"{name}.num_tokens_across_dp has {len(counts)} entries; the attention DP size "
            f"registered is {dp_size}"
        )
    for rank, count in enumerate(counts):
        if count < 0:
            raise invalid_stages(
                f"{name}.num_tokens_across_dp[{rank}] is {count}; counts must be >= 0"
            )
    expected_max = max(counts) if counts else 0
    if meta.max_tokens_across_dp != expected_max:
        raise invalid_stages(
            f"{name}.max_tokens_across_dp is {meta.max_tokens_across_dp}; "
            f"max(num_tokens_across_dp) is {expected_max}"
        )
