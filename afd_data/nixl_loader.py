"""Imports NIXL's Python API without a needless torch import on CPU-only hosts.

NIXL's meta package picks its CUDA 12 or 13 wheel from torch's CUDA version. When torch is a
CPU build it imports all of torch (about 3 s on a small host) just to learn that; there the
choice is moot, so torch is held off for the duration of that one import. Where torch is
already imported, or is a CUDA build, NIXL is imported as it is.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def _torch_is_cpu_build() -> bool:
    """Reads torch/version.py from disk (without importing torch): no CUDA, no ROCm."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.origin:
        return False
    version_spec = importlib.util.spec_from_file_location(
        "_afd_torch_version", Path(spec.origin).parent / "version.py"
    )
    if version_spec is None or version_spec.loader is None:
        return False
    module = importlib.util.module_from_spec(version_spec)
    try:
        version_spec.loader.exec_module(module)
    except Exception:
        return False
    return getattr(module, "cuda", "") is None and getattr(module, "hip", "") is None


def import_nixl() -> tuple[ModuleType, ModuleType]:
    """Returns (nixl._api, nixl._bindings)."""
    if "nixl._api" not in sys.modules and "torch" not in sys.modules and _torch_is_cpu_build():
        sys.modules["torch"] = None  # type: ignore[assignment]
        try:
            importlib.import_module("nixl._api")
        finally:
            if "torch" in sys.modules and sys.modules["torch"] is None:
                del sys.modules["torch"]
    return importlib.import_module("nixl._api"), importlib.import_module("nixl._bindings")
