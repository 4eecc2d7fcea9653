"""Keep notebooks/ in order: every notebook is a pair of files with the same cells.

``NAME.ipynb`` is what JupyterLab opens and the tests run; ``NAME.py`` is the same notebook
as a Python script in jupytext's ``py:percent`` format (``# %%`` starts a code cell,
``# %% [markdown]`` a Markdown cell): diffs, reviews and ruff read it. ``notebooks/jupytext.toml``
pairs the two, so JupyterLab (with jupytext, installed by ``make lab``) saves both at once.
Committed notebooks carry no outputs.

    python tools/notebooks.py sync [NAME ...]   # bring each pair in step (the newer file wins),
                                                # create a missing half, strip outputs
    python tools/notebooks.py check             # what the tests check; exit 1 on any problem
    python tools/notebooks.py strip [NAME ...]  # strip outputs only
    python tools/notebooks.py run NAME ... [--figures DIR]
                                                # run headless: time, stderr, and every figure
                                                # saved as DIR/NAME-cellNN-K.png to look at

NAME is a notebook's stem (``02_paged_kv_cache``) or any prefix of it (``02``); without one,
every notebook in notebooks/.
"""

from __future__ import annotations

import argparse
import base64
import sys
import time
from pathlib import Path
from queue import Empty

import nbformat
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
CELL_METADATA_DROPPED = ("execution", "collapsed", "scrolled")
NOTEBOOK_METADATA = {
    "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
    "language_info": {"name": "python"},
}


# ----------------------------------------------------------------- finding notebooks
def stems(folder: Path = NOTEBOOK_DIR) -> list[str]:
    """Every notebook's name in ``folder``: stems of ``*.ipynb`` and ``*.py`` files, sorted."""
    return sorted({p.stem for p in folder.glob("*.ipynb")} | {p.stem for p in folder.glob("*.py")})


def select(names: list[str], folder: Path = NOTEBOOK_DIR) -> list[str]:
    """The notebooks named (exactly or by prefix); all of them when ``names`` is empty."""
    every = stems(folder)
    if not names:
        return every
    chosen = [s for s in every if any(s == n or s.startswith(n) for n in names)]
    if not chosen:
        raise SystemExit(f"no notebook in {folder} matches {names}; there are {every}")
    return chosen


# ----------------------------------------------------------------- stripping
def leftovers(nb) -> list[str]:
    """What :func:`strip` would remove from ``nb``, one description per item (empty: clean)."""
    found = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            if cell.get("outputs"):
                found.append(f"cell {i}: {len(cell.outputs)} output(s)")
            if cell.get("execution_count") is not None:
                found.append(f"cell {i}: execution_count {cell.execution_count}")
        found += [f"cell {i}: metadata {key!r}" for key in CELL_METADATA_DROPPED if key in cell.metadata]
    extra = sorted(set(nb.metadata) - set(NOTEBOOK_METADATA))
    found += [f"notebook metadata {key!r}" for key in extra]
    return found


def strip(nb) -> bool:
    """Strip outputs, execution counts, run metadata and saved widget state in place; give the
    notebook the project's kernel metadata. Returns True if anything changed."""
    changed = bool(leftovers(nb)) or any(nb.metadata.get(k) != v for k, v in NOTEBOOK_METADATA.items())
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
        for key in CELL_METADATA_DROPPED:
            cell.metadata.pop(key, None)
    nb.metadata = nbformat.from_dict(dict(NOTEBOOK_METADATA))
    return changed


# ----------------------------------------------------------------- pairs
def cells_of(nb) -> list[tuple[str, str]]:
    """``(cell type, source)`` of every cell: what the two files of a pair must agree on."""
    return [(cell.cell_type, cell.source.strip()) for cell in nb.cells]


