"""Every notebook in notebooks/ is a clean pair, passes ruff, runs headless without noise,
and shows what its prose promises.

Any notebook in the folder is picked up: a new ``NN_name.ipynb`` + ``NN_name.py`` pair is
tested with no change here. Each notebook runs in a fresh ``python3`` kernel (the
interpreter running pytest, so the project's ``.venv``) from inside ``notebooks/``, with a
per-cell timeout; any error in any cell fails the test. After the notebook's own cells the
test runs the notebook's promise checks (``tests/notebook_promises.py``) in the same kernel:
what the prose says about a figure, checked on the objects drawn. The run time is printed
(``pytest -s``) and recorded as the test property ``run_time_s`` (visible in ``--junitxml``).
"""

import importlib.util
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from notebook_promises import PROMISES

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
COURSE = ["00_why_a_kv_cache", "01_tour", "02_paged_kv_cache", "03_attention_patching", "04_input_batch_reorder",
          "05_decode_loop", "06_performance", "07_prototyping", "12_read_the_engine"]
CELL_TIMEOUT_S = 180
# A line a library prints as a notice: a Python warning, a logging record, a colour code.
NOISE = re.compile(r"warning:|\[\s*warning|\bINFO\b|\x1b\[|PyTorch was not found|ccache|distutils|OMP_NUM_THREADS",
                   re.I)


def load_tool():
    spec = importlib.util.spec_from_file_location("notebooks_tool", ROOT / "tools" / "notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SlicedPollClient = load_tool().SlicedPollClient


def test_every_notebook_of_the_course_is_there_and_named_in_order():
    names = [p.stem for p in NOTEBOOKS]
    assert set(COURSE) <= set(names)
    assert all(re.fullmatch(r"\d\d_[a-z0-9_]+", n) for n in names), names
    assert len({n[:2] for n in names}) == len(names), "two notebooks share a number"


@pytest.mark.parametrize("stem", load_tool().stems(NOTEBOOK_DIR))
def test_notebook_pair_is_in_step_and_stripped(stem):
    """NAME.ipynb and NAME.py hold the same cells; the .ipynb has no outputs."""
    problems = load_tool().pair_problems(stem, NOTEBOOK_DIR)
    assert problems == [], "; ".join(problems) + " -- run `python tools/notebooks.py sync`"


def test_notebooks_pass_ruff():
    """The cells are code like any other: ruff checks the paired scripts (`make lint` too)."""
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(NOTEBOOK_DIR)],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_follows_the_house_style(path):
    """Starts with what you will learn, has an "In vLLM / FastDeploy" box, ends with what to
    try next; imports fleetlab before paddle (so fleetlab.lab.quiet is in force) and draws inline,
    with no warning or logging boilerplate of its own."""
    nb = nbformat.read(path, as_version=4)
    first, last = nb.cells[0], nb.cells[-1]
    assert first.cell_type == "markdown" and "You will learn" in first.source
    assert last.cell_type == "markdown" and "Try next" in last.source
    assert any(c.cell_type == "markdown" and "In vLLM / FastDeploy" in c.source for c in nb.cells)
    sources = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "import fleetlab" in sources and "%matplotlib inline" in sources
    assert "filterwarnings" not in sources and "import logging" not in sources
    if "import paddle" in sources:
        assert sources.index("import fleetlab") < sources.index("import paddle")


def test_tool_strips_outputs_counts_and_widget_state(tmp_path):
    tool = load_tool()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1")])
    nb.cells[0].outputs = [nbformat.v4.new_output("execute_result", {"text/plain": "2"}, execution_count=1)]
    nb.cells[0].execution_count = 1
    nb.cells[0].metadata["execution"] = {"iopub.status.idle": "x"}
    nb.metadata["widgets"] = {"state": {}}
    path = tmp_path / "10_dirty.ipynb"
    nbformat.write(nb, path)
    folder = ["--folder", str(tmp_path)]
    assert tool.main(["check", *folder]) == 1  # outputs, and no 10_dirty.py
    assert tool.main(["strip", *folder]) == 0
    clean = nbformat.read(path, as_version=4)
    assert tool.leftovers(clean) == [] and clean.cells[0].source == "1 + 1"
    assert clean.metadata["kernelspec"]["name"] == "python3"


def test_tool_sync_creates_the_missing_half_and_follows_the_newer_file(tmp_path):
    """A new notebook can start as a py:percent script: sync writes its .ipynb, and an edit
    to either file reaches the other."""
    tool = load_tool()
    (tmp_path / "jupytext.toml").write_text((NOTEBOOK_DIR / "jupytext.toml").read_text())
    script = tmp_path / "07_new.py"
    script.write_text("# %% [markdown]\n# # 07 · New\n\n# %%\nx = 1\nx\n")
    folder = ["--folder", str(tmp_path)]
    assert tool.main(["sync", *folder]) == 0
    assert tool.main(["check", *folder]) == 0
    nb = nbformat.read(tmp_path / "07_new.ipynb", as_version=4)
    assert [c.cell_type for c in nb.cells] == ["markdown", "code"] and nb.cells[1].source == "x = 1\nx"
    nb.cells[1].source = "x = 2\nx"
    time.sleep(0.05)
    nbformat.write(nb, tmp_path / "07_new.ipynb")
    assert tool.main(["check", *folder]) == 1
    assert tool.main(["sync", *folder]) == 0
    assert "x = 2" in script.read_text() and tool.main(["check", *folder]) == 0


def test_kernel_is_this_python_and_a_cell_over_its_timeout_fails():
    """The notebooks run on the interpreter running the tests (the project's .venv), and the
    sliced wait above still enforces the cell timeout."""
    from nbclient.exceptions import CellTimeoutError

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import sys\nprint(sys.executable)"),
                                         nbformat.v4.new_code_cell("import time\ntime.sleep(3)")])
    with pytest.raises(CellTimeoutError):
        SlicedPollClient(nb, timeout=1, kernel_name="python3").execute()
    kernel_python = nb.cells[0].outputs[0].text.strip()
    assert kernel_python == sys.executable, (
        f"kernel 'python3' runs {kernel_python}, not {sys.executable}: a user-level kernelspec shadows the .venv's")


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_headless(path, record_property):
    """Runs top to bottom, then its promise checks; no error, no library notice in any output."""
    nb = nbformat.read(path, as_version=4)
    if path.stem in PROMISES:
        nb.cells.append(nbformat.v4.new_code_cell(PROMISES[path.stem]))
    started, cell_s = {}, {}
    client = SlicedPollClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}},
        on_cell_start=lambda cell, cell_index: started.__setitem__(cell_index, time.perf_counter()),
        on_cell_executed=lambda cell, cell_index, execute_reply: cell_s.__setitem__(
            cell_index, time.perf_counter() - started[cell_index]),
    )
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError, naming the cell, on the first error
    elapsed = time.perf_counter() - start
    slowest = max(cell_s, key=cell_s.get)
    record_property("run_time_s", round(elapsed, 1))
    record_property("cells_s", round(sum(cell_s.values()), 1))
    print(f"\n{path.name}: {elapsed:.1f} s (cells {sum(cell_s.values()):.1f} s, slowest: cell {slowest} "
          f"{cell_s[slowest]:.1f} s)")
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    streams = [line for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "stream"
               for line in o.text.splitlines()]
    noisy = [line for line in streams if NOISE.search(line)]
    assert noisy == [], f"library notices in the notebook's output: {noisy[:5]}"
