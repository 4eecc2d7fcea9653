"""Drive JupyterLab's notebook page through Playwright: open, run all, find and move a slider.

Selectors are JupyterLab 4 / ipywidgets 8 classes: ``.jp-CodeCell .jp-InputPrompt`` shows
``[*]:`` while a cell waits or runs and ``[n]:`` once it ran; ``.widget-slider .noUi-handle``
is a slider's handle (keyboard-focusable, with ``aria-valuenow``); ``.widget-output img`` is a
PNG shown inside an ``ipywidgets.Output``, which is where fleetlab.lab.viz widgets draw.
"""

from __future__ import annotations

import re
import time
from urllib.parse import quote

from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

# Text ipywidgets' renderer shows instead of a widget it has not (or could not) render.
WIDGET_PLACEHOLDERS = ("Loading widget", "Error displaying widget")
LIVE_ATTR = "data-browser-test"

# The status bar's kernel item reads "Python 3 (ipykernel) | Idle" once a kernel is connected
# and idle ("No Kernel | Initializing" before); the toolbar's indicator says idle in both cases.
_KERNEL_IDLE_JS = """() => [...document.querySelectorAll('#jp-main-statusbar .jp-StatusBar-TextItem')]
  .some(e => /\\|\\s*Idle$/.test(e.textContent.trim()) && !e.textContent.startsWith('No Kernel'))"""

# Finished: a kernel is idle, no prompt shows [*] and the first cell ran. A dialog also ends
# the wait, so that run_all_cells can report it instead of timing out.
_RUN_FINISHED_JS = """() => {
  if (document.querySelector('.jp-Dialog')) return true;
  const prompts = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')]
      .map(e => e.textContent.trim());
  const indicator = document.querySelector('.jp-Notebook-ExecutionIndicator');
  const idle = indicator !== null && indicator.getAttribute('data-status') === 'idle';
  return idle && prompts.length > 0 && !prompts.includes('[*]:') && /^\\[\\d+\\]:$/.test(prompts[0]);
}"""

_NOT_RUN_JS = """() => [...document.querySelectorAll('.jp-Notebook .jp-CodeCell')]
  .filter(c => !/^\\[\\d+\\]:$/.test(c.querySelector('.jp-InputPrompt').textContent.trim())
               && c.querySelector('.jp-InputArea-editor').textContent.trim() !== '')
  .length"""

_ERRORS_JS = """() => [...document.querySelectorAll(
    '.jp-Notebook [data-mime-type="application/vnd.jupyter.error"],'
    + ' .jp-Notebook [data-mime-type="application/vnd.jupyter.stderr"]')]
  .map(e => e.innerText.slice(-1500))"""

_PLACEHOLDERS_JS = """(texts) => {
  const shown = document.querySelector('.jp-Notebook').innerText;
  return texts.filter(t => shown.includes(t));
}"""

# Tag the first widget that holds both a slider and an image in an Output, and its handle.
_TAG_LIVE_PLOT_JS = """(attr) => {
  for (const slider of document.querySelectorAll('.jp-Notebook .widget-slider')) {
    let root = slider.parentElement;
    while (root && !root.classList.contains('jp-OutputArea-output')
           && !root.querySelector('.widget-output img')) root = root.parentElement;
    if (!root || !root.querySelector('.widget-output img')) continue;
    root.setAttribute(attr, 'plot');
    slider.querySelector('.noUi-handle').setAttribute(attr, 'handle');
    return true;
  }
  return false;
}"""

_IMAGE_CHANGED_JS = """([attr, before]) => {
  const img = document.querySelector(`[${attr}="plot"] .widget-output img`);
  return img !== null && img.complete && img.naturalWidth > 0 && img.getAttribute('src') !== before;
}"""


def open_notebook(page, base_url: str, name: str, timeout_ms: int, attempts: int = 2) -> None:
    """Open ``name`` (relative to the server's root) in a fresh workspace; wait for an idle kernel.

    The page load is retried once (a first load on a busy machine can stall). A kernel-selection
    dialog (a notebook without kernelspec metadata) is accepted once: it picks the Python kernel.
    """
    url = f"{base_url}/lab/tree/{quote(name)}?reset"
    for attempt in range(1, attempts + 1):
        try:
            page.goto(url, wait_until="domcontentloaded", timeout=timeout_ms // attempts)
            page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell").first.wait_for(
                timeout=timeout_ms // attempts)
            break
        except PlaywrightTimeoutError:
            if attempt == attempts:
                raise
    accept = page.locator(".jp-Dialog .jp-mod-accept")
    deadline, accepted = time.monotonic() + timeout_ms / 1000, False
    while not page.evaluate(_KERNEL_IDLE_JS):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no idle kernel within {timeout_ms} ms; status bar: "
                               f"{page.locator('#jp-main-statusbar').inner_text()!r}")
        if not accepted and accept.count():
            accept.first.click()
            accepted = True
        page.wait_for_timeout(250)


