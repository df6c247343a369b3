"""Seam: the API process of an attention server: `vllm/v1/engine/async_llm.py`
`AsyncLLM.check_health` and `vllm/entrypoints/generate/base/serving.py`
`GenerateBaseServing._raise_if_error` / `_convert_generation_error_to_streaming_response`.

Why: `/health` must report the FFN side's state (afd-ctl's view), and a request that failed
because the FFN side is down must be a 503 that says so (a streamed one an error event), not
"Internal server error". `vllm/v1/engine/output_processor.py` `OutputProcessor.process_outputs`
is where the API process sees why the engine failed a request (its stop_reason), and by which
id the API server knows it: only an AFD failure gets AFD's reply (another error, such as a
prompt's KV cache a prefill server could not hand over, stays vLLM's own).
`AsyncLLM.__init__` / `collective_rpc`, `BaseServing._check_model` and the output processor's count of
unfinished requests: an attention server that `afd-ctl scale` leaves out stops taking requests,
finishes its own and says so (vllm_ext.attention.leaving).
Upstream change that makes it unnecessary: a plugin health-check hook, a typed request
error a worker can raise that the OpenAI server maps to 503 with its message, and a drain
(stop admitting, finish, report) API for the server.
Remove when: every supported line has both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# (module, attribute path, parameters relied on): checked against the installed vLLM.
SIGNATURES: list[tuple[str, str, tuple[str, ...]]] = [
    ("vllm.v1.engine.async_llm", "AsyncLLM.check_health", ("self",)),
    (
        "vllm.entrypoints.generate.base.serving",
        "GenerateBaseServing._raise_if_error",
        ("self", "finish_reason", "request_id"),
    ),
    (
        "vllm.entrypoints.generate.base.serving",
        "GenerateBaseServing._convert_generation_error_to_streaming_response",
        ("self", "e"),
    ),
    (
        "vllm.entrypoints.generate.base.serving",
        "GenerateBaseServing.create_streaming_error_response",
        ("self", "message", "err_type", "status_code"),
    ),
    ("vllm.v1.engine.exceptions", "EngineDeadError", ()),
    (
        "vllm.v1.engine.output_processor",
        "OutputProcessor.process_outputs",
        ("self", "engine_core_outputs"),
    ),
    # An attention server a planned change leaves out (vllm_ext.attention.leaving): its API
    # process refuses new requests, counts those left, and asks its workers to say `drained`.
    ("vllm.v1.engine.async_llm", "AsyncLLM.__init__", ("self",)),
    ("vllm.entrypoints.serve.engine.serving", "BaseServing._check_model", ("self", "request")),
    (
        "vllm.entrypoints.serve.engine.serving",
        "BaseServing.create_error_response",
        ("message", "err_type", "status_code"),
    ),
    ("vllm.v1.engine.async_llm", "AsyncLLM.collective_rpc", ("self", "method")),
    ("vllm.v1.engine.output_processor", "OutputProcessor.get_num_unfinished_requests", ("self",)),
]


def api_server_classes() -> tuple[Any, Any]:
    """(AsyncLLM, GenerateBaseServing): `check_health` answers /health; `_raise_if_error`
    turns a request finished with an error into the HTTP error, and
    `_convert_generation_error_to_streaming_response` into a stream's error event."""
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM, GenerateBaseServing


def engine_dead_error() -> type[Exception]:
    """vLLM's /health route answers 503 for this class (vllm/v1/engine/exceptions.py)."""
    from vllm.v1.engine.exceptions import EngineDeadError

    return EngineDeadError


_PATCHED = "_afd_wrapped"


def api_server_patched() -> bool:
    AsyncLLM, _ = api_server_classes()  # noqa: N806
    return bool(getattr(AsyncLLM.check_health, _PATCHED, False))


def engine_outputs_seen(on_output: Callable[[str, Any], None]) -> Callable[[Any], Any]:
    """A wrapper for OutputProcessor.process_outputs that first calls on_output(the API
    server's id of the request, its stop_reason) for each finished EngineCoreOutput."""

    def wrap(process_outputs: Any) -> Any:
        def wrapped(self: Any, engine_core_outputs: Any, *args: Any, **kwargs: Any) -> Any:
            for output in engine_core_outputs:
                if output.finish_reason is None:
                    continue
                state = self.request_states.get(output.request_id)
                on_output(getattr(state, "external_req_id", output.request_id), output.stop_reason)
            return process_outputs(self, engine_core_outputs, *args, **kwargs)

        return wrapped

    return wrap


def patch_api_server(
    wrap_check_health: Callable[[Any], Any],
    wrap_raise_if_error: Callable[[Any], Any],
    wrap_streaming_error: Callable[[Any], Any],
    wrap_process_outputs: Callable[[Any], Any],
) -> None:
    """Each of AsyncLLM.check_health, GenerateBaseServing._raise_if_error,
    _convert_generation_error_to_streaming_response and OutputProcessor.process_outputs
    becomes wrap_...(vLLM's method), once."""
    from vllm.v1.engine.output_processor import OutputProcessor

    AsyncLLM, GenerateBaseServing = api_server_classes()  # noqa: N806
    if api_server_patched():
        return
    OutputProcessor.process_outputs = wrap_process_outputs(OutputProcessor.process_outputs)
    check_health = wrap_check_health(AsyncLLM.check_health)
    setattr(check_health, _PATCHED, True)
    AsyncLLM.check_health = check_health
    GenerateBaseServing._raise_if_error = wrap_raise_if_error(GenerateBaseServing._raise_if_error)
    GenerateBaseServing._convert_generation_error_to_streaming_response = wrap_streaming_error(
        GenerateBaseServing._convert_generation_error_to_streaming_response
    )


def unfinished_requests(engine: Any) -> int:
    """Requests the API process of AsyncLLM `engine` has not seen finish (queued or running)."""
    return int(engine.output_processor.get_num_unfinished_requests())


def patch_async_llm(
    wrap_init: Callable[[Any], Any], wrap_check_model: Callable[[Any], Any]
) -> None:
    """AsyncLLM.__init__ and BaseServing._check_model (the first check of every OpenAI request,
    which may answer with an error response instead) become wrap_...(vLLM's method), once."""
    from vllm.entrypoints.serve.engine.serving import BaseServing

    AsyncLLM, _ = api_server_classes()  # noqa: N806
    if getattr(BaseServing._check_model, _PATCHED, False):
        return
    AsyncLLM.__init__ = wrap_init(AsyncLLM.__init__)
    check_model = wrap_check_model(BaseServing._check_model)
    setattr(check_model, _PATCHED, True)
    BaseServing._check_model = check_model
