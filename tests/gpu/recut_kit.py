"""Re-cuts the GPU kit (../shared/tools/gpu-vllm-kit/make_kit.sh's .kit/p1 .. p4) so that each
transfer fits the device tool's 64 MiB with this repository's tree beside it (8 MB and growing
with the committed results: NIXL's 59 MB wheel beside p4's small wheels no longer fits). Six
folders: the vllm wheel's chunks joined and cut again into four, part-00 .. part-03, alone in
.kit/pa, pb, pc and pe; every small wheel (p3's and p4's) in pd; NIXL's big wheel alone in pf.
install.sh joins chunks by their sorted names (any p* folder) and checks the joined wheel's
sha256, so nothing else changes. Six transfers, each starting with `mkdir -p /tmp/kit && cp -a
.kit/. /tmp/kit/`: pa with the scripts (install.sh gen.py gpu_test.sh tiny_model.py SHA256SUMS
MANIFEST.txt and py_spy.whl, if there), pb, pc, pd, pe, then pf (its call can run install.sh).
Run again on a re-cut kit, it changes nothing but the chunks' sizes.

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
    size = -(-len(data) // 4)
    for index, folder in enumerate(("pa", "pb", "pc", "pe")):
        (kit / folder).mkdir(exist_ok=True)
        (kit / folder / f"{name}.part-{index:02d}").write_bytes(
            data[index * size : (index + 1) * size]
        )
    for folder in ("pd", "pf"):
        (kit / folder).mkdir(exist_ok=True)
    for wheel in glob.glob(str(kit / "p*" / "*.whl")):
        path = Path(wheel)
        into = kit / ("pf" if path.name.startswith("nixl_cu") else "pd")
        if path.parent != into:
            path.rename(into / path.name)
    for folder in sorted(kit.glob("p*")):
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
    for folder in ("pa", "pb", "pc", "pd", "pe", "pf"):
        used = sum(f.stat().st_size for f in (kit / folder).iterdir())
        print(f"{folder}: {used / 2**20:.1f} MiB")
        if used > budget:
            raise SystemExit(f"{folder} is over the {budget / 2**20:.1f} MiB a transfer allows")


if __name__ == "__main__":
    main()
