"""The few CUDA driver calls the GPU-driven hop needs, through ctypes (no extra package).

- stream memory operations: `cuStreamWaitValue32` (the *stream* waits until a 32-bit word is
  at least a value, or has any bit of a mask; the host does not) and `cuStreamWriteValue32` (a
  word written in stream order, by default after a memory barrier, so rows copied before it are
  visible first). Both can be captured in CUDA graphs;
- `cuMemcpyDtoDAsync` on one stream (torch's cross-device `copy_` also makes the other device's
  stream wait, which a graph capture refuses) and `cuMemsetD32Async`;
- CUDA IPC: `cuIpcGetMemHandle` / `cuIpcOpenMemHandle` / `cuIpcCloseMemHandle`, and
  `cuMemGetAddressRange` to find the allocation a torch tensor lives in (an IPC handle names a
  whole allocation; the peer adds the tensor's offset);
- a non-blocking stream of its own, for the host watchdog's poison writes: it must run while
  the compute stream is parked in a wait;
- timing events (`cuEventRecord` / `cuEventQuery` / `cuEventElapsedTime`) for each step's start
  and end (vllm_ext.exchange.gpu_events).

Imported only on CUDA machines (libcuda.so.1 must load). Every call checks its CUresult and
raises CudaDriverError naming the call.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

IPC_HANDLE_BYTES = 64
WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ
WAIT_AND = 0x2  # CU_STREAM_WAIT_VALUE_AND: until (word & value) != 0
WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: a memory barrier before the write
WRITE_NO_BARRIER = 0x1  # CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER
IPC_LAZY_PEER_ACCESS = 0x1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
STREAM_NON_BLOCKING = 0x1  # CU_STREAM_NON_BLOCKING
EVENT_DEFAULT = 0x0  # CU_EVENT_DEFAULT: a timing event
NOT_READY = 600  # CUDA_ERROR_NOT_READY


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed; the message names the call and its CUresult."""


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