def pair_problems(stem: str, folder: Path = NOTEBOOK_DIR) -> list[str]:
    """Why the pair ``stem`` is not in order (empty: it is)."""
    import jupytext

    ipynb, script = folder / f"{stem}.ipynb", folder / f"{stem}.py"
    missing = [p.name for p in (ipynb, script) if not p.exists()]
    if missing:
        return [f"{stem}: {' and '.join(missing)} missing"]
    nb = nbformat.read(ipynb, as_version=4)
    problems = [f"{ipynb.name}: {item}" for item in leftovers(nb)]
    if nb.metadata.get("kernelspec") != NOTEBOOK_METADATA["kernelspec"]:
        problems.append(f"{ipynb.name}: kernelspec is not python3")
    if cells_of(nb) != cells_of(jupytext.read(script)):
        problems.append(f"{stem}: {ipynb.name} and {script.name} hold different cells")
    return problems


def sync(stem: str, folder: Path = NOTEBOOK_DIR) -> None:
    """Bring the pair in step with ``jupytext --sync`` (the newer file's cells win; a missing
    half is created), then strip the ``.ipynb``."""
    from jupytext.cli import jupytext as jupytext_cli

    ipynb, script = folder / f"{stem}.ipynb", folder / f"{stem}.py"
    source = ipynb if ipynb.exists() else script
    jupytext_cli(["--sync", "--quiet", str(source)])
    nb = nbformat.read(ipynb, as_version=4)
    if strip(nb):
        nbformat.write(nb, ipynb)


# ----------------------------------------------------------------- running
class SlicedPollClient(NotebookClient):
    """A ``NotebookClient`` that waits for each execute reply in slices of one second.

    pyzmq's asyncio poller can miss the wake-up for a reply that is already waiting (seen
    here under load, in about one notebook run in ten): the client then sleeps for the
    whole cell timeout although the cell finished long before, and the run still passes,
    minutes late. Polling in slices bounds that stall to a second; a real timeout still
    raises after ``timeout`` seconds.
    """

    async def async_start_new_kernel_client(self):
        kc = await super().async_start_new_kernel_client()
        wait_once = kc.shell_channel.get_msg

        async def get_msg(timeout=None):
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                left = 1.0 if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    return await wait_once(timeout=min(1.0, left))
                except Empty:
                    if deadline is not None and time.monotonic() >= deadline:
                        raise

        kc.shell_channel.get_msg = get_msg
        return kc


def run(stem: str, figures: Path | None, folder: Path = NOTEBOOK_DIR, timeout: int = 180) -> float:
    """Run a notebook headless from ``folder``; print its time and stderr; save its figures."""
    nb = nbformat.read(folder / f"{stem}.ipynb", as_version=4)
    start = time.perf_counter()
    client = SlicedPollClient(nb, timeout=timeout, kernel_name="python3",
                              resources={"metadata": {"path": str(folder)}})
    client.execute()
    elapsed = time.perf_counter() - start
    print(f"{stem}: {elapsed:.1f} s")
    for i, cell in enumerate(nb.cells):
        for k, out in enumerate(cell.get("outputs", [])):
            if out.output_type == "stream" and out.name == "stderr":
                print(f"  cell {i} stderr: {out.text.strip()[:300]}")
            shown = out.output_type in ("display_data", "execute_result")
            png = out.get("data", {}).get("image/png") if shown else None
            if png and figures is not None:
                figures.mkdir(parents=True, exist_ok=True)
                path = figures / f"{stem}-cell{i:02d}-{k}.png"
                path.write_bytes(base64.b64decode(png))
                print(f"  figure: {path}")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["sync", "check", "strip", "run"])
    parser.add_argument("names", nargs="*", help="notebook names or prefixes (default: all)")
    parser.add_argument("--figures", type=Path, help="run: save each figure as a PNG in this folder")
    parser.add_argument("--folder", type=Path, default=NOTEBOOK_DIR, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    chosen = select(args.names, args.folder)
    if args.command == "check":
        problems = [p for stem in chosen for p in pair_problems(stem, args.folder)]
        for problem in problems:
            print(problem)
        if problems:
            print("fix: `python tools/notebooks.py sync` (or `make notebooks`), then commit both files")
        return 1 if problems else 0
    for stem in chosen:
        if args.command == "sync":
            sync(stem, args.folder)
        elif args.command == "strip":
            path = args.folder / f"{stem}.ipynb"
            nb = nbformat.read(path, as_version=4)
            if strip(nb):
                nbformat.write(nb, path)
                print(f"stripped {path.name}")
        else:
            run(stem, args.figures, args.folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
