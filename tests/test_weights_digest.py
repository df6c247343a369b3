"""The model fingerprint's weights digest (issue 39, item 2; vllm_ext/weights_digest.py): equal
for two copies of one checkpoint, different for another seed of the same config (same layout,
other content) and for another layout; cached by file identity on disk; `--load-format dummy`
and the "headers" mode. Real tiny checkpoints, no vLLM engine (the refusal at registration
through `vllm serve` is tests/test_vllm_start_errors.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("safetensors", reason="the tiny models are written with safetensors")

from vllm_ext import weights_digest  # noqa: E402
from vllm_ext.weights_digest import checkpoint_digest, model_weights_digest  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from vllm_ext.testing.tiny_deepseek import build_tiny_deepseek

    root = tmp_path_factory.mktemp("digest-models")
    built = {
        "seed0": build_tiny_deepseek(root / "seed0", version=2, seed=0),
        "seed1": build_tiny_deepseek(root / "seed1", version=2, seed=1),
        "v3": build_tiny_deepseek(root / "v3", version=3, seed=0),
    }
    copy = root / "seed0-copy"
    shutil.copytree(built["seed0"], copy)
    built["copy"] = copy
    return built


@pytest.fixture(autouse=True)
def fresh_memo() -> None:
    weights_digest._MEMO.clear()


def test_same_checkpoint_same_digest_other_seed_or_layout_differs(
    models: dict[str, Path], tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    seed0 = checkpoint_digest(models["seed0"], cache=cache)
    assert seed0 == checkpoint_digest(models["copy"], cache=cache)
    seed1 = checkpoint_digest(models["seed1"], cache=cache)
    layout0, content0 = seed0.split("-")
    layout1, content1 = seed1.split("-")
    assert len(layout0) == 12 and len(content0) == 16
    assert layout0 == layout1 and content0 != content1  # same tensors, other values
    assert checkpoint_digest(models["v3"], cache=cache).split("-")[0] != layout0


def test_each_shard_is_hashed_once_and_again_when_it_changes(
    models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    model = tmp_path / "model"
    shutil.copytree(models["seed0"], model)
    first = checkpoint_digest(model, cache=cache)
    assert len(list(cache.glob("*.json"))) == 1
    weights_digest._MEMO.clear()  # a new process: only the disk cache is left

    def no_hashing(*args: object) -> bytes:
        raise AssertionError("hashed again although the shard did not change")

    monkeypatch.setattr(weights_digest, "_block_digest", no_hashing)
    assert checkpoint_digest(model, cache=cache) == first
    monkeypatch.undo()
    shard = model / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # one bit of the last tensor
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 1_000_000_000))
    changed = checkpoint_digest(model, cache=cache)
    assert changed != first and changed.split("-")[0] == first.split("-")[0]


def test_an_unwritable_cache_costs_only_the_cache(models: dict[str, Path], tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    assert checkpoint_digest(models["seed0"], cache=blocked / "cache") == checkpoint_digest(
        models["copy"], cache=None
    )


def _config(model: Path, load_format: str = "auto", **afd: str) -> SimpleNamespace:
    """The parts of a VllmConfig the digest reads."""
    section = {"role": "ffn", "controller": "127.0.0.1:1", **afd}
    return SimpleNamespace(
        model_config=SimpleNamespace(model=str(model), revision=None),
        load_config=SimpleNamespace(load_format=load_format),
        additional_config={"afd": section},
    )


def test_dummy_weights_headers_mode_and_no_local_files(
    models: dict[str, Path], tmp_path: Path
) -> None:
    cache = str(tmp_path / "cache")
    assert model_weights_digest(_config(models["seed0"], "dummy")) == "dummy"
    headers = model_weights_digest(
        _config(models["seed0"], weights_digest="headers", weights_digest_cache=cache)
    )
    assert headers.endswith("-headers-only")
    assert headers == model_weights_digest(
        _config(models["seed1"], weights_digest="headers", weights_digest_cache=cache)
    )  # blind to values, as documented
    full = model_weights_digest(_config(models["seed0"], weights_digest_cache=cache))
    assert full.split("-")[0] == headers.split("-")[0]
    assert model_weights_digest(_config(tmp_path / "no-such-model")) == ""
    with pytest.raises(ValueError, match="weights_digest must be content or headers"):
        model_weights_digest(_config(models["seed0"], weights_digest="fast"))
