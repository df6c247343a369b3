"""Reaches into vLLM internals that are the same on every supported line (0.26 and 0.32).

One module per vLLM seam, each headed by why the reach exists, what upstream change would make
it unnecessary and when it can go, and each with the `SIGNATURES` of its targets:

- `engine_args`: EngineArgs (flags, engine config, V1 runner pin, graph-mode enums)
- `serve`: ServeSubcommand.cmd (`vllm serve --afd-role ffn`)
- `engine_core`: EngineCore step/shutdown and the busy loops (failed steps, `stop`)
- `api_server`: AsyncLLM.check_health and the OpenAI server's error replies
- `worker`: the platform's worker and the runner class its init_device builds
- `model_runner`: the V1 runner's private methods the attention runner overrides
- `micro_batching`: dual-batch overlap at one DP rank
- `deepseek_v2`: DeepSeek V2/V3's model module
- `models`: the model registry, loader and the classes the families build from
- `ffn_runtime`: what vLLM's layers expect around them in the FFN server
- `kv_connector`: a failed AFD step keeps vLLM's KV connector results (prefill/decode
  disaggregation with the attention server as KV consumer)
- `expert_parallel`: an FFN rank holding and computing only its slice of the routed experts
- `offline`: the public LLM API for vllm_ext.testing
- `ipc_sockets`: vLLM's ZeroMQ IPC sockets in a folder the attention server owns

This module gathers them (the line modules, v0_26 and v0_32, re-export it and add what
differs); `SIGNATURES` is every seam's, for tests/test_vllm_compat.py. Heavy vLLM imports stay
inside the functions: importing compat imports nothing of vLLM.
"""

from __future__ import annotations

from vllm_ext.compat import (
    api_server,
    deepseek_v2,
    engine_args,
    engine_core,
    expert_parallel,
    ffn_runtime,
    forward_layers,
    ipc_sockets,
    kv_connector,
    micro_batching,
    model_runner,
    models,
    offline,
    serve,
    worker,
)
from vllm_ext.compat.api_server import *  # noqa: F403
from vllm_ext.compat.deepseek_v2 import *  # noqa: F403
from vllm_ext.compat.engine_args import *  # noqa: F403
from vllm_ext.compat.engine_core import *  # noqa: F403
from vllm_ext.compat.expert_parallel import *  # noqa: F403
from vllm_ext.compat.ffn_runtime import *  # noqa: F403
from vllm_ext.compat.forward_layers import *  # noqa: F403
from vllm_ext.compat.ipc_sockets import *  # noqa: F403
from vllm_ext.compat.micro_batching import *  # noqa: F403
from vllm_ext.compat.model_runner import *  # noqa: F403
from vllm_ext.compat.models import *  # noqa: F403
from vllm_ext.compat.offline import *  # noqa: F403
from vllm_ext.compat.serve import *  # noqa: F403
from vllm_ext.compat.worker import *  # noqa: F403

SEAMS = (
    engine_args,
    serve,
    engine_core,
    api_server,
    worker,
    model_runner,
    micro_batching,
    deepseek_v2,
    models,
    ffn_runtime,
    expert_parallel,
    forward_layers,
    kv_connector,
    offline,
    ipc_sockets,
)

# (module, attribute path, parameters relied on): every seam's, checked against the installed vLLM.
SIGNATURES = [target for seam in SEAMS for target in seam.SIGNATURES]
