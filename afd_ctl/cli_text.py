"""What `afd-ctl status | workers | watch` print: the daemon's protos as text or JSON; and
watch's loop over the Tap stream."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from afd_ctl.v1 import afd_pb2
from afd_ctl.wire import enum_name

# `afd-ctl status` shows this many of the recent membership events and epochs (the JSON has
# all).
RECENT_SHOWN = 8


def topology_label(t: afd_pb2.Topology) -> str:
    """ "2:4 (2 ffn groups of 2)", as afd_ctl.topology.Topology.label says it."""
    groups = t.ffn_groups or 1
    plural = "s" if groups > 1 else ""
    return f"{t.attention}:{t.ffn} ({groups} ffn group{plural} of {t.ffn // groups})"


def format_membership(status: afd_pb2.Status) -> list[str]:
    """Issue 37: the membership now, a change in progress, the last one, the epoch history."""
    if not status.HasField("current"):  # an older daemon
        return []
    lines = ["", f"membership  {topology_label(status.current)}"]
    if status.HasField("change"):
        change = status.change
        phase = enum_name(afd_pb2.ScaleChange.Phase, change.phase).lower()
        lines.append(
            f"target      {topology_label(change.target)}: {phase}, asked "
            f"{time.time() - change.started_at_s:.1f} s ago ({change.reason})"
        )
        lines += [f"  waiting for {what}" for what in change.waiting_for]
    if status.last_change:
        lines.append(f"last change {status.last_change}")
    if status.epoch_history:
        lines += ["", f"{'EPOCH':<16} {'AT':<8} {'MEMBERSHIP':<24} {'HELD MS':>7}  WHY"]
        for record in status.epoch_history[-RECENT_SHOWN:]:
            when = time.strftime("%H:%M:%S", time.localtime(record.at_s))
            held = f"{record.pause_s * 1e3:.0f}" if record.pause_s else "-"
            lines.append(
                f"{record.epoch:<16} {when:<8} {topology_label(record.topology):<24} "
                f"{held:>7}  {record.reason}"
            )
    return lines


def to_json(message: Message, indent: int | None = 2) -> str:
    """Every field, zeros and empty lists included, with 64-bit numbers as JSON numbers."""
    data = json_format.MessageToDict(
        message,
        always_print_fields_with_no_presence=True,
        preserving_proto_field_name=True,
        unquote_int64_if_possible=True,
    )
    return json.dumps(data, indent=indent, sort_keys=True)


def health_of(status: afd_pb2.Status) -> str:
    # health_state is the enum; an older daemon only fills the word.
    return enum_name(afd_pb2.Health, status.health_state) if status.health_state else status.health


def format_status(status: afd_pb2.Status) -> str:
    health = health_of(status)
    lines = [
        f"health      {health}",
        f"epoch       {status.epoch}   (incarnation {status.controller_incarnation})",
        f"listen      {status.listen}   uptime {status.uptime_s:.0f} s",
        f"steps       {status.steps_relayed} relayed, last step id {status.last_step_id}, "
        f"{status.payloads_rejected} rejected",
        "",
        f"{'ROLE':<10} {'REGISTERED':>10} {'EXPECTED':>9}",
    ]
    for role in status.roles:
        lines.append(
            f"{enum_name(afd_pb2.Role, role.role).lower():<10} {role.registered:>10} {role.expected:>9}"
        )
    if status.ffn_groups:  # an older daemon does not say
        expected = {r.role: r.expected for r in status.roles}
        ffn = expected.get(afd_pb2.FFN, 0)
        lines.append(
            f"ffn groups  {status.ffn_groups} (expert-parallel size "
            f"{ffn // status.ffn_groups if ffn % status.ffn_groups == 0 else 'uneven'})"
        )
    lines += format_membership(status)
    if status.subscribers:
        lines += ["", f"{'SUBSCRIBER':<28} {'QUEUED':>7} {'CAPACITY':>9} {'LAST STEP':>10}"]
        for sub in status.subscribers:
            lines.append(
                f"{sub.worker_id:<28} {sub.queued:>7} {sub.queue_capacity:>9} {sub.last_step_id:>10}"
            )
    if status.loads:
        # Serving steps only; warm-up, profile and capture steps counted apart (WARM-UP).
        lines += [
            "",
            f"{'LOAD (ROLLING WINDOW)':<28} {'ROLE':<9} {'PATH':<5} {'STEPS':>6} {'UTIL':>5} "
            f"{'WAIT':>5} {'COMPUTE MS':>10} {'WAIT MS':>8} {'TOKENS':>7} {'WARM-UP':>7}",
        ]
        for load in status.loads:
            lines.append(
                f"{load.worker_id:<28} {enum_name(afd_pb2.Role, load.role).lower():<9} "
                f"{load.exchange_path or '-':<5} "
                f"{load.steps:>6} {load.utilisation:>5.0%} {load.waiting_share:>5.0%} "
                f"{load.compute_ms_per_step:>10.3f} {load.wait_ms_per_step:>8.3f} "
                f"{load.tokens_per_step:>7.1f} {load.warmup_steps:>7}"
            )
        for load in status.loads:
            if load.last_refusal:
                lines.append(
                    f"  {load.worker_id}: {load.reports_dropped} report(s) refused, the last: "
                    f"{load.last_refusal}"
                )
    if status.taps:
        lines += [
            "",
            f"{'TAP (LIVE STREAM)':<28} {'QUEUED':>7} {'CAPACITY':>9} {'SENT':>8} "
            f"{'LAST STEP':>10} {'BEHIND':>7}",
        ]
        for tap in status.taps:
            behind = status.last_step_id - tap.last_step_id if tap.include_payloads else 0
            lines.append(
                f"{tap.peer:<28} {tap.queued:>7} {tap.queue_capacity:>9} {tap.delivered:>8} "
                f"{tap.last_step_id if tap.include_payloads else '-':>10} {behind:>7}"
            )
    if status.recent_events:
        lines += ["", "RECENT EVENTS"]
        for event in status.recent_events[-RECENT_SHOWN:]:
            kind = enum_name(afd_pb2.MembershipEvent.Kind, event.kind)
            who = ""
            if event.HasField("worker"):
                role_name = enum_name(afd_pb2.Role, event.worker.role).lower()
                who = f" {role_name} {event.worker.role_rank} ({event.worker.worker_id})"
            when = time.strftime("%H:%M:%S", time.localtime(event.at_s))
            reason = f": {event.reason}" if event.reason else ""
            lines.append(f"{when} {kind}{who}{reason}")
    return "\n".join(lines)


def format_workers(workers: Sequence[afd_pb2.WorkerInfo]) -> str:
    if not workers:
        return "no workers registered"
    lines = [f"{'ROLE':<10} {'RANK':>4} {'DP':>5} {'TP':>5}  {'WORKER ID':<28} {'PEER':<24} AGE"]
    now = time.time()
    for w in workers:
        dp, tp = f"{w.dp_rank}/{w.dp_size}", f"{w.tp_rank}/{w.tp_size}"
        lines.append(
            f"{enum_name(afd_pb2.Role, w.role).lower():<10} {w.role_rank:>4} {dp:>5} {tp:>5}  "
            f"{w.worker_id:<28} {w.peer:<24} {now - w.registered_at_s:.0f}s"
        )
    return "\n".join(lines)


def format_tap(event: afd_pb2.TapEvent) -> str:
    if event.WhichOneof("event") == "payload":
        p = event.payload
        stages = " ".join(
            f"s{i}={list(p.stages[i].num_tokens_across_dp)}" for i in sorted(p.stages)
        )
        flags = [
            name
            for name in (
                "is_warmup",
                "is_graph_capturing",
                "is_graph_replaying",
                "records_only",
                "is_profile",
                "stop",
            )
            if getattr(p, name)
        ]
        return f"payload step={p.step_id} epoch={p.epoch} from={p.sender_role_rank} {stages} {' '.join(flags)}".rstrip()
    e = event.membership
    who = ""
    if e.HasField("worker"):
        who = f" {enum_name(afd_pb2.Role, e.worker.role).lower()} rank {e.worker.role_rank} ({e.worker.worker_id})"
    kind = enum_name(afd_pb2.MembershipEvent.Kind, e.kind)
    change = f" target={topology_label(e.view.target)}" if e.view.HasField("target") else ""
    change += " hold" if e.view.hold else ""
    return (
        f"event {kind}{who} epoch={e.view.epoch} complete={e.view.complete}{change} {e.reason}"
    ).rstrip()


def run_watch(stub: Any, channel: grpc.Channel, args: Any, metadata: Any) -> int:
    """`afd-ctl watch`: membership events (and payloads) as they come, one per line."""
    what = "membership events and payloads" if args.payloads else "membership events"
    until = f"{args.count} events" if args.count else "Ctrl-C"
    # stderr: stdout stays one event per line (and pure JSON with --json).
    print(f"watching {what} at {args.controller} until {until}", file=sys.stderr)
    try:  # connected within --timeout first: a loaded host may need more than one try
        grpc.channel_ready_future(channel).result(timeout=args.timeout)
    except grpc.FutureTimeoutError:
        print(
            f"afd-ctl watch: no connection to {args.controller} within {args.timeout} s; is "
            "`afd-ctl serve` running there? (--timeout sets the wait)",
            file=sys.stderr,
        )
        return 1
    seen = 0
    for event in stub.Tap(afd_pb2.TapRequest(include_payloads=args.payloads), metadata=metadata):
        print(to_json(event, indent=None) if args.json else format_tap(event), flush=True)
        seen += 1
        if args.count and seen >= args.count:
            break
    return 0
