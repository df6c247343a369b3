"""Re-cuts the GPU kit (../shared/tools/gpu-vllm-kit/make_kit.sh's .kit/p1 .. p4) so that each
transfer fits the device tool's 64 MiB with this repository's tree beside it: the vllm wheel's
chunks (p1, p2 and the one in p3) are joined and cut again into four, part-00 .. part-03, the
first three alone in .kit/pa, pb, pc and the last beside p3's small wheels; p4 (NIXL) stays.
install.sh joins chunks by their sorted names and checks the joined wheel's sha256, so nothing
else changes. Five transfers, each starting with `mkdir -p /tmp/kit && cp -a .kit/. /tmp/kit/`:
pa with the scripts (install.sh gen.py gpu_test.sh tiny_model.py SHA256SUMS MANIFEST.txt and
py_spy.whl, if there), pb, pc, p3, then p4 (its call can run install.sh).

    python3 tests/gpu/recut_kit.py [.kit] [--tree-bytes N]   (from the repository root)
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
from pathlib import Path

LIMIT = 64 << 20  # what one device call carries, tree included
MARGIN = 256 << 10


def tree_bytes() -> int:
    """The bytes of the working tree that travel with every call (tracked files)."""
    files = subprocess.run(["git", "ls-files", "-z"], capture_output=True, check=True).stdout.split(
        b"\0"
    )
    return sum(os.path.getsize(f) for f in files if f and os.path.isfile(f))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kit", nargs="?", default=".kit")
    parser.add_argument("--tree-bytes", type=int, default=0, help="default: git ls-files' sum")
    args = parser.parse_args()
    kit = Path(args.kit)
    chunks = sorted(glob.glob(str(kit / "p*" / "vllm-*.whl.part-*")), key=lambda p: Path(p).name)
    if not chunks:
        raise SystemExit(f"{kit}: no vllm wheel chunks (run make_kit.sh first)")
    name = Path(chunks[0]).name.rsplit(".part-", 1)[0]
    data = b"".join(Path(c).read_bytes() for c in chunks)
    for c in chunks:
        os.remove(c)
    budget = LIMIT - (args.tree_bytes or tree_bytes()) - MARGIN
    smalls = sum(os.path.getsize(f) for f in glob.glob(str(kit / "p3" / "*.whl")))
    last = min(len(data), budget - smalls)
    head, tail = data[: len(data) - last], data[len(data) - last :]
    size = -(-len(head) // 3)
    pieces = [head[i * size : (i + 1) * size] for i in range(3)] + [tail]
    for folder, index in zip(("pa", "pb", "pc", "p3"), range(4), strict=True):
        (kit / folder).mkdir(exist_ok=True)
        (kit / folder / f"{name}.part-{index:02d}").write_bytes(pieces[index])
    for folder in ("p1", "p2"):
        if (kit / folder).is_dir() and not any((kit / folder).iterdir()):
            (kit / folder).rmdir()
    for folder in ("pa", "pb", "pc", "p3", "p4"):
        used = sum(f.stat().st_size for f in (kit / folder).iterdir())
        print(f"{folder}: {used / 2**20:.1f} MiB")
        if used > budget:
            raise SystemExit(f"{folder} is over the {budget / 2**20:.1f} MiB a transfer allows")


if __name__ == "__main__":
    main()
