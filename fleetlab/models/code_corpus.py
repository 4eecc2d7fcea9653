"""The corpus of the shipped code model: the running Python's own standard library.

Every machine that runs fleetlab has it, so nothing is downloaded: the ``.py`` files under
``sysconfig.get_paths()["stdlib"]`` (code, docstrings and comments, so English too; its test
suite too, which is most of the code), minus installed and bundled third-party packages,
caches and Python-2 relics (:data:`EXCLUDED_DIRS`). Files are
read as UTF-8 (a file that is not is skipped and named in the manifest), in sorted order.

:data:`HELD_OUT` is a fixed list of modules never trained on: the held-out loss and
next-token accuracy are measured on them, and the benchmarks' prompts come from them.

:func:`manifest` describes what a run used (Python version, every file's path, bytes and
SHA-256, totals); the manifest of the shipped model is ``fleetlab/models/code/corpus.json``.
A different Python version reads a different standard library: :func:`compare_manifest`
says how far it is from the shipped one.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "_bundled", "lib2to3", "__phello__"})
"""Directory names skipped anywhere in the tree: installed and bundled packages (not the
standard library), caches, and the Python-2 converter with its Python-2 test data."""

HELD_OUT = ("textwrap.py", "fractions.py", "shlex.py", "calendar.py", "heapq.py", "bisect.py",
            "string.py", "colorsys.py", "json/encoder.py", "json/decoder.py", "csv.py", "graphlib.py")  # fmt: skip
"""Paths (relative to the standard library) never trained on: small, ordinary modules of
plain Python whose idioms the rest of the library shares."""


@dataclass(frozen=True, slots=True)
class SourceFile:
    """One corpus file: its path relative to the standard library, and its text."""

    path: str
    text: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def stdlib_root() -> Path:
    """The running Python's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def _candidates(root: Path) -> list[Path]:
    return sorted(
        p for p in root.rglob("*.py") if not EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1])
    )


def iter_files(split: str = "train", root: Path | None = None) -> Iterator[SourceFile]:
    """The corpus files of ``split`` (``"train"``, ``"held_out"`` or ``"all"``), in path order.

    Files that are not valid UTF-8 are skipped (:func:`manifest` lists them).
    """
    if split not in ("train", "held_out", "all"):
        raise ValueError(f"iter_files: split must be 'train', 'held_out' or 'all', got {split!r}")
    root = stdlib_root() if root is None else root
    for path in _candidates(root):
        rel = path.relative_to(root).as_posix()
        held = rel in HELD_OUT
        if (split == "train" and held) or (split == "held_out" and not held):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        yield SourceFile(rel, text)


def manifest(root: Path | None = None) -> dict:
    """What the corpus is on this machine: Python version, held-out list, per-file bytes and
    SHA-256 (UTF-8 text), totals, and the files skipped as unreadable."""
    root = stdlib_root() if root is None else root
    files = {f.path: f for f in iter_files("all", root)}
    skipped = [p.relative_to(root).as_posix() for p in _candidates(root)
               if p.relative_to(root).as_posix() not in files]  # fmt: skip
    entries = [{"path": f.path, "bytes": len(f.text.encode("utf-8")), "sha256": f.sha256,
                "split": "held_out" if f.path in HELD_OUT else "train"} for f in files.values()]  # fmt: skip
    missing = sorted(set(HELD_OUT) - set(files))
    return {
        "python": platform.python_version(),
        "source": "sysconfig.get_paths()['stdlib'], *.py",
        "excluded_dirs": sorted(EXCLUDED_DIRS),
        "held_out": list(HELD_OUT),
        "held_out_missing": missing,
        "train_files": sum(e["split"] == "train" for e in entries),
        "train_bytes": sum(e["bytes"] for e in entries if e["split"] == "train"),
        "held_out_files": sum(e["split"] == "held_out" for e in entries),
        "held_out_bytes": sum(e["bytes"] for e in entries if e["split"] == "held_out"),
        "skipped_not_utf8": skipped,
        "files": entries,
    }


def compare_manifest(shipped: dict, current: dict) -> dict[str, int]:
    """How ``current`` differs from ``shipped``: counts of files ``same``, ``changed``,
    ``only_shipped`` and ``only_current`` (by path and SHA-256)."""
    old = {e["path"]: e["sha256"] for e in shipped["files"]}
    new = {e["path"]: e["sha256"] for e in current["files"]}
    both = old.keys() & new.keys()
    return {
        "same": sum(old[p] == new[p] for p in both),
        "changed": sum(old[p] != new[p] for p in both),
        "only_shipped": len(old.keys() - new.keys()),
        "only_current": len(new.keys() - old.keys()),
    }


def write_manifest(path: str | Path, data: dict) -> None:
    """Write ``data`` (from :func:`manifest`) as indented JSON."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def documents(split: str, paths: Sequence[str] | None = None) -> list[str]:
    """The texts of ``split``'s files (all of them, or only ``paths``), in path order."""
    wanted = None if paths is None else set(paths)
    return [f.text for f in iter_files(split) if wanted is None or f.path in wanted]
