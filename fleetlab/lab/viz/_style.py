"""Colours and figure plumbing shared by every drawing in :mod:`fleetlab.lab.viz`.

A request keeps the same colour in every figure (block grid, batch rows, timeline), so a
reader can follow one request from picture to picture. Colours depend only on the request
id, never on drawing order.
"""

from __future__ import annotations

import zlib

from matplotlib.colors import to_hex
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

# Sixteen saturated request colours, distinct on white; the phase colours below are pastel
# so the two never clash. Drawings with more requests also write the ids.
PALETTE = (
    "#4e79a7", "#59a14f", "#e15759", "#b07aa1", "#edc948", "#76b7b2",
    "#9c755f", "#ff9da7", "#17becf", "#bcbd22", "#1f4e79", "#d37295",
    "#f28e2b", "#6b4c9a", "#8c2d04", "#00798c",
)
PHASE_COLORS = {"decode": "#a6c8e8", "prefill": "#f9c38f", "empty": "#eeeeee"}
FREE_COLOR = "#ffffff"
CACHED_FREE_COLOR = "#d9d9d9"
UNKNOWN_OWNER_COLOR = "#7f7f7f"
EDGE_COLOR = "#555555"
ALERT_COLOR = "#c0392b"
REVIVED_COLOR = "#1a9850"  # a block taken back from the prefix cache


def request_color(request_id) -> str:
    """The colour (hex string) of a request, the same in every figure.

    Integer-like ids (``"0"``, ``"1"``, ``7``) and single letters (``"a"``, ``"b"``) walk the
    palette in order, so the first requests of a run get distinct colours; other ids are
    hashed (CRC32, stable across runs).
    """
    text = str(request_id)
    if text.isdigit():
        index = int(text)
    elif len(text) == 1 and text.isascii() and text.isalpha():
        index = ord(text.lower()) - ord("a")
    else:
        index = zlib.crc32(text.encode())
    return PALETTE[index % len(PALETTE)]


def phase_color(phase: str) -> str:
    """Colour of a batch-row phase: ``"decode"``, ``"prefill"`` or ``"empty"``."""
    if phase not in PHASE_COLORS:
        raise ValueError(f"phase must be one of {sorted(PHASE_COLORS)}; got {phase!r}")
    return PHASE_COLORS[phase]


def new_axes(ax=None, figsize=(6.0, 3.0)):
    """``(figure, axes)``: the given axes and its figure, or a fresh single-axes Figure.

    Fresh figures are plain ``matplotlib.figure.Figure`` objects, not pyplot figures: they
    are not kept alive by pyplot, so widgets can redraw many times without leaking, and a
    notebook shows one only when a cell returns or displays it.
    """
    if ax is not None:
        return ax.figure, ax
    fig = Figure(figsize=figsize, layout="constrained")
    return fig, fig.add_subplot()


def hex_color(color) -> str:
    """Any matplotlib colour as ``"#rrggbb"`` (for comparing colours in tests)."""
    return to_hex(color)


def labelled_bars(ax, names, values, gid: str, fmt: str) -> None:
    """One bar per name (palette colours in order, gid ``"<gid>:<name>"``), its value written
    on top with ``fmt``, the names as x tick labels."""
    names = list(names)
    for x, (name, value) in enumerate(zip(names, values)):
        ax.bar(x, value, color=PALETTE[x % len(PALETTE)])[0].set_gid(f"{gid}:{name}")
        ax.text(x, value, fmt.format(value), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), names, fontsize=8)


def integer_steps(ax, axis: str = "x") -> None:
    """Tick only whole numbers on ``axis`` (engine steps, rows and blocks come in units)."""
    (ax.xaxis if axis == "x" else ax.yaxis).set_major_locator(MaxNLocator(integer=True))
