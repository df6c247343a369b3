"""What the end-to-end benchmarks share: the DeepSeek-V3-shaped model with dummy weights, the
plugin's entry point on machines where this checkout is not pip-installed, the environment
that pins each vLLM process to its GPU, whether CUDA MPS is on, and the processes of one part."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vllm_ext.testing.processes import Proc

ROOT = Path(__file__).resolve().parent.parent


# --one-gpu (a one-GPU machine): the AFD servers share cuda:0. Memory shares of the one GPU
# (the FFN server holds every expert) and a fixed KV cache for the attention server, since both
# start at once and vLLM's memory profiling would count the other's allocations as its own.
@dataclasses.dataclass(frozen=True)
class OneGpuShares:
    ffn_memory: float = 0.5  # --gpu-memory-utilization of the FFN server
    attention_memory: float = 0.35  # ... of the attention server
    kv_cache_bytes: int = 8 << 30  # the attention server's --kv-cache-memory-bytes


ONE_GPU = OneGpuShares()
# A part's "placement" in the state file when --one-gpu put AFD's servers on one GPU.
SHARED_PLACEMENT = "one GPU, shared"


def mps_state(flag: str = "auto") -> dict[str, Any]:
    """Whether CUDA MPS serves this machine's GPU clients: `--mps on|off` as the operator says,
    else detected (`auto`): MPS's control daemon answers `get_server_list` on the pipe directory
    CUDA clients use (CUDA_MPS_PIPE_DIRECTORY, else the default /tmp/nvidia-mps). A client
    started while it answers connects to MPS; where it does not, clients run without."""
    pipe_dir = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "")
    if flag in ("on", "off"):
        return {"mps": flag == "on", "mps_source": "--mps flag", "mps_pipe_directory": pipe_dir}
    try:
        answer = subprocess.run(
            ["nvidia-cuda-mps-control"], input="get_server_list\n",
            capture_output=True, text=True, timeout=10, check=False,
        )  # fmt: skip
        text = (answer.stdout + answer.stderr).lower()
        on = answer.returncode == 0 and "cannot find" not in text and "error" not in text
    except (OSError, subprocess.TimeoutExpired):
        on = False
    return {
        "mps": on,
        "mps_source": "nvidia-cuda-mps-control get_server_list answered" if on else "no answer",
        "mps_pipe_directory": pipe_dir or "/tmp/nvidia-mps (default)",
    }


V3_EXPERTS = 256


def v3_shaped_config(layers: int, experts: int = V3_EXPERTS, max_len: int = 4096) -> dict[str, Any]:
    """DeepSeek-V3's layer shapes (its real vocabulary size too: the LM head is part of a step).
    `experts` below V3's 256 (a multiple of its 8 expert groups, at least 16: 8 groups of 2, of
    which the top 4 groups' 8 experts hold every token's top 8) shrinks each MoE layer's weights
    alike for every part, so deeper models fit two engines on one GPU (issue 33's fit over a
    wide depth span: 16 experts, 8 and 16 layers).
    `max_len` past 4096 raises the positions the model takes (long prompts: vLLM refuses a
    max_model_len above the config's)."""
    from vllm_ext.testing.tiny_deepseek import config_for

    if experts % 8 or not 16 <= experts <= V3_EXPERTS:
        raise ValueError(
            f"--experts {experts}: give a multiple of 8 (V3's expert groups) in 16..{V3_EXPERTS}"
        )

    config = config_for(3, head_dim=128)
    config.update(
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=128,
        num_key_value_heads=128,
        n_routed_experts=experts,
        num_experts_per_tok=8,
        n_shared_experts=1,
        first_k_dense_replace=1,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        n_group=8,
        topk_group=4,
        torch_dtype="bfloat16",
        max_position_embeddings=max(4096, max_len),
    )
    return config


def v3_kv_bytes_per_token(layers: int) -> int:
    """Bytes of vLLM's KV cache one token takes in the V3-shaped model: MLA keeps the latent
    (kv_lora_rank) and the rotary key (qk_rope_head_dim) per layer, in bfloat16."""
    config = v3_shaped_config(layers)
    return (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 2 * layers


def write_v3_shaped(out: Path, layers: int, experts: int = V3_EXPERTS, max_len: int = 4096) -> Path:
    """config.json and a tokenizer; the weights are vLLM's dummy ones (--load-format dummy)."""
    from vllm_ext.testing.tiny_deepseek import BOS_ID, EOS_ID, build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(
        json.dumps(v3_shaped_config(layers, experts, max_len), indent=2)
    )
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID})
    )
    build_tokenizer(out)
    return out


def plugin_path(tmp: Path) -> str:
    """A PYTHONPATH entry that declares the plugin's entry point (vllm.general_plugins) when
    this checkout is not pip-installed (as on the GPU machines)."""
    from importlib.metadata import entry_points

    if any(ep.value.startswith("vllm_ext") for ep in entry_points(group="vllm.general_plugins")):
        return ""
    meta = tmp / "afd-meta" / "afd_ctl-0.1.0.dist-info"
    meta.mkdir(parents=True, exist_ok=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: afd-ctl\nVersion: 0.1.0\n")
    (meta / "entry_points.txt").write_text("[vllm.general_plugins]\nafd = vllm_ext:register\n")
    return str(tmp / "afd-meta")


def gpu_env(visible: str, extra_path: str) -> dict[str, str]:
    """All GPUs stay visible (CUDA IPC between the processes needs both), in the order that
    makes the wanted one this process's cuda:0."""
    env = {
        "CUDA_VISIBLE_DEVICES": visible,
        "VLLM_HOST_IP": "127.0.0.1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (extra_path, str(ROOT), os.environ.get("PYTHONPATH", "")) if p
        )
    return env


@contextlib.contextmanager
def part_processes() -> Iterator[list[Proc]]:
    """The processes one part starts (append them): if the part fails, their log tails go to
    stderr; every one is stopped at the end."""
    procs: list[Proc] = []
    try:
        yield procs
    except (AssertionError, RuntimeError):
        for p in procs:
            print(f"--- {p.log_path.name}\n{p.tail(40)}", file=sys.stderr)
        raise
    finally:
        for p in reversed(procs):
            p.stop()
