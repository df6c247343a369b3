"""Device memory behind the transport: host DRAM through numpy, or GPU VRAM through torch.

The transport code is the same for both; only this module knows numpy from torch. torch is
imported only for a CUDA device, so CPU-only machines need numpy alone. bfloat16 on numpy is
raw 2-byte words (``uint16``; an ``ml_dtypes.bfloat16`` array is accepted and viewed as such).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from afd_data.errors import AfdBadInput
from afd_data.gpu_protocol import GpuEndpoint

logger = logging.getLogger(__name__)

Array = Any  # numpy.ndarray on "cpu", torch.Tensor on "cuda[:N]"

_NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    "bfloat16": np.dtype(np.uint16),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
}
_PAGE = 4096
_FLAG_ALIGN = 256


def host_id() -> str:
    """Names what the GPU hop's path choice calls a host: workers with the same id can map each
    other's CUDA memory. The kernel's boot id and this process's IPC namespace (two containers
    on one node map each other's memory only when they share it, e.g. Kubernetes hostIPC).
    AFD_DATA_HOST_ID overrides it (e.g. to keep a test's "hosts" apart)."""
    override = os.environ.get("AFD_DATA_HOST_ID")
    if override:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        import socket

        boot = socket.gethostname()
    try:
        ipc = os.readlink("/proc/self/ns/ipc")
    except OSError:
        ipc = "ipc:unknown"
    return f"{boot}/{ipc}"


def _shape_error(
    what: str, got: tuple[int, ...], rows: int, cols: int, hint: Callable[[], str]
) -> AfdBadInput:
    return AfdBadInput(
        f"{what}: shape {tuple(got)} but this step expects ({rows}, {cols}); {hint()}"
    )


class HostMemory:
    """Host DRAM in one page-aligned numpy buffer (NIXL memory type DRAM)."""

    mem_type = "DRAM"
    device_id = 0
    label = "cpu"

    def __init__(self) -> None:
        self._buf: np.ndarray | None = None

    def allocate(self, nbytes: int, extra_bytes: int = 0) -> int:
        """`extra_bytes`: room for the GPU hop's flag words, which host memory never uses."""
        raw = np.zeros(nbytes + _PAGE, dtype=np.uint8)  # zeroed: touches every page up front
        skip = (-raw.__array_interface__["data"][0]) % _PAGE
        self._buf = raw[skip : skip + nbytes]
        return self.data_ptr(self._buf)

    def view(self, offset: int, rows: int, cols: int, dtype: str) -> np.ndarray:
        assert self._buf is not None
        np_dtype = _NUMPY_DTYPES[dtype]
        return (
            self._buf[offset : offset + rows * cols * np_dtype.itemsize]
            .view(np_dtype)
            .reshape(rows, cols)
        )

    def check(
        self, array: Array, rows: int, cols: int, dtype: str, what: str, hint: Callable[[], str]
    ) -> Array:
        """Returns ``array`` (bfloat16 viewed as uint16) or raises AfdBadInput naming the field;
        ``hint()`` says where the expected shape comes from (built only on error)."""
        if not isinstance(array, np.ndarray):
            raise AfdBadInput(
                f"{what}: expected a numpy array on device cpu, got {type(array).__name__}"
            )
        want = _NUMPY_DTYPES[dtype]
        if array.dtype != want:
            if dtype == "bfloat16" and array.dtype.name == "bfloat16":
                array = array.view(np.uint16)
            else:
                raise AfdBadInput(
                    f"{what}: dtype {array.dtype} but the transport is configured for {dtype}"
                    + (" (pass raw bfloat16 words as uint16)" if dtype == "bfloat16" else "")
                )
        if array.shape != (rows, cols):
            raise _shape_error(what, array.shape, rows, cols, hint)
        return array

    @staticmethod
    def data_ptr(array: Array) -> int:
        return int(array.__array_interface__["data"][0])

    @staticmethod
    def copy(dst: Array, src: Array) -> None:
        np.copyto(dst, src)

    def sync(self) -> None:
        """Host writes are visible at once."""

    def gpu_endpoint(self) -> GpuEndpoint | None:
        """Host memory takes no part in the GPU-driven hop."""
        return None


class CudaMemory:
    """GPU VRAM in one torch allocation (NIXL memory type VRAM)."""

    mem_type = "VRAM"

    def __init__(self, device: str):
        try:
            import torch
        except ImportError as e:
            raise AfdBadInput(
                f"device {device!r} needs torch with CUDA, which is not importable ({e}); "
                "use device='cpu' on machines without a GPU"
            ) from None
        if not torch.cuda.is_available():
            raise AfdBadInput(f"device {device!r}: torch sees no CUDA device")
        self._torch = torch
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.device_id = int(self.device.index)
        self.label = str(self.device)
        self._dtypes = {
            "bfloat16": torch.bfloat16,
            "float16": torch.float16,
            "float32": torch.float32,
            "int32": torch.int32,
            "int64": torch.int64,
        }
        self._buf: Any = None
        if "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").lower():
            logger.warning(
                "PYTORCH_CUDA_ALLOC_CONF enables expandable_segments: CUDA IPC cannot map such "
                "memory and UCX falls back to a slow path; unset it for the data plane"
            )

    def allocate(self, nbytes: int, extra_bytes: int = 0) -> int:
        """`nbytes` of data-plane buffer, then `extra_bytes` for the GPU hop's flag words (at
        `flags_ptr`), in one allocation so one CUDA IPC handle maps both."""
        self._flags_offset = -(-nbytes // _FLAG_ALIGN) * _FLAG_ALIGN
        total = self._flags_offset + extra_bytes
        self._buf = self._torch.zeros(total, dtype=self._torch.uint8, device=self.device)
        return int(self._buf.data_ptr())

    @property
    def flags_ptr(self) -> int:
        return int(self._buf.data_ptr()) + self._flags_offset

    def gpu_endpoint(self) -> GpuEndpoint | None:
        """The CUDA IPC handle of the allocation that holds the buffer, for peers on this host
        (None, with a warning, where the driver cannot export it: then NIXL only)."""
        from afd_data.cuda_driver import CudaDriverError, driver

        ptr = int(self._buf.data_ptr())
        try:
            cuda = driver()
            base, _ = cuda.allocation_of(ptr)
            handle = cuda.ipc_handle(base)
        except CudaDriverError as exc:
            logger.warning("data plane on %s: no GPU-driven hop (%s); NIXL only", self.label, exc)
            return None
        return GpuEndpoint(host_id(), handle, ptr - base, ptr - base + self._flags_offset)

    def tensor(self, ptr: int, rows: int, cols: int, dtype: str) -> Array:
        """A (rows, cols) view of this buffer at address `ptr` (inside it)."""
        offset = ptr - int(self._buf.data_ptr())
        return self.view(offset, rows, cols, dtype)

    def view(self, offset: int, rows: int, cols: int, dtype: str) -> Array:
        t_dtype = self._dtypes[dtype]
        nbytes = rows * cols * t_dtype.itemsize
        return self._buf[offset : offset + nbytes].view(t_dtype).view(rows, cols)

    def check(
        self, array: Array, rows: int, cols: int, dtype: str, what: str, hint: Callable[[], str]
    ) -> Array:
        if not isinstance(array, self._torch.Tensor):
            raise AfdBadInput(
                f"{what}: expected a torch tensor on {self.device}, got {type(array).__name__}"
            )
        if array.device != self.device:
            raise AfdBadInput(
                f"{what}: tensor is on {array.device}, the transport on {self.device}"
            )
        if array.dtype != self._dtypes[dtype]:
            raise AfdBadInput(
                f"{what}: dtype {array.dtype} but the transport is configured for {dtype}"
            )
        if tuple(array.shape) != (rows, cols):
            raise _shape_error(what, tuple(array.shape), rows, cols, hint)
        return array

    @staticmethod
    def data_ptr(array: Array) -> int:
        return int(array.data_ptr())

    @staticmethod
    def copy(dst: Array, src: Array) -> None:
        dst.copy_(src)

    def sync(self) -> None:
        """NIXL does not order with CUDA streams: finish the kernels that wrote (or still read)
        a buffer before a WRITE leaves or lands in it. (The device as an int: torch then skips
        parsing a torch.device on every send.)"""
        self._torch.cuda.current_stream(self.device_id).synchronize()


def make_memory(device: str) -> HostMemory | CudaMemory:
    """'cpu' -> host DRAM (numpy); 'cuda' or 'cuda:N' -> VRAM (torch)."""
    if device == "cpu":
        return HostMemory()
    if device == "cuda" or device.startswith("cuda:"):
        return CudaMemory(device)
    raise AfdBadInput(f"device {device!r} is not 'cpu', 'cuda' or 'cuda:N'")
