"""What weights a worker serves, as one short digest that both roles of one checkpoint share.

afd-ctl refuses to pair an attention server and an FFN server whose model fingerprints differ
(afd_ctl.fingerprint). Architecture, sizes and dtype do not tell a checkpoint from another of
the same config (another seed, a fine-tune, another revision): paired, they serve wrong text
without a word. So the fingerprint's `weights_digest` covers what vLLM reads on either role,
the same files on both (the attention side skips the FFN tensors, the FFN side the others, yet
both go through every shard):

    "<layout>-<content>"   layout: sha256 of config.json (parsed, canonical) and, per shard,
                           its tensors' names, dtypes and shapes (the safetensors headers);
                           content: sha256 over the shards' bytes (each shard hashed in
                           BLOCK_BYTES blocks on a few threads, the block digests hashed)

12 + 16 hex digits. Same layout with another content: same tensors, other values. The
`weights_digest` setting "headers" hashes the headers only (no content part; cheap, blind to
values); "dummy" is the digest of `--load-format dummy` (nothing read); "" where no local
files are found (nothing is compared then).

Hashing costs a read of the whole checkpoint at start-up (measured: README, "Bad input"), so
each shard's digest is cached by its identity (resolved path, size, mtime): in this process,
and on disk in the `weights_digest_cache` folder (default ~/.cache/afd-ctl/weights-digest),
one small JSON file per shard; a folder that cannot be written only costs the cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

log = logging.getLogger(__name__)

MODES = ("content", "headers")
BLOCK_BYTES = 64 << 20
READ_BYTES = 8 << 20
MAX_THREADS = 8
# A safetensors header larger than this is not one (the format caps it at 100 MB).
MAX_HEADER_BYTES = 100_000_000
DEFAULT_CACHE = Path.home() / ".cache" / "afd-ctl" / "weights-digest"


class Shard(NamedTuple):
    """One weight file's identity, as the cache keys it."""

    path: str  # resolved
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> Shard:
        resolved = path.resolve()
        st = resolved.stat()
        return cls(str(resolved), st.st_size, st.st_mtime_ns)


_MEMO: dict[Shard, dict[str, str]] = {}


def model_weights_digest(vllm_config: Any) -> str:
    """The digest of what this worker loads, from vLLM's config (its model, revision and load
    format) and the AFD settings (`weights_digest`, `weights_digest_cache`)."""
    from vllm_ext.config import from_vllm_config

    afd = from_vllm_config(vllm_config)
    mode = afd.weights_digest if afd is not None else MODES[0]
    folder_setting = afd.weights_digest_cache if afd is not None else ""
    cache = Path(folder_setting) if folder_setting else DEFAULT_CACHE
    model_config = vllm_config.model_config
    fmt = getattr(vllm_config.load_config, "load_format", "auto")
    load_format = str(getattr(fmt, "value", fmt))
    if load_format == "dummy":
        return "dummy"
    folder = local_folder(str(model_config.model), getattr(model_config, "revision", None))
    if folder is None:
        log.info("afd: no local files for %s: its weights are not compared", model_config.model)
        return ""
    return checkpoint_digest(folder, load_format=load_format, mode=mode, cache=cache)


def local_folder(model: str, revision: str | None = None) -> Path | None:
    """The checkpoint's folder: `model` itself, or its copy in the Hugging Face cache."""
    if Path(model).is_dir():
        return Path(model)
    if Path(model).is_file():  # a single-file checkpoint (GGUF)
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:  # not a hub name, or not downloaded: nothing local to read
        return None


def weight_files(folder: Path, load_format: str = "auto") -> list[Path]:
    """The files vLLM reads for this load format: the shards a safetensors index names (all
    *.safetensors without one), else PyTorch *.bin / *.pt files; a file path is itself."""
    if folder.is_file():
        return [folder]
    if load_format in ("auto", "safetensors", "fastsafetensors", "runai_streamer"):
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [folder / name for name in names]
        found = sorted(folder.glob("*.safetensors"))
        if found or load_format != "auto":
            return found
    return sorted(p for p in folder.iterdir() if p.suffix in (".bin", ".pt") and p.is_file())