class CudaDriver:
    """libcuda's calls used here; one per process (``driver()``)."""

    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise CudaDriverError(f"the CUDA driver (libcuda.so.1) does not load: {exc}") from None
        u64, u32, ptr, size = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t
        self._wait = self._fn(lib, "cuStreamWaitValue32", [ptr, u64, u32, ctypes.c_uint], "_v2")
        self._write = self._fn(lib, "cuStreamWriteValue32", [ptr, u64, u32, ctypes.c_uint], "_v2")
        self._copy = self._fn(lib, "cuMemcpyDtoDAsync", [u64, u64, size, ptr], "_v2")
        self._memset = self._fn(lib, "cuMemsetD32Async", [u64, ctypes.c_uint, size, ptr])
        self._dtoh = self._fn(lib, "cuMemcpyDtoH", [ptr, u64, size], "_v2")
        self._range = self._fn(
            lib,
            "cuMemGetAddressRange",
            [ctypes.POINTER(u64), ctypes.POINTER(size), u64],
            "_v2",
        )
        self._ipc_get = self._fn(lib, "cuIpcGetMemHandle", [ctypes.POINTER(_IpcHandle), u64])
        self._ipc_open = self._fn(
            lib, "cuIpcOpenMemHandle", [ctypes.POINTER(u64), _IpcHandle, ctypes.c_uint], "_v2"
        )
        self._ipc_close = self._fn(lib, "cuIpcCloseMemHandle", [u64])
        self._stream_create = self._fn(lib, "cuStreamCreate", [ctypes.POINTER(ptr), ctypes.c_uint])
        self._stream_query = self._fn(lib, "cuStreamQuery", [ptr])
        # The event calls return at once: called with the interpreter lock held (PyDLL), so
        # that a step's records and queries never hand the lock to another thread of the
        # engine (a CDLL call releases and retakes it; the H200 host measured the watchdog's
        # round five times as long, waiting to get the lock back).
        held = ctypes.PyDLL("libcuda.so.1")
        self._event_create = self._fn(held, "cuEventCreate", [ctypes.POINTER(ptr), ctypes.c_uint])
        self._event_record = self._fn(held, "cuEventRecord", [ptr, ptr])
        self._event_query = self._fn(held, "cuEventQuery", [ptr])
        self._event_elapsed = self._fn(
            held, "cuEventElapsedTime", [ctypes.POINTER(ctypes.c_float), ptr, ptr], "_v2"
        )
        self._event_destroy = self._fn(held, "cuEventDestroy", [ptr], "_v2")
        self._get_error = lib.cuGetErrorString
        self._get_error.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    @staticmethod
    def _fn(lib: Any, name: str, argtypes: list[Any], suffix: str = "") -> Any:
        for candidate in (f"{name}{suffix}", name) if suffix else (name,):
            fn = getattr(lib, candidate, None)
            if fn is not None:
                fn.restype = ctypes.c_int
                fn.argtypes = argtypes
                return fn
        raise CudaDriverError(f"the CUDA driver has no {name}")

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            text = ctypes.c_char_p()
            self._get_error(result, ctypes.byref(text))
            name = text.value.decode() if text.value else "unknown error"
            raise CudaDriverError(f"{what} failed: CUresult {result} ({name})")

    # -- stream-ordered operations (capturable) -----------------------------------------------
    def wait_geq(self, stream: int, addr: int, value: int) -> None:
        self._check(self._wait(stream, addr, value, WAIT_GEQ), "cuStreamWaitValue32")

    def wait_any_bit(self, stream: int, addr: int, mask: int) -> None:
        self._check(self._wait(stream, addr, mask, WAIT_AND), "cuStreamWaitValue32")

    def write(self, stream: int, addr: int, value: int, barrier: bool = True) -> None:
        # CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER is refused (invalid argument) by the H200
        # machines' driver: every write keeps the barrier (`barrier` says whether it needs it).
        del barrier
        self._check(self._write(stream, addr, value, WRITE_DEFAULT), "cuStreamWriteValue32")

    def copy(self, stream: int, dst: int, src: int, nbytes: int) -> None:
        self._check(self._copy(dst, src, nbytes, stream), "cuMemcpyDtoDAsync")

    def memset32(self, stream: int, addr: int, value: int, words: int) -> None:
        self._check(self._memset(addr, value, words, stream), "cuMemsetD32Async")

    # -- host side ----------------------------------------------------------------------------
    def read_words(self, addr: int, words: int) -> list[int]:
        """A synchronous read of `words` 32-bit words (device or IPC-mapped memory)."""
        buf = (ctypes.c_uint32 * words)()
        dst = ctypes.cast(buf, ctypes.c_void_p)
        self._check(self._dtoh(dst, addr, 4 * words), "cuMemcpyDtoH")
        return list(buf)

    def allocation_of(self, addr: int) -> tuple[int, int]:
        """(base, size) of the allocation holding `addr`."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._check(
            self._range(ctypes.byref(base), ctypes.byref(size), addr), "cuMemGetAddressRange"
        )
        return int(base.value), int(size.value)

    def ipc_handle(self, base: int) -> bytes:
        handle = _IpcHandle()
        self._check(self._ipc_get(ctypes.byref(handle), base), "cuIpcGetMemHandle")
        return bytes(handle)  # all 64 bytes (the field itself would stop at a NUL byte)

    def ipc_open(self, handle: bytes) -> int:
        if len(handle) != IPC_HANDLE_BYTES:
            raise CudaDriverError(
                f"a CUDA IPC handle is {IPC_HANDLE_BYTES} bytes, got {len(handle)}"
            )
        raw = _IpcHandle.from_buffer_copy(handle)
        ptr = ctypes.c_uint64()
        self._check(
            self._ipc_open(ctypes.byref(ptr), raw, IPC_LAZY_PEER_ACCESS), "cuIpcOpenMemHandle"
        )
        return int(ptr.value)

    def ipc_close(self, ptr: int) -> None:
        self._check(self._ipc_close(ptr), "cuIpcCloseMemHandle")

    def non_blocking_stream(self) -> int:
        stream = ctypes.c_void_p()
        self._check(
            self._stream_create(ctypes.byref(stream), STREAM_NON_BLOCKING), "cuStreamCreate"
        )
        return int(stream.value or 0)

    def _done(self, result: int, what: str) -> bool:
        """A query's answer: False while its work is pending, raises on an error."""
        if result == NOT_READY:
            return False
        self._check(result, what)
        return True

    def stream_idle(self, stream: int) -> bool:
        return self._done(self._stream_query(stream), "cuStreamQuery")

    # -- timing events (the GPU-driven steps' start and end; one driver call each, where
    # torch.cuda.Event's record also builds a Stream object per call) -------------------------
    def event_create(self) -> int:
        event = ctypes.c_void_p()
        self._check(self._event_create(ctypes.byref(event), EVENT_DEFAULT), "cuEventCreate")
        return int(event.value or 0)

    def event_record(self, event: int, stream: int) -> None:
        self._check(self._event_record(event, stream), "cuEventRecord")

    def event_done(self, event: int) -> bool:
        return self._done(self._event_query(event), "cuEventQuery")

    def event_elapsed_ms(self, start: int, end: int) -> float:
        ms = ctypes.c_float()
        self._check(self._event_elapsed(ctypes.byref(ms), start, end), "cuEventElapsedTime")
        return float(ms.value)

    def event_destroy(self, event: int) -> None:
        self._check(self._event_destroy(event), "cuEventDestroy")


_driver: CudaDriver | None = None
_lock = threading.Lock()


def driver() -> CudaDriver:
    global _driver
    with _lock:
        if _driver is None:
            _driver = CudaDriver()
        return _driver


def write_flag(cuda: Any, stream: int, addr: int, value: int, barrier: bool, how: str) -> None:
    """One flag word raised or reset on `stream`, as AFD_DATA_GPU_FLAG_WRITES says (`how`)."""
    if how == "memset":
        cuda.memset32(stream, addr, value, 1)
    else:
        cuda.write(stream, addr, value, barrier)
