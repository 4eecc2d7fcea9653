"""Every notebook runs top to bottom headless, and is stored with its outputs stripped.

Each notebook runs in a fresh ``python3`` kernel (the interpreter running pytest, so the
project's ``.venv``) from inside ``notebooks/``, with a per-cell timeout; any error in
any cell fails the test. The run time is printed (``pytest -s``) and recorded as the
test property ``run_time_s`` (visible in ``--junitxml`` reports).
"""

import importlib.util
import sys
import time
from pathlib import Path
from queue import Empty

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXPECTED = ["00_tour", "01_attention_patching", "02_paged_kv_cache", "03_input_batch_reorder",
            "04_decode_loop", "05_performance", "06_prototyping", "08_tensor_parallel"]
CELL_TIMEOUT_S = 180


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


def load_strip_tool():
    spec = importlib.util.spec_from_file_location("strip_notebooks", ROOT / "tools" / "strip_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_notebook_of_the_course_is_there():
    assert [p.stem for p in NOTEBOOKS] == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_stripped(path):
    nb = nbformat.read(path, as_version=4)
    assert load_strip_tool().leftovers(nb) == [], f"run `python tools/strip_notebooks.py {path.name}`"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_follows_the_house_style(path):
    """Starts with what you will learn, ends with what to try next, imports fleetlab, draws inline."""
    nb = nbformat.read(path, as_version=4)
    first, last = nb.cells[0], nb.cells[-1]
    assert first.cell_type == "markdown" and "You will learn" in first.source
    assert last.cell_type == "markdown" and "Try next" in last.source
    sources = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "import fleetlab" in sources and "%matplotlib inline" in sources


def test_strip_tool_strips_outputs_counts_and_widget_state(tmp_path):
    tool = load_strip_tool()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1")])
    nb.cells[0].outputs = [nbformat.v4.new_output("execute_result", {"text/plain": "2"}, execution_count=1)]
    nb.cells[0].execution_count = 1
    nb.cells[0].metadata["execution"] = {"iopub.status.idle": "x"}
    nb.metadata["widgets"] = {"state": {}}
    path = tmp_path / "dirty.ipynb"
    nbformat.write(nb, path)
    assert tool.main(["--check", str(path)]) == 1
    assert tool.main([str(path)]) == 0
    clean = nbformat.read(path, as_version=4)
    assert tool.leftovers(clean) == [] and clean.cells[0].source == "1 + 1"
    assert tool.main(["--check", str(path)]) == 0


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
    nb = nbformat.read(path, as_version=4)
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