def checkpoint_digest(
    folder: Path, *, load_format: str = "auto", mode: str = "content", cache: Path | None = None
) -> str:
    """'<layout>-<content>' (mode "content") or '<layout>-headers-only' (mode "headers")."""
    if mode not in MODES:
        raise ValueError(f"afd weights_digest must be one of {MODES}, got {mode!r}")
    started = time.monotonic()
    files = weight_files(folder, load_format)
    layout = hashlib.sha256()
    config = (folder if folder.is_dir() else folder.parent) / "config.json"
    if config.is_file():
        layout.update(json.dumps(json.loads(config.read_text()), sort_keys=True).encode())
    if not files:
        return layout.hexdigest()[:12] + "-no-weights" if config.is_file() else ""
    shards = [Shard.of(f) for f in files]
    known = {s: _cached(s, cache) for s in shards}
    todo = [s for s in shards if not _complete(known[s], mode)]
    hashed = _digest_shards(todo, with_content=mode == "content")
    for shard, fresh in hashed.items():
        known[shard] = fresh
        _store(shard, fresh, cache)
    content = hashlib.sha256()
    for shard, path in zip(shards, files, strict=True):
        entry = known[shard]
        assert entry is not None
        layout.update(f"{path.name}\0{entry['layout']}\0".encode())
        if mode == "content":
            content.update(f"{path.name}\0{entry['content']}\0".encode())
    took = time.monotonic() - started
    if hashed:
        size = sum(s.size for s in todo)
        rate = size / 1e9 / max(took, 1e-9)
        cached = len(shards) - len(todo)
        log.info(
            "afd: weights digest over %d file(s): hashed %.2f GB in %.1f s (%.2f GB/s), "
            "%d from the cache",
            len(shards),
            size / 1e9,
            took,
            rate,
            cached,
        )
    tail = content.hexdigest()[:16] if mode == "content" else "headers-only"
    return f"{layout.hexdigest()[:12]}-{tail}"


def _complete(entry: dict[str, str] | None, mode: str) -> bool:
    return entry is not None and (mode != "content" or "content" in entry)


def safetensors_layout(path: str) -> str:
    """sha256 of a safetensors file's tensor names, dtypes and shapes ("" for another kind of
    file: its content hash covers it)."""
    if not path.endswith(".safetensors"):
        return ""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return ""
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: not a safetensors file (header of {length} bytes)")
        header = json.loads(f.read(length))
    tensors = sorted(
        (name, t["dtype"], list(t["shape"])) for name, t in header.items() if name != "__metadata__"
    )
    return hashlib.sha256(json.dumps(tensors).encode()).hexdigest()


def _digest_shards(shards: list[Shard], *, with_content: bool) -> dict[Shard, dict[str, str]]:
    """Each shard's layout and (with_content) its block-wise content hash, the blocks of every
    shard spread over a few threads (hashlib releases the GIL while it hashes)."""
    if not shards:
        return {}
    out = {s: {"layout": safetensors_layout(s.path)} for s in shards}
    if not with_content:
        return out
    blocks = [(s, offset) for s in shards for offset in range(0, max(s.size, 1), BLOCK_BYTES)]
    threads = max(1, min(MAX_THREADS, os.cpu_count() or 1, len(blocks)))
    with ThreadPoolExecutor(threads, thread_name_prefix="afd-weights-digest") as pool:
        digests = list(pool.map(lambda b: _block_digest(b[0].path, b[1]), blocks))
    per_shard: dict[Shard, Any] = {s: hashlib.sha256(str(s.size).encode()) for s in shards}
    for (shard, _), digest in zip(blocks, digests, strict=True):
        per_shard[shard].update(digest)
    for shard, h in per_shard.items():
        out[shard]["content"] = h.hexdigest()
    return out


def _block_digest(path: str, offset: int) -> bytes:
    h = hashlib.sha256()
    buffer = bytearray(READ_BYTES)
    view = memoryview(buffer)
    left = BLOCK_BYTES
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        while left > 0:
            n = f.readinto(view[: min(READ_BYTES, left)])
            if not n:
                break
            h.update(view[:n])
            left -= n
    return h.digest()


def _cache_file(shard: Shard, cache: Path) -> Path:
    return cache / (hashlib.sha256(shard.path.encode()).hexdigest()[:32] + ".json")


def _cached(shard: Shard, cache: Path | None) -> dict[str, str] | None:
    entry = _MEMO.get(shard)
    if entry is not None or cache is None:
        return entry
    try:
        stored = json.loads(_cache_file(shard, cache).read_text())
    except (OSError, ValueError):
        return None
    if [stored.get("path"), stored.get("size"), stored.get("mtime_ns")] != list(shard):
        return None  # the file changed since: hash it again
    entry = {k: stored[k] for k in ("layout", "content") if k in stored}
    _MEMO[shard] = entry
    return entry


def _store(shard: Shard, entry: dict[str, str], cache: Path | None) -> None:
    _MEMO[shard] = entry
    if cache is None:
        return
    target = _cache_file(shard, cache)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**shard._asdict(), **entry}))
        os.replace(tmp, target)  # atomic: a process beside this one reads all or nothing
    except OSError as exc:
        log.debug("afd: weights digest cache %s not written: %s", cache, exc)
