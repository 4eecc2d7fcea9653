"""Every notebook's outline is its Markdown: each heading sits in a Markdown cell (so JupyterLab's
table of contents lists it), and the title names the notebook's own number."""

import re
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
# A Markdown heading written as a comment in a code cell: "# ## 4. How many drafts?"
HEADING_IN_CODE = re.compile(r"^\s*#\s*#{1,6}\s+\S")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_heading_is_in_a_markdown_cell(path):
    nb = nbformat.read(path, as_version=4)
    stray = [(i, line) for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
             for line in cell.source.splitlines() if HEADING_IN_CODE.match(line)]
    assert stray == [], f"{path.name}: headings inside code cells (cell, line): {stray}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_title_carries_the_files_number(path):
    nb = nbformat.read(path, as_version=4)
    title = nb.cells[0].source.splitlines()[0]
    titles = [line for cell in nb.cells if cell.cell_type == "markdown" for line in cell.source.splitlines()
              if re.match(r"#\s", line)]
    assert re.match(rf"# {path.stem[:2]} · \S", title), f"{path.name}: title {title!r}"
    assert titles == [title], f"{path.name}: one title, the first line: {titles}"


def test_the_heading_check_catches_a_heading_after_code():
    assert HEADING_IN_CODE.match("# ## 4. How many drafts?") and HEADING_IN_CODE.match("  # # Title")
    assert not HEADING_IN_CODE.match("# a comment") and not HEADING_IN_CODE.match("x = 1  # ## not a line start")
