"""A `vllm serve` with AFD settings that cannot start ends with one line that says why, last.

What an operator can fix (afd-ctl not answering, refused credentials, another model on the
other side, a bad setting) is raised by this project's code, often in a process vLLM started:
the attention role registers from the engine's worker process, and vLLM carries only "Engine
core initialization failed. See root cause above." to the API server, after about 140 lines of
tracebacks. So:

- Flag errors (`--afd-controller localhost`, `--afd-role` without a controller) are one
  argparse-style line before anything starts (`flag_error`, exit 2).
- The attention role first asks afd-ctl, from the API server process, whether it answers
  (`check_controller`), so a missing or wrong daemon is one line instead of an engine start.
- Any later start-up failure of ours in an engine or worker process is noted by a logging
  filter (vLLM logs a failed start with its exception: compat.engine_core.STARTUP_FAILURE_LOGGER)
  into a file the API server names in AFD_STARTUP_REASON_FILE, and vLLM's "... failed to
  start." records are then one line each that names it, not tracebacks (VLLM_LOGGING_LEVEL=DEBUG
  keeps them); `said_last` then ends the API server with that reason as its last line (exit 1),
  after vLLM's own output.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from vllm_ext.config import AfdConfig

log = logging.getLogger(__name__)

REASON_ENV = "AFD_STARTUP_REASON_FILE"
# Packages whose exceptions are this project's reasons (their files, by path).
_OURS = tuple(
    str(Path(__file__).resolve().parent.parent / package) + os.sep
    for package in ("vllm_ext", "afd_ctl", "afd_data")
)
# Exception types that say what to fix when one of our modules raised them.
_FIXABLE = (ValueError, TimeoutError, NotImplementedError, FileNotFoundError, PermissionError)


def is_ours(exc: BaseException) -> bool:
    """An error this project raised for the operator to act on."""
    from afd_ctl.errors import AfdError
    from vllm_ext.control import AfdCredentialsRefused

    if isinstance(exc, (AfdError, AfdCredentialsRefused)):
        return True
    if not isinstance(exc, _FIXABLE):
        return False
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_filename.startswith(_OURS)


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def say(line: str) -> None:
    """One line on stderr as it is: to the file descriptor, past vLLM's process prefix
    ("(APIServer pid=N) ", which vLLM 0.26 puts on what Python writes to sys.stderr)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(2, (line.rstrip("\n") + "\n").encode(errors="replace"))


def flag_error(exc: BaseException, prog: str = "vllm serve") -> NoReturn:
    """As argparse says a bad flag: one line on stderr, exit status 2."""
    say(f"{prog}: error: {one_line(exc)}")
    raise SystemExit(2)


def check_controller(afd: AfdConfig) -> None:
    """Before vLLM starts an engine: afd-ctl answers with these credentials (bounded by
    connect_timeout_s; refused_timeout_s when nothing listens), else the error that says so."""
    from vllm_ext.control import ControlAccess, expected_counts

    expected_counts(ControlAccess.of(afd), afd.connect_timeout_s)


@contextlib.contextmanager
def said_last() -> Iterator[None]:
    """Around a `vllm serve` (or the FFN role's run): a start-up failure of ours, in this
    process or one it started, ends it with `error: <reason>` as the last line (exit 1)
    instead of vLLM's traceback. Anything else is raised as it was."""
    path = Path(tempfile.gettempdir()) / f"afd-start-{os.getpid()}-{os.urandom(4).hex()}.txt"
    before = os.environ.get(REASON_ENV)
    os.environ[REASON_ENV] = str(path)  # the engine and worker processes inherit it
    try:
        yield
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        reason = _read(path) or (one_line(exc) if is_ours(exc) else None)
        if reason is None:
            raise
        log.debug("afd: start-up failed", exc_info=True)
        say(f"error: {reason}")
        raise SystemExit(1) from None
    finally:
        if before is None:
            os.environ.pop(REASON_ENV, None)
        else:
            os.environ[REASON_ENV] = before
        path.unlink(missing_ok=True)


def note(reason: str) -> None:
    """Keeps the first reason for the API server (no-op outside a `said_last` run)."""
    target = os.environ.get(REASON_ENV)
    if not target:
        return
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:  # another process said it first, or the folder is gone
        return
    with os.fdopen(fd, "w") as f:
        f.write(reason)


class _FirstFailure(logging.Filter):
    """On vLLM's "... failed to start." records (a worker's or engine core's failed start;
    later failures, such as a failed step, are not start-up reasons): notes the first exception
    of ours, and once a reason of ours is known (from this process or another) logs the record
    as one line that names it instead of vLLM's traceback through our code and its own (kept
    with VLLM_LOGGING_LEVEL=DEBUG). A filter on the handlers vLLM configured, so that it runs
    before they format the record (_Noted notes where there are none)."""

    def __init__(self, phrase: str) -> None:
        super().__init__()
        self.phrase = phrase

    def noted(self, record: logging.LogRecord) -> bool:
        """Whether `record` is vLLM's "... failed to start." with an exception; notes that
        exception if it is ours."""
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None or self.phrase not in str(record.msg):
            return False
        if is_ours(exc):
            note(one_line(exc))
        return True

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.noted(record):
            return True
        reason = _read(Path(os.environ.get(REASON_ENV, "")))
        if reason is None or logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            return True
        record.msg = f"{record.getMessage().rstrip('.')}: {reason}"
        record.args, record.exc_info, record.exc_text = (), None, None
        # An engine core re-raises its failure to multiprocessing, which prints it with its
        # stack; the process ends there, so only the exception's own line is left.
        sys.tracebacklimit = 0
        return True


class _Noted(logging.Handler):
    """Notes the reason where no handler vLLM configured saw the record (it is then as it was
    logged; none of vLLM's handlers shortened it)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)

    def emit(self, record: logging.LogRecord) -> None:
        if _FILTER is not None:
            _FILTER.noted(record)


_FILTER: _FirstFailure | None = None


def watch_this_process() -> None:
    """In every process of a `said_last` run (the plugin loads in each, after vLLM configured
    its logging): our start-up failures that vLLM logs are noted and said in one line.
    Idempotent; a no-op elsewhere."""
    global _FILTER
    if not os.environ.get(REASON_ENV):
        return
    from vllm_ext import compat

    seams = compat.seams()
    if _FILTER is None:
        _FILTER = _FirstFailure(seams.STARTUP_FAILURE_PHRASE)
    for name in ("", seams.STARTUP_FAILURE_LOGGER):
        logger = logging.getLogger(name)
        for handler in logger.handlers:
            if _FILTER not in handler.filters and not isinstance(handler, _Noted):
                handler.addFilter(_FILTER)
        if not any(isinstance(h, _Noted) for h in logger.handlers):
            logger.addHandler(_Noted())


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None
