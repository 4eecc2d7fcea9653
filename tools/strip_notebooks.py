"""Strip outputs and execution counts from notebooks, or check that they are stripped.

    .venv/bin/python tools/strip_notebooks.py            # strip notebooks/*.ipynb in place
    .venv/bin/python tools/strip_notebooks.py --check    # exit 1 listing notebooks with outputs
    .venv/bin/python tools/strip_notebooks.py a.ipynb    # specific files

Policy: notebooks are committed without outputs so that diffs show only what a person
wrote. Stripping removes code-cell outputs and execution counts, per-cell run metadata
(``execution``, ``collapsed``, ``scrolled``) and the notebook's saved widget state.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
CELL_METADATA_DROPPED = ("execution", "collapsed", "scrolled")
NOTEBOOK_METADATA_DROPPED = ("widgets",)


def leftovers(nb) -> list[str]:
    """What would be stripped from ``nb``, one description per item (empty: already clean)."""
    found = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            if cell.get("outputs"):
                found.append(f"cell {i}: {len(cell.outputs)} output(s)")
            if cell.get("execution_count") is not None:
                found.append(f"cell {i}: execution_count {cell.execution_count}")
        for key in CELL_METADATA_DROPPED:
            if key in cell.metadata:
                found.append(f"cell {i}: metadata {key!r}")
    found += [f"notebook metadata {key!r}" for key in NOTEBOOK_METADATA_DROPPED if key in nb.metadata]
    return found


def strip(nb) -> bool:
    """Strip ``nb`` in place; return True if anything was removed."""
    changed = bool(leftovers(nb))
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
        for key in CELL_METADATA_DROPPED:
            cell.metadata.pop(key, None)
    for key in NOTEBOOK_METADATA_DROPPED:
        nb.metadata.pop(key, None)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, help="notebooks (default: notebooks/*.ipynb)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if any notebook has outputs")
    args = parser.parse_args(argv)
    paths = args.paths or sorted(NOTEBOOK_DIR.glob("*.ipynb"))
    dirty = 0
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        if args.check:
            problems = leftovers(nb)
            if problems:
                dirty += 1
                print(f"{path}: not stripped ({'; '.join(problems[:3])}{' ...' if len(problems) > 3 else ''})")
        elif strip(nb):
            nbformat.write(nb, path)
            print(f"stripped {path}")
    if args.check and dirty:
        print(f"{dirty} notebook(s) have outputs: run `python tools/strip_notebooks.py`")
    return 1 if dirty else 0


if __name__ == "__main__":
    sys.exit(main())
