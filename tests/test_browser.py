"""A real-browser test: JupyterLab, driven by Playwright through Debian's Chromium.

It copies notebooks/ to a temporary folder (the committed notebooks stay output-free), serves
it with JupyterLab on a free localhost port, opens a notebook whose slider redraws a matplotlib
plot, runs all cells, checks that the widgets rendered, moves the slider and checks that the
plot changed; then runs there the first notebook a newcomer opens and one notebook of each other
kind of widget (a player). Every notebook also runs headless in ``test_notebooks.py``, so running
the rest a second time here would prove nothing more.
Screenshots land in test-artifacts/browser/.

Skipped unless /usr/bin/chromium and the ``playwright`` and ``jupyterlab`` packages are present;
the browser is never downloaded (``playwright install`` is not needed). Needs ipywidgets >= 8.
"""

from __future__ import annotations

import importlib.util
import shutil
import time
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
NOTEBOOK = "02_paged_kv_cache.ipynb"  # its LiveFigure has sliders over a block-pool picture
REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "test-artifacts" / "browser"
# The network is closed: nothing in Chromium may try to reach it.
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# Time limits, in seconds: server start, then the whole browser session (each step also has a
# cap of its own). With shutdown they keep the test under three minutes on a loaded machine.
SERVER_START_S, SESSION_S = 45, 110
STEP_CAPS_S = {"open": 50, "run": 70, "widgets": 25, "redraw": 25}
WIDGETS = ("viz.player(", "LiveFigure", "ipywidgets", "interact")  # what only a browser renders


def _browser_runs() -> list[str]:
    """The on-ramp, and for each kind of widget the slider's notebook lacks, the first notebook of
    the course that has one: every kind renders once in a real browser (every notebook also runs
    headless, with its promises, in ``test_notebooks.py``)."""
    paths = sorted((REPO / "notebooks").glob("*.ipynb"))
    shown = (REPO / "notebooks" / NOTEBOOK).with_suffix(".py").read_text()
    runs = [p.name for p in paths if p.name.startswith("00_")]
    for widget in (w for w in WIDGETS if w not in shown):
        runs += [p.name for p in paths if widget in p.with_suffix(".py").read_text()][:1]
    return sorted(set(runs) - {NOTEBOOK})


OTHER_NOTEBOOKS = _browser_runs()


def _missing() -> str | None:
    if not CHROMIUM.exists():
        return f"{CHROMIUM} not found (apt-get install chromium)"
    for module in ("playwright", "jupyterlab", "ipywidgets", "nbformat"):
        if importlib.util.find_spec(module) is None:
            return f"python package {module!r} not installed"
    return None


pytestmark = [pytest.mark.browser, pytest.mark.skipif(_missing() is not None, reason=str(_missing()))]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server over a temporary copy of notebooks/; shut down however the test ends."""
    from browser.lab_server import LabServer

    root = tmp_path_factory.mktemp("lab-root")
    shutil.copytree(REPO / "notebooks", root, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    server = LabServer(root_dir=root, state_dir=tmp_path_factory.mktemp("lab-state"))
    try:
        yield server.start(timeout_s=SERVER_START_S)
    finally:
        server.stop()


@pytest.fixture
def page(lab):
    """A Chromium page (Debian's binary, headless) that closes with the test."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS,
                                             timeout=30_000)
        try:
            yield browser.new_page(viewport={"width": 1400, "height": 1000})
        finally:
            browser.close()


class _Budget:
    """Milliseconds left for a step: its own cap, or what remains of the session, if less."""

    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def ms(self, step: str) -> int:
        left = self.deadline - time.monotonic()
        if left <= 1:
            raise TimeoutError(f"browser session budget of {SESSION_S} s spent before step {step!r}")
        return int(1000 * min(STEP_CAPS_S[step], left))


def _shot(target, name: str) -> bytes:
    path = ARTIFACTS / name
    png = target.screenshot(path=str(path))
    print(f"screenshot: {path}")
    return png


def test_slider_redraws_plot_in_jupyterlab(lab, page):
    from browser import lab_page

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    budget, start = _Budget(SESSION_S), time.monotonic()
    try:
        lab_page.open_notebook(page, lab.url, NOTEBOOK, budget.ms("open"))
        lab_page.run_all_cells(page, budget.ms("run"))
        lab_page.wait_widgets_rendered(page, budget.ms("widgets"))
        widget, handle = lab_page.tag_live_plot(page, budget.ms("widgets"))
        widget.scroll_into_view_if_needed()
        _shot(page, "01_after_run_all.png")
        _shot(widget, "02_plot_before.png")
        before_value, before_src = handle.get_attribute("aria-valuenow"), lab_page.plot_src(widget)
        before_pixels = lab_page.plot_image(widget).screenshot()

        lab_page.nudge_slider(handle)
        lab_page.wait_plot_changed(page, before_src, budget.ms("redraw"))
        _shot(widget, "03_plot_after.png")
    except Exception:
        _shot(page, "99_failure.png")
        print(f"JupyterLab log tail:\n{lab.log_tail()}")
        raise
    print(f"browser session took {time.monotonic() - start:.1f} s")

    assert handle.get_attribute("aria-valuenow") != before_value
    assert lab_page.plot_src(widget) != before_src
    assert lab_page.plot_image(widget).screenshot() != before_pixels, "the plot's pixels did not change"
    assert lab_page.placeholders_shown(page) == []


@pytest.mark.parametrize("name", OTHER_NOTEBOOKS)
def test_every_other_notebook_runs_in_jupyterlab(lab, page, name):
    """Run All in the browser: no cell left unrun, no widget placeholder left on the page (the
    on-ramp and a notebook with a player)."""
    from browser import lab_page

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    budget = _Budget(SESSION_S)
    try:
        lab_page.open_notebook(page, lab.url, name, budget.ms("open"))
        lab_page.run_all_cells(page, budget.ms("run"))
        page.wait_for_timeout(500)  # let widget views attach before looking for placeholders
        assert lab_page.placeholders_shown(page) == []
    except Exception:
        _shot(page, f"99_failure_{Path(name).stem}.png")
        print(f"JupyterLab log tail:\n{lab.log_tail()}")
        raise
    _shot(page, f"run_all_{Path(name).stem}.png")


# Outputs a page must render, beyond running: the engine's source shown as highlighted HTML (file and
# lines, as viz.show_source writes them) and the table of names a cell builds.
RENDERED = {"12_read_the_engine.ipynb": ["fleetlab/engine/scheduler.py, lines", "(in Scheduler.schedule)",
                                         "fleetlab/attention/naive.py, lines", "vLLM v1\tFastDeploy"]}


@pytest.mark.parametrize("name", sorted(RENDERED))
def test_source_excerpts_and_tables_render_in_jupyterlab(lab, page, name):
    """Run All in the browser, then read every output, the notebook scrolled through: the
    excerpts and the table the notebook builds are on the page."""
    from browser import lab_page

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    budget = _Budget(SESSION_S)
    try:
        lab_page.open_notebook(page, lab.url, name, budget.ms("open"))
        lab_page.run_all_cells(page, budget.ms("run"))
        shown = lab_page.output_text(page)
    except Exception:
        _shot(page, f"99_failure_{Path(name).stem}.png")
        print(f"JupyterLab log tail:\n{lab.log_tail()}")
        raise
    _shot(page, f"rendered_{Path(name).stem}.png")
    assert [text for text in RENDERED[name] if text not in shown] == []
