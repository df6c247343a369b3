"""Re-cuts the GPU kit (../shared/tools/gpu-vllm-kit/make_kit.sh's .kit/p1 .. p4) so that each
transfer fits the device tool's 64 MiB with this repository's tree beside it (9 MB and growing
with the committed results: NIXL's 59 MB wheel alone no longer fits beside it). Every wheel of
the kit, chunked or whole, is packed in turn into as few folders as fit (.kit/pa, pb, ...),
each filled up to what one transfer carries: a big wheel that does not fit the space left is
cut there (NAME.whl.part-00, -01, ...), a small one (under 4 MiB) goes whole into the first
folder with room for it. Every joined wheel is checked against SHA256SUMS and the new folders
are written whole before the old ones go. install.sh joins chunks by their sorted names (any
p* folder) and checks the joined wheel's sha256, so nothing else changes. Then one transfer per folder, back to back, each
starting with `mkdir -p /tmp/kit && cp -a .kit/. /tmp/kit/`: pa with the scripts (install.sh
gen.py gpu_test.sh tiny_model.py SHA256SUMS MANIFEST.txt and py_spy.whl, if there), the
others alone, the last one's call running install.sh (tests/gpu/device_call.sh does). It prints
the folders and what each call carries. Run again on a re-cut kit (or after the tree grew), it
packs the same wheels again.

    python3 tests/gpu/recut_kit.py [.kit] [--tree-bytes N]   (from the repository root)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

LIMIT = 64 << 20  # what one device call carries, tree included
MARGIN = 256 << 10
SMALL = 4 << 20  # wheels under this go whole into the next folder rather than cut
SCRIPTS = ("install.sh", "gen.py", "gpu_test.sh", "tiny_model.py", "SHA256SUMS", "MANIFEST.txt")


def tree_bytes() -> int:
    """The bytes of the working tree that travel with every call (tracked files), each file
    rounded up to whole 4 KiB blocks as the device tool counts it (with exact sizes, 9.3 MiB
    of tree beside 54.4 MiB of kit was refused as over 64 MiB; on disk it is 10.3 MiB)."""
    files = subprocess.run(["git", "ls-files", "-z"], capture_output=True, check=True).stdout.split(
        b"\0"
    )
    return sum(-(-os.path.getsize(f) // 4096) * 4096 for f in files if f and os.path.isfile(f))


def kit_wheels(kit: Path) -> dict[str, bytes]:
    """Every wheel in the kit's p* folders, chunks joined in their names' order, each checked
    against the kit's SHA256SUMS where it names it. A file in two folders is refused: a kit
    made again over a re-cut one (make_kit.sh clears only its own p1 .. p4) would join twice."""
    parts: dict[str, list[Path]] = {}
    seen: dict[str, Path] = {}
    for path in sorted(kit.glob("p*/*.whl*")):
        if path.name in seen:
            raise SystemExit(
                f"{path.name} is in both {seen[path.name].parent} and {path.parent}: a kit made "
                f"over a re-cut one? Make it again into an empty folder (rm -rf {kit} first)"
            )
        seen[path.name] = path
        name = path.name.rsplit(".part-", 1)[0] if ".whl.part-" in path.name else path.name
        if name.endswith(".whl"):
            parts.setdefault(name, []).append(path)
    sums = {}
    if (kit / "SHA256SUMS").is_file():
        sums = {
            n: h
            for h, n in (
                ln.split() for ln in (kit / "SHA256SUMS").read_text().splitlines() if ln.strip()
            )
        }
    wheels = {}
    for name, paths in parts.items():
        data = b"".join(p.read_bytes() for p in sorted(paths, key=lambda p: p.name))
        if name in sums and hashlib.sha256(data).hexdigest() != sums[name]:
            raise SystemExit(
                f"{name}: its {len(paths)} part(s) do not join to the sha256 in SHA256SUMS "
                f"(a part missing or left over?): make the kit again (make_kit.sh)"
            )
        wheels[name] = data
    return wheels


def pack(wheels: dict[str, bytes], first_budget: int, budget: int) -> list[dict[str, bytes]]:
    """The wheels as folders of files (whole wheels and NAME.part-NN chunks), the first folder
    holding at most `first_budget` bytes and each other at most `budget`: big wheels first, cut
    where a folder ends; a small one into the first folder with room for it whole."""
    if min(budget, first_budget) <= SMALL:
        raise SystemExit(
            f"a transfer has {min(budget, first_budget) / 2**20:.1f} MiB left beside the tree "
            f"and the scripts: too few. Shrink the tree (move big results out of it, or pack "
            f"them smaller) or pass --tree-bytes if git's count is wrong"
        )
    folders: list[dict[str, bytes]] = [{}]
    rooms = [first_budget]

    def new_folder() -> int:
        folders.append({})
        rooms.append(budget)
        return len(folders) - 1

    def put(index: int, name: str, data: bytes) -> None:
        folders[index][name] = data
        rooms[index] -= len(data)

    for name, data in sorted(wheels.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        if len(data) < SMALL:  # whole, into the first folder with room for it
            fits = next((i for i, room in enumerate(rooms) if room >= len(data)), None)
            put(new_folder() if fits is None else fits, name, data)
            continue
        if len(data) > rooms[-1] and rooms[-1] < SMALL:
            new_folder()  # too little left in the last folder to start a cut there
        if len(data) <= rooms[-1]:
            put(len(folders) - 1, name, data)
            continue
        done, index = 0, 0
        while done < len(data):
            if rooms[-1] <= 0:
                new_folder()
            piece = data[done : done + rooms[-1]]
            put(len(folders) - 1, f"{name}.part-{index:02d}", piece)
            done += len(piece)
            index += 1
    if len(folders) > 26:
        raise SystemExit(f"{len(folders)} transfers: more than pa .. pz; shrink the tree first")
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
    carried = [s for s in (*SCRIPTS, "py_spy.whl") if (kit / s).is_file()]  # with the first
    folders = pack(wheels, budget - sum((kit / s).stat().st_size for s in carried), budget)
    names = [f"p{chr(ord('a') + i)}" for i in range(len(folders))]
    staging = kit / ".recut"  # written whole before the old folders go
    shutil.rmtree(staging, ignore_errors=True)
    for folder, files in zip(names, folders, strict=True):
        (staging / folder).mkdir(parents=True)
        for name, data in files.items():
            (staging / folder / name).write_bytes(data)
    for old in kit.glob("p*"):
        if old.is_dir():
            shutil.rmtree(old)
    for folder, files in zip(names, folders, strict=True):
        (staging / folder).rename(kit / folder)
        print(f"{folder}: {sum(map(len, files.values())) / 2**20:.1f} MiB, {len(files)} file(s)")
    staging.rmdir()
    first = " ".join(f".kit/{s}" for s in carried)
    rest = ", ".join(f"[.kit/{n}]" for n in names[1:])
    print(
        f"{len(folders)} transfer(s): carry [.kit/{names[0]} {first}]"
        + (f", then {rest}" if rest else ""),
        "(the last call installs)",
    )


if __name__ == "__main__":
    main()
