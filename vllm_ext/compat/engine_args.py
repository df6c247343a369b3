"""Seam: `vllm/engine/arg_utils.py` `EngineArgs` (add_cli_args, from_cli_args,
create_engine_config), the AFD flags and the engine config.

Why: vLLM has no plugin hook for new command-line flags (plugins load before `add_cli_args` is
looked up, so wrapping it adds `--afd-*`), `from_cli_args` copies only dataclass fields (the
flags are folded into `additional_config["afd"]`, which reaches every process and the config
hash), and `create_engine_config` is the one place, before any process starts, to pick the
attention worker class, pin the V1 runner and the CUDA graph mode.
Upstream change that makes it unnecessary: a plugin API to add argument groups and to adjust
the engine config once it is made (or `worker_cls`/graph settings per plugin).
Remove when: every supported vLLM line has such hooks.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

# (module, attribute path, parameters relied on): checked against the installed vLLM.
SIGNATURES: list[tuple[str, str, tuple[str, ...]]] = [
    ("vllm.engine.arg_utils", "EngineArgs.add_cli_args", ("parser",)),
    ("vllm.engine.arg_utils", "EngineArgs.from_cli_args", ("args",)),
    ("vllm.engine.arg_utils", "EngineArgs.create_engine_config", ("self", "usage_context")),
    ("vllm.usage.usage_lib", "UsageContext.OPENAI_API_SERVER", ()),
    ("vllm.engine.arg_utils", "AsyncEngineArgs.from_cli_args", ("args",)),
    ("vllm.utils.argparse_utils", "FlexibleArgumentParser", ()),
    ("vllm.config.compilation", "CUDAGraphMode.PIECEWISE", ()),
    ("vllm.config.compilation", "CompilationMode.VLLM_COMPILE", ()),
]


def engine_args_classes() -> tuple[Any, Any]:
    """(EngineArgs, AsyncEngineArgs): vllm/engine/arg_utils.py; their add_cli_args,
    from_cli_args and create_engine_config are where flags and the engine config are made."""
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    return EngineArgs, AsyncEngineArgs


def serve_usage_context() -> Any:
    """What `vllm serve` passes to create_engine_config (vllm/usage/usage_lib.py): some
    defaults (max_num_batched_tokens on GPU) depend on it, and the FFN server must size its data
    plane exactly as the attention `vllm serve` does."""
    from vllm.usage.usage_lib import UsageContext

    return UsageContext.OPENAI_API_SERVER


def flexible_argument_parser() -> Any:
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return FlexibleArgumentParser


def pin_v1_model_runner() -> str | None:
    """The AFD attention runner subclasses vLLM's V1 GPU runner; vLLM 0.26+ picks Model Runner
    V2 by default for some architectures (vllm/config/vllm.py `use_v2_model_runner`, which
    reads VLLM_USE_V2_MODEL_RUNNER first). Pins V1 through that variable, which the engine-core
    and worker processes inherit. Returns what was done, for the log, or raises if the user
    asked for V2 explicitly."""
    asked = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if asked is not None and asked.strip().lower() in ("1", "true", "yes"):
        raise ValueError(
            "AFD's attention role runs on vLLM's V1 model runner; VLLM_USE_V2_MODEL_RUNNER=1 "
            "asks for V2, which it does not support yet: unset it"
        )
    if asked is None:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        return "VLLM_USE_V2_MODEL_RUNNER=0 (the AFD attention runner is vLLM's V1 runner)"
    return None


def compilation_enums() -> tuple[Any, Any]:
    """(CUDAGraphMode, CompilationMode): vllm/config/compilation.py."""
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    return CUDAGraphMode, CompilationMode


_PATCHED = "_afd_wrapped"


def patch_engine_args(
    add_arguments: Callable[[Any], None],
    fold_flags: Callable[[Any, Any], None],
    make_config: Callable[..., Any],
) -> None:
    """Wraps EngineArgs once (idempotent): `add_cli_args` calls add_arguments(parser) after
    vLLM's own; `from_cli_args` calls fold_flags(engine_args, args) on what vLLM built;
    `create_engine_config(self, ...)` becomes make_config(vLLM's method, self, ...). vLLM's
    names and signatures stay visible (functools.wraps)."""
    engine_args_cls, _ = engine_args_classes()
    if getattr(engine_args_cls.add_cli_args, _PATCHED, False):
        return
    original_add = engine_args_cls.add_cli_args

    @functools.wraps(original_add)
    def add_cli_args(parser: Any, *args: Any, **kwargs: Any) -> Any:
        parser = original_add(parser, *args, **kwargs)
        add_arguments(parser)
        return parser

    setattr(add_cli_args, _PATCHED, True)
    engine_args_cls.add_cli_args = staticmethod(add_cli_args)

    original_from = engine_args_cls.from_cli_args.__func__

    @functools.wraps(original_from)
    def from_cli_args(cls: type, args: Any) -> Any:
        engine_args = original_from(cls, args)
        fold_flags(engine_args, args)
        return engine_args

    engine_args_cls.from_cli_args = classmethod(from_cli_args)

    original_create = engine_args_cls.create_engine_config

    @functools.wraps(original_create)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        return make_config(original_create, self, *args, **kwargs)

    engine_args_cls.create_engine_config = create_engine_config
