"""Every reach vllm_ext makes into vLLM's internals still exists on the installed vLLM, with the
parameters it relies on (vllm_ext/compat). Fast: imports only, no engine."""

from __future__ import annotations

import importlib
import inspect
import os
import shutil
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by scripts/install_vllm_cpu.sh")
# The signatures of the installed line: every test here runs on both vLLM lines.
pytestmark = pytest.mark.both_lines

from vllm_ext.testing.offline import apply_cpu_env  # noqa: E402

apply_cpu_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})

from vllm_ext import compat  # noqa: E402


def _targets() -> list[tuple[str, str, tuple[str, ...]]]:
    return list(compat.seams().SIGNATURES)


def test_installed_vllm_is_a_supported_line() -> None:
    assert compat.vllm_line() in compat.SUPPORTED_LINES
    assert compat.seams().LINE == compat.vllm_line()


@pytest.mark.parametrize("module,path,params", _targets(), ids=lambda v: str(v))
def test_seam_exists_with_its_signature(module: str, path: str, params: tuple[str, ...]) -> None:
    obj = importlib.import_module(module)
    for part in path.split("."):
        assert hasattr(obj, part), (
            f"{module}.{path}: {part!r} is gone in vLLM {compat.vllm_version()}"
        )
        obj = getattr(obj, part)
    if params:
        signature = inspect.signature(obj)
        missing = [p for p in params if p not in signature.parameters]
        assert not missing, f"{module}.{path}{signature} lacks {missing}"


def test_runner_class_names_swapped_at_init_device_exist() -> None:
    """compat.runner_class_swapped replaces these module attributes for init_device."""
    from vllm.v1.worker import cpu_worker, gpu_model_runner

    assert isinstance(cpu_worker.CPUModelRunner, type)
    assert isinstance(gpu_model_runner.GPUModelRunner, type)
    source = inspect.getsource(cpu_worker.CPUWorker.init_device)
    assert "CPUModelRunner(" in source


def test_deepseek_layers_build_their_mlp_by_module_global_name() -> None:
    """compat.layers_built_with swaps these names of deepseek_v2's module while each decoder
    layer is constructed: the constructor must still look them up there."""
    from vllm.model_executor.models import deepseek_v2

    source = inspect.getsource(deepseek_v2.DeepseekV2DecoderLayer.__init__)
    assert "DeepseekV2MoE(" in source and "DeepseekV2MLP(" in source


def test_batch_queue_entries_keep_their_layout() -> None:
    """A failed step collects the queued batches' futures (compat.queued_batch_futures):
    EngineCore.step_with_batch_queue must still queue (future, scheduler_output, exec_future)."""
    from vllm.v1.engine.core import EngineCore

    source = inspect.getsource(EngineCore.step_with_batch_queue)
    assert compat.seams().BATCH_QUEUE_ENTRY in source
    assert compat.seams().queued_batch_futures(("f", "s", "e")) == ("f", "e")


def test_other_lines_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.29.1")
    with pytest.raises(
        compat.AfdUnsupportedVllm, match="supports vLLM 0.26.x and 0.32.x, found vLLM 0.29.1"
    ):
        compat.check_supported()


