"""What the plugin does at the few places where vLLM is wrapped, each transparent without AFD
settings. The wrapping itself (which vLLM method, once, how) is in vllm_ext/compat/, one module
per seam (engine_args, serve, engine_core, api_server); this module is the AFD logic it calls.

- `EngineArgs.add_cli_args`: adds --afd-controller, --afd-role, --afd-worker-id.
- `EngineArgs.from_cli_args`: it copies only dataclass fields, so the flags are folded into
  `additional_config["afd"]` here (which vLLM hashes and ships to every process).
- `EngineArgs.create_engine_config`: picks the AFD attention worker class (only when
  --worker-cls is "auto") and checks the model and parallel settings.
- `ServeSubcommand.cmd`: `vllm serve --afd-role ffn` runs the FFN worker instead of the API
  server (an FFN worker has no scheduler, no KV cache and no HTTP endpoint); the attention
  role's vLLM IPC sockets go to a folder it owns (compat.ipc_sockets).
- `EngineCore.shutdown`: first asks the attention workers to publish `stop` (over vLLM's own
  collective_rpc), while they are still alive: `vllm serve` kills worker processes soon after.
- `EngineCore.step` / `step_with_batch_queue` / `execute_dummy_batch`: a failed AFD step fails
  the running requests instead of the engine (vllm_ext.attention.step_failures).
- API process of an attention server: `AsyncLLM.check_health` and
  `GenerateBaseServing._raise_if_error` report afd-ctl's view (vllm_ext.attention.health).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from afd_ctl.routing import Role
from vllm_ext import compat, families, startup_errors
from vllm_ext.attention import step_failures
from vllm_ext.config import ROLES, AfdConfig, afd_section

log = logging.getLogger(__name__)

ATTENTION_WORKER_CLS = "vllm_ext.attention.worker.AfdAttentionWorker"


def install() -> None:
    """Idempotent, and called again each time vLLM loads plugins: a module first imported
    after an earlier call (the engine core of an in-process LLM) is wrapped then."""
    seams = compat.seams()
    startup_errors.watch_this_process()  # a `vllm serve` that started this process reads it
    families.register_attention_models()
    seams.patch_engine_args(add_afd_arguments, _fold_afd_flags, create_engine_config)
    seams.patch_serve_cmd(serve_cmd)  # only where the `vllm` CLI imported its serve module
    # Engine-core processes (they load plugins from EngineCore.__init__). Stop is sent when the
    # busy loop ends, while vLLM's SIGTERM handler is still installed: by the time
    # EngineCore.shutdown runs, SIGTERM is back to its default and the API server's second
    # SIGTERM would kill the process before the FFN servers hear `stop`. shutdown() asks again
    # (idempotent) for the paths that do not leave through the busy loop.
    seams.patch_engine_core(
        _ask_workers_to_stop, step_failures.fail_step, step_failures.skip_failed_dummy_batch
    )


def refuse_afd_requests(message: str) -> None:
    """On a vLLM this extension does not support nothing is patched; a command line or
    environment that asks for AFD ends the process with `message` instead of running without
    it (or failing on an unknown --afd-* flag)."""
    import os

    asked = [a for a in sys.argv[1:] if a.startswith("--afd-") or '"afd"' in a or ".afd." in a]
    asked += [k for k in ("AFD_ROLE", "AFD_CONTROLLER") if os.environ.get(k)]
    if asked:
        log.error("%s (asked for by %s)", message, ", ".join(asked))
        raise SystemExit(f"error: {message}")
    log.debug("vllm_ext: %s", message)


def add_afd_arguments(parser: argparse.ArgumentParser) -> None:
    if any("--afd-role" in a.option_strings for a in parser._actions):
        return
    group = parser.add_argument_group(
        "AFD",
        "Attention-FFN disaggregation (vllm_ext); same as --additional-config '{\"afd\": {...}}'",
    )
    group.add_argument(
        "--afd-controller",
        default=None,
        metavar="HOST:PORT",
        help="address of the `afd-ctl serve` daemon; turns AFD on",
    )
    group.add_argument(
        "--afd-role",
        default=None,
        choices=ROLES,
        help="attention: a normal server whose MLP/MoE runs remotely; ffn: runs them",
    )
    group.add_argument(
        "--afd-worker-id",
        default=None,
        help="stable identity for afd-ctl (default derived from role and rank)",
    )


def merge_afd_flags(additional_config: Any, args: argparse.Namespace) -> dict[str, Any] | None:
    """additional_config with the --afd-* flags folded into its "afd" section; a flag that
    contradicts the section is an error that names both."""
    flags = {
        "controller": getattr(args, "afd_controller", None),
        "role": getattr(args, "afd_role", None),
        "worker_id": getattr(args, "afd_worker_id", None),
    }
    flags = {k: v for k, v in flags.items() if v is not None}
    if not flags:
        return additional_config
    merged = dict(additional_config or {})
    section = dict(afd_section(merged) or {})
    for key, value in flags.items():
        if key in section and section[key] != value:
            raise ValueError(
                f"--afd-{key.replace('_', '-')} {value!r} contradicts "
                f"--additional-config afd.{key}={section[key]!r}"
            )
        section[key] = value
    merged["afd"] = section
    return merged


def _fold_afd_flags(engine_args: Any, args: argparse.Namespace) -> None:
    """After EngineArgs.from_cli_args, which copies only dataclass fields."""
    engine_args.additional_config = merge_afd_flags(engine_args.additional_config, args)


ATTENTION_SHUTDOWN_TIMEOUT_S = 5


def create_engine_config(original: Any, engine_args: Any, *args: Any, **kwargs: Any) -> Any:
    """In place of EngineArgs.create_engine_config (`original`, called here): the attention
    worker class, the V1 runner pin, a stop drain, then the checks on the config vLLM made."""
    afd = AfdConfig.resolve(afd_section(engine_args.additional_config))
    if afd is None:
        return original(engine_args, *args, **kwargs)
    compat.check_supported()
    if afd.role is Role.ATTENTION and engine_args.worker_cls == "auto":
        engine_args.worker_cls = ATTENTION_WORKER_CLS
    if afd.role is Role.ATTENTION:
        pinned = compat.seams().pin_v1_model_runner()
        if pinned:
            log.info("afd attention: %s", pinned)
        _micro_batching_backend(engine_args)
    if afd.role is Role.ATTENTION and not engine_args.shutdown_timeout:
        # With vLLM's default (0: abort) the API server kills the engine core at once on
        # SIGTERM, before its workers can publish `stop`; a short drain lets them, so the
        # FFN servers exit cleanly instead of waiting for a replacement.
        engine_args.shutdown_timeout = ATTENTION_SHUTDOWN_TIMEOUT_S
        log.info(
            "afd attention: --shutdown-timeout %d so that stop reaches the FFN servers",
            ATTENTION_SHUTDOWN_TIMEOUT_S,
        )
    config = original(engine_args, *args, **kwargs)
    validate(config, afd)
    if afd.role is Role.ATTENTION:
        families.use_attention_model(config)
        _exchange_between_graph_pieces(config)
        _wrap_api_server(afd)
    return config


def _micro_batching_backend(engine_args: Any) -> None:
    """vLLM's config refuses micro-batching (--enable-dbo) unless the all2all backend is one
    that overlaps (DeepEP, nixl_ep). An AFD attention server has no MoE and so no all2all: the
    backend is named only to pass that check (validate says what else DBO needs)."""
    if not getattr(engine_args, "enable_dbo", False):
        return
    if engine_args.all2all_backend not in MICRO_BATCHING_BACKENDS:
        log.info(
            "afd attention: --all2all-backend %s for --enable-dbo (no MoE on this side, so "
            "no all2all runs)",
            MICRO_BATCHING_BACKENDS[0],
        )
        engine_args.all2all_backend = MICRO_BATCHING_BACKENDS[0]


# The all2all backends vLLM's micro-batching accepts (vllm/config/vllm.py).
MICRO_BATCHING_BACKENDS = ("deepep_low_latency", "deepep_high_throughput", "nixl_ep")


# The attention model's AFD exchange op (vllm_ext.model_split).
EXCHANGE_OP = "afd::ffn_exchange"


def _exchange_between_graph_pieces(vllm_config: Any) -> None:
    """Piecewise compilation splits the model at `splitting_ops` (vLLM fills its attention ops
    there when the user gives none): the exchange joins them, so under PIECEWISE graphs it runs
    eagerly between the captured pieces (a host-driven exchange must; a GPU-driven one may).
    The CUDA graph mode the user asked for (vLLM's default FULL_AND_PIECEWISE included) stays:
    whether FULL graphs can hold the exchange is known at connect (graphs_for_exchange)."""
    _, compilation_mode = compat.seams().compilation_enums()
    compilation = vllm_config.compilation_config
    if compilation.mode != compilation_mode.VLLM_COMPILE:
        return
    ops = compilation.splitting_ops
    if not ops:
        return  # no pieces (e.g. FULL_DECODE_ONLY): the exchange sits inside the compiled graph
    if EXCHANGE_OP not in ops:
        ops.append(EXCHANGE_OP)
    log.info("afd attention: %s splits the model's CUDA graph pieces", EXCHANGE_OP)


def graphs_for_exchange(vllm_config: Any, full_graphs: bool) -> None:
    """Called once the data plane chose its exchange (at load_model, before vLLM resolves its
    CUDA graph mode at KV cache set-up). The GPU-driven exchange runs inside FULL graphs. A
    host-driven one (NIXL: peers on other hosts) would run once at capture and never on
    replay, so FULL modes become PIECEWISE (the exchange eager between the pieces) or, where
    the model was compiled without pieces, no CUDA graphs."""
    cuda_graph_mode, _ = compat.seams().compilation_enums()
    compilation = vllm_config.compilation_config
    mode = compilation.cudagraph_mode
    if mode is None or not mode.has_full_cudagraphs():
        return
    if full_graphs:
        log.info(
            "afd attention: cudagraph_mode %s: FULL CUDA graphs capture the GPU-driven exchange",
            mode.name,
        )
        return
    fallback = (
        cuda_graph_mode.PIECEWISE
        if EXCHANGE_OP in (compilation.splitting_ops or [])
        else cuda_graph_mode.NONE
    )
    log.warning(
        "afd attention: cudagraph_mode %s needs the GPU-driven exchange, and this worker's "
        "peers use the host-driven NIXL path (another host, or AFD_DATA_GPU_HOP=off): running "
        "%s instead",
        mode.name,
        fallback.name,
    )
    compilation.cudagraph_mode = fallback


def validate(vllm_config: Any, afd: AfdConfig) -> None:
    """Refuses settings the AFD split does not handle, naming the setting."""
    families.family_for(vllm_config.model_config.hf_config)  # refuses an unsupported model
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ValueError("AFD does not support --pipeline-parallel-size > 1")
    if getattr(parallel, "use_ubatching", False):
        _check_micro_batching(parallel, afd)
    if afd.role is Role.FFN and parallel.data_parallel_size != 1:
        raise ValueError("an AFD FFN server runs one rank: start one server per FFN rank")
    if afd.role is Role.ATTENTION and parallel.worker_cls != ATTENTION_WORKER_CLS:
        log.warning(
            "AFD attention role with --worker-cls %s: that class must subclass %s",
            parallel.worker_cls,
            ATTENTION_WORKER_CLS,
        )


def _check_micro_batching(parallel: Any, afd: AfdConfig) -> None:
    """Dual-batch overlap (--enable-dbo) on the attention role: two micro-batches per step,
    each a stage of the AFD payload; the FFN server follows them without a flag."""
    if afd.role is Role.FFN:
        raise ValueError(
            "an AFD FFN server follows the attention servers' micro-batches by itself: drop "
            "--enable-dbo / --ubatch-size from the FFN server"
        )
    if not parallel.enable_dbo or parallel.num_ubatches != 2:
        raise ValueError(
            "AFD carries two micro-batches per step: use --enable-dbo, not --ubatch-size "
            f"{parallel.ubatch_size}"
        )
    log.warning(
        "afd attention: --enable-dbo: vLLM captures micro-batched steps only in FULL CUDA-graph "
        "modes, which only the GPU-driven exchange (FFN peers on this host) joins; on the "
        "host-driven exchange they run without graphs. Either way each micro-batch reads the "
        "experts' weights again: where decode is bound by those reads (one H200, batch 32-256: "
        "TPOT 1.44-1.75x without overlap) overlap costs more than it hides. Measure TPOT with "
        "and without it (benchmarks/e2e_decode.py --interleave --part afd,afd_dbo)"
    )


def serve_cmd(args: argparse.Namespace, vllm_cmd: Any) -> None:
    """`vllm serve`: the FFN role runs vllm_ext.ffn.server; anything else is vLLM's own
    (`vllm_cmd`). With AFD settings, a bad flag is one argparse-style line, and a start-up
    failure of ours ends with its one-line reason last (vllm_ext.startup_errors)."""
    try:
        merged = merge_afd_flags(getattr(args, "additional_config", None), args)
        afd = AfdConfig.resolve(afd_section(merged))
    except ValueError as exc:
        startup_errors.flag_error(exc)
    if afd is None:
        return vllm_cmd(args)
    with startup_errors.said_last():
        if afd.role is Role.FFN:
            from vllm_ext.ffn.cli import serve_ffn

            if getattr(args, "model_tag", None) is not None:
                args.model = args.model_tag
            return serve_ffn(args)
        # Folded into args here too: `vllm serve` hands these args to its API server processes
        # (one per DP rank by default), which load the plugin only inside from_cli_args, too
        # late for its wrapper, and must still see the afd section (/health, error replies).
        args.additional_config = merged
        startup_errors.check_controller(afd)  # before any engine starts
        compat.seams().ipc_sockets_in_owned_folder()  # inherited by every process it starts
        return vllm_cmd(args)


def _wrap_api_server(afd: AfdConfig) -> None:
    """Runs where the engine config is created: the API server process of `vllm serve` (and
    an offline LLM's process, where it is harmless)."""
    from vllm_ext import metrics
    from vllm_ext.attention import health

    seams = compat.seams()
    metrics.expose_worker_series()
    if seams.api_server_patched():
        return
    monitor = health.AfdSideMonitor(afd)
    if afd.elastic:  # it may be left out of a planned change: drain it then (issue 37)
        from vllm_ext.attention.leaving import LeaveWatch

        watch = LeaveWatch(afd, monitor)
        seams.patch_async_llm(watch.wrap_init, watch.wrap_check_model)
    seams.patch_api_server(
        lambda check_health: health.wrap_check_health(check_health, monitor),
        lambda raise_if_error: health.wrap_raise_if_error(raise_if_error, monitor),
        health.wrap_streaming_error,
        seams.engine_outputs_seen(monitor.failed_requests.seen),
    )


def _afd_stop_worker(worker: Any) -> None:
    """Runs in each worker process (collective_rpc); a no-op for workers without AFD."""
    stop = getattr(worker, "afd_stop", None) or getattr(
        getattr(worker, "worker", None), "afd_stop", None
    )
    if stop is not None:
        stop()


def _ask_workers_to_stop(engine_core: Any) -> None:
    """Attention role: every worker publishes `stop` (sender) and leaves; once per engine."""
    if getattr(engine_core, "_afd_stop_asked", False):
        return
    engine_core._afd_stop_asked = True
    try:
        afd = AfdConfig.resolve(afd_section(engine_core.vllm_config.additional_config))
        executor = getattr(engine_core, "model_executor", None)
        if afd is not None and afd.role is Role.ATTENTION and executor is not None:
            executor.collective_rpc(_afd_stop_worker, timeout=10)
    except Exception as exc:  # shutting down: report, never block the teardown
        log.warning("afd: could not ask the attention workers to send stop: %s", exc)
