"""The end-to-end demo: afd-ctl, an FFN server and an attention server on a tiny DeepSeek-V2.

    python -m vllm_ext.testing.demo [--workdir DIR | --keep]   (make demo [DEMO_DIR=DIR | KEEP=1])

Builds the tiny model (real-scale random weights, no hub), starts `afd-ctl serve`,
`vllm serve --afd-role ffn`, `vllm serve --afd-role attention`, sends one OpenAI completion,
prints the answer and `afd-ctl status`, then stops the attention server (which makes the FFN
server exit) and the daemon. Every process is in its own session and killed on any failure.
Model and logs go to --workdir DIR, which is kept; without it, to a temporary folder, kept
and named at the end with --keep (or AFD_DEMO_KEEP=1) and after a run that fails, else removed
(and the last line says so and how to keep it): no path is printed that is gone afterwards.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vllm_ext.testing.procs import (
    bin_path,
    ffn_argv,
    free_port,
    post_json,
    serve_argv,
    vllm_env,
    wait_http_ok,
)
from vllm_ext.testing.tiny_deepseek import build_tiny_deepseek

LISTEN_RE = re.compile(r"afd-ctl listening on (\S+)")


class Child:
    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.name, self.log = name, log
        self._file = open(log, "ab")  # noqa: SIM115 (closed in stop)
        self.popen = subprocess.Popen(
            argv,
            stdout=self._file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **env},
            start_new_session=True,
        )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, regex: re.Pattern[str], timeout_s: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = regex.search(self.text())
            if match:
                return match
            if self.popen.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"{self.name}: {regex.pattern!r} not seen; log {self.log}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30) -> int | None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, sig)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)
        self._file.close()
        return self.popen.returncode


def readable(text: str) -> str:
    """`text` on one line: bytes that do not make whole characters (U+FFFD) and control
    characters as '?', quoted so leading and trailing spaces show."""
    shown = "".join(c if c.isprintable() and c != "\ufffd" else "?" for c in text)
    return f"'{shown}'"


def step(message: str) -> None:
    print(f"==> {message}", flush=True)


def run(workdir: Path, keep: bool = True) -> int:
    children: list[Child] = []
    # vLLM leaves a vllm_dist_* file store in the temporary folder (its IPC sockets go to the
    # attention server's own folder, compat.ipc_sockets); the servers get one of their own,
    # removed at the end.
    scratch = Path(tempfile.mkdtemp(prefix="afd-demo-tmp-"))
    env = {**vllm_env(), "TMPDIR": str(scratch)}
    try:
        step("building the tiny DeepSeek-V2 (hidden 256, 4 layers, 8 experts + 1 shared)")
        model = build_tiny_deepseek(workdir / "tiny-deepseek-v2", version=2)

        step("starting afd-ctl (1 attention : 1 FFN)")
        daemon = Child(
            "afd-ctl",
            [
                bin_path("afd-ctl"),
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--expect-attention",
                "1",
                "--expect-ffn",
                "1",
            ],
            workdir / "afd-ctl.log",
            env,
        )
        children.append(daemon)
        controller = daemon.wait_for(LISTEN_RE, 30).group(1)
        print(f"    afd-ctl at {controller}")

        step("starting the FFN server: vllm serve --afd-role ffn")
        ffn = Child("ffn", ffn_argv(model, controller), workdir / "ffn.log", env)
        children.append(ffn)

        port = free_port()
        step(f"starting the attention server: vllm serve --afd-role attention (port {port})")
        attention = Child(
            "attention",
            serve_argv(model, port, "--afd-role", "attention", "--afd-controller", controller),
            workdir / "attention.log",
            env,
        )
        children.append(attention)
        t0 = time.monotonic()
        wait_http_ok(f"http://127.0.0.1:{port}/health", 240, attention.popen)
        print(f"    healthy after {time.monotonic() - t0:.0f} s")

        prompt = "The capital of France is"
        step(f"one completion: {prompt!r}")
        reply = post_json(
            f"http://127.0.0.1:{port}/v1/completions",
            {
                "model": str(model),
                "prompt": prompt,
                "max_tokens": 16,
                "temperature": 0,
                "return_token_ids": True,
            },
        )
        choice = reply["choices"][0]
        print(f"    text:      {readable(choice['text'])}")
        print(f"    token ids: {choice.get('token_ids')}")
        print(
            "    The weights are random, so the text is nonsense (and pieces of characters show "
            "as '?'). That AFD's tokens equal a colocated run's is what `make test` checks "
            "(tests/test_vllm_afd.py), not this demo."
        )

        step("afd-ctl status")
        status = subprocess.run(
            [bin_path("afd-ctl"), "status", "--controller", controller],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, **env},
        )
        print(status.stdout.rstrip())
        print(
            "    (the epoch starts at the daemon's start time in wall-clock milliseconds and "
            "goes up by one per membership change)"
        )

        step("stopping the attention server (it tells the FFN server to stop)")
        print(f"    attention exited {attention.stop()}")
        ffn.popen.wait(30)
        print(f"    ffn exited {ffn.stop()}")
        print(f"    afd-ctl exited {daemon.stop()}")
        step(f"done; model and logs in {workdir}" if keep else "done")
        return 0
    except Exception as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        for child in children:
            print(f"--- {child.name} ({child.log}) ---", file=sys.stderr)
            print("\n".join(child.text().splitlines()[-25:]), file=sys.stderr)
        print(f"demo failed; its logs are kept in {workdir}", file=sys.stderr)
        return 1
    finally:
        for child in reversed(children):
            child.stop(signal.SIGKILL, 5)
        shutil.rmtree(scratch, ignore_errors=True)


KEEP_ENV = "AFD_DEMO_KEEP"
HOW_TO_KEEP = "`make demo KEEP=1` (or --keep) keeps them, `make demo DEMO_DIR=DIR` puts them in DIR"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="", help="keep model and logs here")
    parser.add_argument(
        "--keep",
        action="store_true",
        default=os.environ.get(KEEP_ENV, "") not in ("", "0"),
        help=f"keep the temporary folder of model and logs and name it at the end ({KEEP_ENV}=1)",
    )
    args = parser.parse_args()
    if args.workdir:
        workdir = Path(args.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
    else:
        workdir = Path(tempfile.mkdtemp(prefix="afd-demo-"))
    keep = bool(args.workdir) or args.keep
    code = 130  # Ctrl-C (or anything else run() does not catch)
    try:
        code = run(workdir, keep=keep)
    except KeyboardInterrupt:
        print("demo interrupted", file=sys.stderr)
    finally:
        if code == 1 or keep:  # a failed run keeps its logs; run() said where
            if code == 130:
                print(f"model and logs in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
            step(f"model and logs were in a temporary folder, now removed; {HOW_TO_KEEP}")
    sys.exit(code)


if __name__ == "__main__":
    main()