def test_one_rank_micro_batch_decision_follows_vllms_thresholds() -> None:
    """--enable-dbo at attention DP 1: AFD applies vLLM's own micro-batch rule (thresholds, no
    empty second micro-batch, the caller's allow flag) to what the runner decided, since vLLM
    decides micro-batches only across DP ranks. The GPU check runs the whole path."""
    from types import SimpleNamespace

    from vllm.config import ParallelConfig
    from vllm.config.compilation import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    parallel = ParallelConfig(
        enable_dbo=True, dbo_decode_token_threshold=4, dbo_prefill_token_threshold=16
    )
    runner = SimpleNamespace(parallel_config=parallel, uniform_decode_query_len=1)
    decide = compat.seams().micro_batched_at_one_rank

    def ubatched(num_tokens: int, padded: int, num_reqs: int, **kw: object) -> bool:
        result = (CUDAGraphMode.NONE, BatchDescriptor(num_tokens=padded), False, None, None)
        args = (num_tokens, num_reqs, None, max(1, num_tokens // num_reqs))
        out = decide(runner, result, args, {"use_cascade_attn": False, **kw})
        assert out[0] is result[0] and out[1] is result[1] and out[3:] == result[3:]
        return out[2]

    assert ubatched(8, 8, num_reqs=8)  # a decode of 8 rows: at the threshold
    assert not ubatched(2, 2, num_reqs=2)  # below the decode threshold
    assert not ubatched(8, 8, num_reqs=8, allow_microbatching=False)
    assert not ubatched(8, 8, num_reqs=1)  # one prefill of 8: below the prefill threshold
    assert ubatched(16, 16, num_reqs=1)
    assert not ubatched(3, 8, num_reqs=3, force_uniform_decode=True)  # second half all padding


def test_an_unsplit_step_at_a_micro_batched_graphs_size_is_told_as_eager() -> None:
    """--enable-dbo: vLLM's UBatchWrapper keeps one FULL graph per size, so a step it did not
    split (too few real rows) padded to a size it captured micro-batched runs eagerly though
    the forward context says FULL; the FFN side must hear "eager", not "replay" (seen on an
    H200: the FFN server captured a step graph while serving). The rule is vLLM's own."""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu_ubatch_wrapper import UBatchWrapper

    source = inspect.getsource(UBatchWrapper.__call__)
    assert "batch_descriptor.num_tokens in self.cudagraphs" in source
    assert "cudagraph_runtime_mode = CUDAGraphMode.NONE" in source
    mode = compat.seams().graph_mode_run
    wrapper = UBatchWrapper.__new__(UBatchWrapper)  # its __init__ makes a CUDA stream
    wrapper.cudagraphs = {32: object(), 64: object()}
    runner = SimpleNamespace(model=wrapper)
    assert mode(runner, "FULL", 32, micro_batched=False) == "NONE"  # aborted ubatching
    assert mode(runner, "FULL", 32, micro_batched=True) == "FULL"
    assert mode(runner, "FULL", 24, micro_batched=False) == "FULL"  # below the threshold
    assert mode(runner, "PIECEWISE", 32, micro_batched=False) == "PIECEWISE"
    assert mode(SimpleNamespace(model=object()), "FULL", 32, micro_batched=False) == "FULL"


def test_a_failed_start_is_logged_with_its_exception() -> None:
    """vllm_ext.startup_errors reads a worker's or engine core's start-up failure from the
    record vLLM logs for it (compat.engine_core: STARTUP_FAILURE_LOGGER, ..._PHRASE)."""
    from vllm.v1.engine.core import EngineCoreProc
    from vllm.v1.executor.multiproc_executor import WorkerProc

    seams = compat.seams()
    for function in (WorkerProc.worker_main, EngineCoreProc.run_engine_core):
        source = inspect.getsource(function)
        assert f"{seams.STARTUP_FAILURE_PHRASE}." in source, function.__qualname__
        assert "logger.exception(" in source, function.__qualname__


def test_ipc_sockets_go_where_the_base_path_variable_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """compat.ipc_sockets points VLLM_RPC_BASE_PATH at a folder of the attention server's own:
    vLLM must still name its IPC sockets from that variable, and a base path the user set
    stays. (A folder of the temporary folder's own, not pytest's tmp_path: that path is too
    long for a socket's.)"""
    from vllm.utils import network_utils

    source = inspect.getsource(network_utils.get_open_zmq_ipc_path)
    assert "envs.VLLM_RPC_BASE_PATH" in source and "ipc://" in source

    seams = compat.seams()
    root = Path(tempfile.mkdtemp(prefix="afd-t-"))
    try:
        monkeypatch.setattr(tempfile, "tempdir", str(root))
        monkeypatch.setenv(seams.IPC_BASE_ENV, "/srv/mine")
        assert seams.ipc_sockets_in_owned_folder() is None
        assert os.environ[seams.IPC_BASE_ENV] == "/srv/mine"
        monkeypatch.delenv(seams.IPC_BASE_ENV)
        folder = Path(seams.ipc_sockets_in_owned_folder() or "")
        assert os.environ[seams.IPC_BASE_ENV] == str(folder)
        assert folder.is_dir() and folder.parent == root
        assert folder.name.startswith("afd-ipc-") and f".{os.getpid()}-" in folder.name

        # Where the folder's path would be too long for a socket's, vLLM's default stays.
        monkeypatch.delenv(seams.IPC_BASE_ENV)
        deep = root / ("d" * (seams.MAX_BASE_BYTES - len(str(root))))
        deep.mkdir()
        monkeypatch.setattr(tempfile, "tempdir", str(deep))
        assert seams.ipc_sockets_in_owned_folder() is None
        assert seams.IPC_BASE_ENV not in os.environ and list(deep.iterdir()) == []
    finally:
        shutil.rmtree(root, ignore_errors=True)