def run_all_cells(page, timeout_ms: int) -> None:
    """Run > Run All Cells, then wait until the kernel is idle and no cell is pending.

    Raises RuntimeError with the notebook's error output when a cell failed (Run All stops
    there) or a dialog popped up, and Playwright's TimeoutError when the run outlasts ``timeout_ms``.
    """
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
    page.wait_for_function(_RUN_FINISHED_JS, timeout=timeout_ms, polling=250)
    dialog = page.locator(".jp-Dialog")
    if dialog.count():
        raise RuntimeError(f"a dialog opened during Run All: {dialog.first.inner_text()!r}")
    not_run = page.evaluate(_NOT_RUN_JS)
    if not_run:
        errors = "\n---\n".join(page.evaluate(_ERRORS_JS)) or "(no error output shown)"
        raise RuntimeError(f"Run All left {not_run} code cell(s) unexecuted; error output:\n{errors}")


def wait_widgets_rendered(page, timeout_ms: int) -> None:
    """Wait until no widget placeholder text is left and at least one slider is shown."""
    try:
        page.wait_for_function(f"(texts) => !({_PLACEHOLDERS_JS})(texts).length",
                               arg=list(WIDGET_PLACEHOLDERS), timeout=timeout_ms, polling=250)
    except PlaywrightTimeoutError as error:  # say which placeholder stayed, not just 'timeout'
        left = placeholders_shown(page)
        raise RuntimeError(f"widget placeholders still shown after {timeout_ms} ms: {left}") from error
    page.locator(".jp-Notebook .widget-slider .noUi-handle").first.wait_for(timeout=timeout_ms)


def tag_live_plot(page, timeout_ms: int):
    """Find the first widget with a slider and an Output image; return (widget, handle) locators."""
    page.wait_for_function(_TAG_LIVE_PLOT_JS, arg=LIVE_ATTR, timeout=timeout_ms, polling=250)
    return page.locator(f"[{LIVE_ATTR}='plot']"), page.locator(f"[{LIVE_ATTR}='handle']")


# Every output's text, scrolling the notebook top to bottom (JupyterLab may detach cells far
# from the viewport, so a single read would miss them).
_OUTPUT_TEXT_JS = """async () => {
  const scroller = document.querySelector('.jp-NotebookPanel .jp-WindowedPanel-outer')
      || document.querySelector('.jp-NotebookPanel .jp-Notebook');
  const seen = new Set();
  for (let top = 0; top <= scroller.scrollHeight; top += Math.max(200, scroller.clientHeight / 2)) {
    scroller.scrollTop = top;
    await new Promise(done => setTimeout(done, 120));
    document.querySelectorAll('.jp-Notebook .jp-OutputArea-output').forEach(e => seen.add(e.innerText));
  }
  return [...seen].join('\\n');
}"""


def output_text(page) -> str:
    """The text of every cell output, the notebook scrolled through from top to bottom."""
    return page.evaluate(_OUTPUT_TEXT_JS)


def placeholders_shown(page) -> list[str]:
    """Which of :data:`WIDGET_PLACEHOLDERS` the notebook shows now."""
    return page.evaluate(_PLACEHOLDERS_JS, list(WIDGET_PLACEHOLDERS))


def plot_image(widget):
    """The locator of the image the widget's Output shows."""
    return widget.locator(".widget-output img").first


def plot_src(widget) -> str:
    """The ``src`` (a PNG data URL) of the image the widget currently shows."""
    return plot_image(widget).get_attribute("src")


def nudge_slider(handle) -> str:
    """Move a slider one step with the keyboard (right, or left when at its maximum).

    Returns the key pressed; noUiSlider turns the key press into a ``change`` event, which
    ipywidgets sends to the kernel even with ``continuous_update=False``.
    """
    now, high = (float(handle.get_attribute(a)) for a in ("aria-valuenow", "aria-valuemax"))
    key = "ArrowLeft" if now >= high else "ArrowRight"
    handle.scroll_into_view_if_needed()
    handle.focus()
    handle.press(key)
    return key


def wait_plot_changed(page, before_src: str, timeout_ms: int) -> None:
    """Wait until the tagged widget shows a loaded image whose ``src`` differs from ``before_src``."""
    page.wait_for_function(_IMAGE_CHANGED_JS, arg=[LIVE_ATTR, before_src], timeout=timeout_ms, polling=250)
