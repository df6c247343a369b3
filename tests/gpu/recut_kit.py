"""Re-cuts the GPU kit (../shared/tools/gpu-vllm-kit/make_kit.sh's .kit/p1 .. p4) so that each
transfer fits the device tool's 64 MiB with this repository's tree beside it (9 MB and growing
with the committed results: NIXL's 59 MB wheel alone no longer fits beside it). Every wheel of
the kit, chunked or whole, is packed in turn into as few folders as fit (.kit/pa, pb, ...),
each filled up to what one transfer carries: a big wheel that does not fit the space left is
cut there (NAME.whl.part-00, -01, ...), a small one (under 4 MiB) goes whole into the next
folder. install.sh joins chunks by their sorted names (any p* folder) and checks the joined
wheel's sha256, so nothing else changes. Then one transfer per folder, back to back, each
starting with `mkdir -p /tmp/kit && cp -a .kit/. /tmp/kit/`: pa with the scripts (install.sh
gen.py gpu_test.sh tiny_model.py SHA256SUMS MANIFEST.txt and py_spy.whl, if there), the
others alone, the last one's call running install.sh (tests/gpu/device_call.sh does). It prints
the folders and what each call carries. Run again on a re-cut kit (or after the tree grew), it
packs the same wheels again.

    python3 tests/gpu/recut_kit.py [.kit] [--tree-bytes N]   (from the repository root)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from pathlib import Path

LIMIT = 64 << 20  # what one device call carries, tree included
MARGIN = 256 << 10
SMALL = 4 << 20  # wheels under this go whole into the next folder rather than cut
SCRIPTS = ("install.sh", "gen.py", "gpu_test.sh", "tiny_model.py", "SHA256SUMS", "MANIFEST.txt")


def tree_bytes() -> int:
    """The bytes of the working tree that travel with every call (tracked files)."""
    files = subprocess.run(["git", "ls-files", "-z"], capture_output=True, check=True).stdout.split(
        b"\0"
    )
    return sum(os.path.getsize(f) for f in files if f and os.path.isfile(f))


def kit_wheels(kit: Path) -> dict[str, bytes]:
    """Every wheel in the kit's p* folders, chunks joined in their names' order."""
    parts: dict[str, list[Path]] = {}
    for path in kit.glob("p*/*.whl*"):
        name = path.name.rsplit(".part-", 1)[0] if ".whl.part-" in path.name else path.name
        if name.endswith(".whl"):
            parts.setdefault(name, []).append(path)
    return {
        name: b"".join(p.read_bytes() for p in sorted(paths, key=lambda p: p.name))
        for name, paths in parts.items()
    }


def pack(wheels: dict[str, bytes], first_budget: int, budget: int) -> list[dict[str, bytes]]:
    """The wheels as folders of files (whole wheels and NAME.part-NN chunks), the first folder
    holding at most `first_budget` bytes and each other at most `budget`, big wheels first."""
    if budget <= SMALL:
        raise SystemExit(f"a transfer has {budget / 2**20:.1f} MiB left beside the tree: too few")
    folders: list[dict[str, bytes]] = [{}]
    room = first_budget
    for name, data in sorted(wheels.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        if len(data) <= room:
            folders[-1][name] = data
            room -= len(data)
            continue
        if len(data) < SMALL or room < SMALL:
            folders.append({})
            room = budget
            if len(data) <= room:
                folders[-1][name] = data
                room -= len(data)
                continue
        done, index = 0, 0
        while done < len(data):
            if room <= 0:
                folders.append({})
                room = budget
            piece = data[done : done + room]
            folders[-1][f"{name}.part-{index:02d}"] = piece
            done += len(piece)
            room -= len(piece)
            index += 1
    return folders


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kit", nargs="?", default=".kit")
    parser.add_argument("--tree-bytes", type=int, default=0, help="default: git ls-files' sum")
    args = parser.parse_args()
    kit = Path(args.kit)
    wheels = kit_wheels(kit)
    if not any(n.startswith("vllm-") for n in wheels):
        raise SystemExit(f"{kit}: no vllm wheel (run make_kit.sh first)")
    budget = LIMIT - (args.tree_bytes or tree_bytes()) - MARGIN
    scripts = sum((kit / s).stat().st_size for s in (*SCRIPTS, "py_spy.whl") if (kit / s).is_file())
    folders = pack(wheels, budget - scripts, budget)
    for old in kit.glob("p*"):
        if old.is_dir():
            shutil.rmtree(old)
    names = [f"p{chr(ord('a') + i)}" for i in range(len(folders))]
    for folder, files in zip(names, folders, strict=True):
        (kit / folder).mkdir()
        for name, data in files.items():
            (kit / folder / name).write_bytes(data)
        print(f"{folder}: {sum(map(len, files.values())) / 2**20:.1f} MiB, {len(files)} file(s)")
    first = " ".join(f".kit/{s}" for s in (*SCRIPTS, "py_spy.whl") if (kit / s).is_file())
    print(f"{len(folders)} transfers: carry [.kit/{names[0]} {first}], then", end=" ")
    print(", ".join(f"[.kit/{n}]" for n in names[1:]), "(that call installs)")


if __name__ == "__main__":
    main()
