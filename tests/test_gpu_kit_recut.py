"""The GPU kit's re-cut (tests/gpu/recut_kit.py): every folder fits one device transfer beside
the tree, and the kit's install joins each wheel back byte for byte (chunks by sorted name)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

from tests.gpu import recut_kit

MIB = 1 << 20


def _joined(kit: Path) -> dict[str, str]:
    """What install.sh sees: each wheel's sha256, chunks joined in their names' order."""
    parts: dict[str, list[Path]] = {}
    for path in kit.glob("p*/*"):
        parts.setdefault(path.name.rsplit(".part-", 1)[0], []).append(path)
    return {
        name: hashlib.sha256(
            b"".join(p.read_bytes() for p in sorted(ps, key=lambda p: p.name))
        ).hexdigest()
        for name, ps in parts.items()
    }


def test_recut_fills_transfers_and_keeps_every_wheel(tmp_path: Path) -> None:
    kit = tmp_path / ".kit"
    wheels = {"vllm-0.26.0-x.whl": 36 * MIB, "nixl_cu13-1.5.1-x.whl": 12 * MIB}
    wheels |= {f"small{i}-1.0-py3-none-any.whl": (i % 5 + 1) * 300_000 for i in range(20)}
    want = {}
    for i, (name, size) in enumerate(sorted(wheels.items())):
        data = bytes([i]) * size
        want[name] = hashlib.sha256(data).hexdigest()
        folder = kit / ("p1" if name.startswith("vllm") else "p4")
        folder.mkdir(parents=True, exist_ok=True)
        if name.startswith("vllm"):  # make_kit.sh's chunks
            for k in range(3):
                (folder / f"{name}.part-{k:02d}").write_bytes(
                    data[k * 50 * MIB : (k + 1) * 50 * MIB]
                )
        else:
            (folder / name).write_bytes(data)
    (kit / "install.sh").write_text("# the kit's installer\n")
    (kit / "SHA256SUMS").write_text("".join(f"{h}  {n}\n" for n, h in want.items()))
    tree = 50 * MIB  # a transfer then carries ~13.7 MiB of the kit: the packing at a small scale
    for _ in range(2):  # a second run re-packs the re-cut kit
        out = subprocess.run(
            [sys.executable, recut_kit.__file__, str(kit), "--tree-bytes", str(tree)],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        folders = sorted(p for p in kit.glob("p*") if p.is_dir())
        assert [f.name for f in folders] == ["pa", "pb", "pc", "pd", "pe"], out
        for folder in folders:
            used = sum(f.stat().st_size for f in folder.iterdir())
            used += (kit / "install.sh").stat().st_size if folder.name == "pa" else 0
            assert used + tree <= recut_kit.LIMIT, (folder, used)
        assert _joined(kit) == want
        assert (
            "5 transfer(s): carry [.kit/pa .kit/install.sh .kit/SHA256SUMS], then [.kit/pb]" in out
        ), out

    # A kit made again over the re-cut one leaves a wheel in two folders: refused, nothing lost.
    small = next(kit.glob("p*/small1-*.whl"))
    (kit / "p1").mkdir()
    (kit / "p1" / small.name).write_bytes(small.read_bytes())
    again = subprocess.run(
        [sys.executable, recut_kit.__file__, str(kit), "--tree-bytes", str(tree)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert again.returncode != 0 and "is in both" in again.stderr, again
    assert f"rm -rf {kit}" in again.stderr, again.stderr
    (kit / "p1" / small.name).unlink()
    # A part that does not join to its sum (one left over from another kit) is refused too.
    (kit / "p1" / "vllm-0.26.0-x.whl.part-99").write_bytes(b"left over")
    stale = subprocess.run(
        [sys.executable, recut_kit.__file__, str(kit), "--tree-bytes", str(tree)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert stale.returncode != 0 and "do not join to the sha256" in stale.stderr, stale
    assert _joined(kit).keys() >= want.keys()
