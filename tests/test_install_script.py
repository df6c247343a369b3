"""The install the container images run (issue 38): deploy/docker/*.Dockerfile copy the build
context (the repository less .dockerignore) and run scripts/install_afd.sh. Images cannot be
built on these machines (no container runtime), so this runs that script on the same context:

- daemon mode into a fresh virtual environment (its dependencies from pip's configured index),
  then the installed `afd-ctl serve` answers its health check;
- plugin mode into an environment that has vLLM (what vLLM's own image is): a fresh virtual
  environment that sees this one's packages (vLLM, torch, NIXL) through a .pth file, so only
  the project is installed (without build isolation: the test needs no index), then vLLM's
  plugin lookup (the `vllm.general_plugins` entry points) finds the installed plugin there.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.procs import Proc

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path("scripts") / "install_afd.sh"


def build_context(dest: Path) -> Path:
    """The repository as `docker build .` sends it: .dockerignore's patterns left out."""
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def ignored(folder: str, names: list[str]) -> set[str]:
        rel = Path(folder).relative_to(ROOT)
        out = set()
        for name in names:
            path = (rel / name).as_posix()
            for pattern in patterns:
                bare = pattern.removeprefix("**/")
                if fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(name, bare):
                    out.add(name)
        return out

    shutil.copytree(ROOT, dest, ignore=ignored)
    return dest


def clean_env(**extra: str) -> dict[str, str]:
    """No PYTHONPATH: what runs must be what was installed, not this checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(extra)
    return env


def install(context: Path, mode: str, python: Path, **env: str) -> str:
    done = subprocess.run(
        ["bash", str(context / SCRIPT), mode, str(python)],
        cwd=context,  # as `docker build` runs it: next to the sources, which must not count
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout


@pytest.fixture(scope="module")
def context(tmp_path_factory: pytest.TempPathFactory) -> Path:
    context = build_context(tmp_path_factory.mktemp("image") / "src")
    assert not (context / ".git").exists() and not any(context.glob(".venv*"))
    assert (context / SCRIPT).is_file() and (context / "pyproject.toml").is_file()
    return context


@pytest.mark.timeout(600)
def test_the_daemon_image_install_gives_a_working_afd_ctl(
    context: Path, tmp_path: Path, procs: list[Proc]
) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    out = install(context, "daemon", venv / "bin" / "python")
    assert f"installed at {venv}" in out, out
    daemon = Proc(
        [str(venv / "bin" / "afd-ctl"), "serve", "--listen", "127.0.0.1:0"],
        tmp_path / "daemon.log",
        clean_env(),
    )
    procs.append(daemon)
    address = daemon.wait_for(r"afd-ctl listening on (\S+)", 30).group(1)
    status = subprocess.run(
        [str(venv / "bin" / "afd-ctl"), "status", "--controller", address],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode in (0, 3), status.stderr  # answers: NOT_SERVING, nobody registered
    assert "NOT_SERVING" in status.stdout, status.stdout


@pytest.mark.timeout(600)
def test_the_vllm_image_install_gives_vllm_the_plugin(context: Path, tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="the plugin mode needs vLLM in the environment")
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    site = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    # vLLM's image already holds vLLM, torch and the rest: here, this environment's packages.
    (site / "shared-vllm.pth").write_text(sysconfig.get_path("purelib") + "\n")
    python = venv / "bin" / "python"
    out = install(context, "plugin", python, AFD_PIP_ARGS="--no-build-isolation --no-index")
    assert re.search(r"vllm_ext plugin for vLLM 0\.(26|32)", out), out
    assert f"installed at {site}" in out, out
    # What vLLM does to find its plugins (vllm.plugins: the entry points of the group, each
    # loaded): the image's vLLM finds the installed plugin's register(), and the modules
    # register() and its seams import load from the install. That vLLM then calls it
    # and lists the --afd-* flags is test_vllm_plugin's (`vllm serve --help`, 10-20 s of a core).
    find = (
        "from importlib.metadata import entry_points\n"
        "found = {ep.name: ep for ep in entry_points(group='vllm.general_plugins')}\n"
        "register = found['afd'].load()\n"
        "import afd_ctl, sys, vllm_ext.compat, vllm_ext.hooks\n"
        "print(register.__module__, register.__name__, sys.modules[register.__module__].__file__)\n"
    )
    check = subprocess.run(
        [str(python), "-c", find],
        cwd=tmp_path,  # not this checkout's folder, which `-c` would put first on sys.path
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    module, name, path = (check.stdout.split() + ["", "", ""])[:3]
    assert (module, name) == ("vllm_ext", "register"), (check.stdout, check.stderr[-2000:])
    assert path.startswith(str(site)), (check.stdout, check.stderr[-2000:])
