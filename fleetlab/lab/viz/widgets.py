"""Widgets that redraw a figure when a control moves: sliders, and a play button for steps.

Any drawing function that returns a Figure can be driven:

    fig_widget = LiveFigure(lambda block_size: draw_something(block_size),
                            int_sliders(block_size=(1, 32, 1, 16)))
    frames = player(lambda i: draw_engine_step(traces, i), len(traces))

Each widget keeps its latest figure in ``.figure``, so code (and tests) can move a control
by setting its ``value`` and inspect what was drawn, with or without a notebook.

A widget never fails silently: when the drawing function raises, the widget shows a figure
with the error's message in place of the stale picture, and keeps the exception in
``.error`` (None after a good draw).

In a notebook a widget shows each figure as a PNG it renders itself (:func:`figure_png`), so
the time a frame takes is the drawing plus that one rendering: ``.last_frame_s``, and
:func:`time_frames` measures a player's frames against its play interval.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Mapping, Sequence

import ipywidgets as widgets

# Pixels per inch of the PNGs widgets show (Jupyter's inline figures use the same).
FRAME_DPI = 100


def _in_ipython() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


class LiveFigure(widgets.VBox):
    """Controls above a figure that is redrawn whenever one of them changes.

    Args:
      draw: called as ``draw(**{name: control.value})``; must return a matplotlib Figure.
      controls: ``{keyword: widget with a value}``, e.g. from :func:`int_sliders`.
      children: widgets to show above the figure instead of the controls themselves
        (e.g. the controls laid out in an ``HBox``).
    Attributes: ``controls``, ``output`` (the ``ipywidgets.Output`` holding the figure),
    ``figure`` (the latest Figure), ``error`` (the exception the last draw raised, or None),
    ``num_draws`` and ``last_frame_s`` (seconds the last redraw took, PNG included in a notebook).
    """

    def __init__(self, draw: Callable[..., object], controls: Mapping[str, widgets.Widget],
                 children: Sequence[widgets.Widget] | None = None):
        if not controls:
            raise ValueError("LiveFigure needs at least one control")
        self.draw = draw
        self.controls = dict(controls)
        self.output = widgets.Output()
        self.figure = None
        self.error = None
        self.num_draws = 0
        self.last_frame_s = 0.0
        shown = list(children) if children is not None else list(self.controls.values())
        super().__init__(children=[*shown, self.output])
        for control in self.controls.values():
            control.observe(self._on_change, names="value")
        self.redraw()

    def values(self) -> dict:
        """The controls' current values, by keyword."""
        return {name: control.value for name, control in self.controls.items()}

    def redraw(self):
        """Draw with the current values, show the figure, and return it. If drawing raises,
        show (and return) a figure that says what went wrong instead."""
        start = time.perf_counter()
        values = self.values()
        try:
            self.figure, self.error = self.draw(**values), None
        except Exception as error:  # a widget must say what went wrong, not keep a stale picture
            self.figure, self.error = error_figure(error, values), error
        self.num_draws += 1
        if _in_ipython():  # outside IPython there is nowhere to show it; .figure still holds it
            from IPython.display import Image, display

            with self.output:
                self.output.clear_output(wait=True)
                display(Image(data=figure_png(self.figure), format="png"))
        self.last_frame_s = time.perf_counter() - start
        return self.figure

    def _on_change(self, change) -> None:
        self.redraw()


def figure_png(fig) -> bytes:
    """``fig`` rendered once as PNG bytes, at ``FRAME_DPI``: what a widget shows."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=FRAME_DPI)
    return buffer.getvalue()


def time_frames(live: LiveFigure, indices: Sequence[int]) -> list[float]:
    """Seconds each of a player's frames ``indices`` takes to draw and render as PNG, on this
    machine: set the slider to each index in turn (as play does), then back where it was.
    Compare them with ``live.play.interval`` (milliseconds): a frame slower than the interval
    makes play stutter."""
    slider = live.controls["index"]
    start, seconds = slider.value, []
    for index in indices:
        began = time.perf_counter()
        if slider.value == index:
            live.redraw()
        else:
            slider.value = int(index)  # redraws, as play does
        if not _in_ipython():  # in a notebook, redraw rendered the PNG already
            figure_png(live.figure)
        seconds.append(time.perf_counter() - began)
    slider.value = start
    return seconds


def error_figure(error: BaseException, values: Mapping | None = None):
    """A small Figure that shows ``error`` (type and message) and the control values that led to it."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.0, 1.6), layout="constrained")
    ax = fig.add_subplot()
    ax.axis("off")
    where = ", ".join(f"{k}={v}" for k, v in (values or {}).items())
    ax.text(0.0, 0.5, f"could not draw{' with ' + where if where else ''}:\n{type(error).__name__}: {error}",
            ha="left", va="center", fontsize=10, color="#c0392b", wrap=True, transform=ax.transAxes)
    return fig


def int_sliders(**specs: tuple[int, int, int, int]) -> dict[str, widgets.IntSlider]:
    """``{name: IntSlider}`` from ``name=(min, max, step, value)`` tuples.

    The slider only redraws on release (``continuous_update=False``), so dragging stays smooth.
    """
    sliders = {}
    for name, spec in specs.items():
        if len(spec) != 4:
            raise ValueError(f"slider {name!r}: give (min, max, step, value); got {spec!r}")
        low, high, step, value = (int(v) for v in spec)
        if not low <= value <= high:
            raise ValueError(f"slider {name!r}: value {value} outside [{low}, {high}]")
        sliders[name] = widgets.IntSlider(value=value, min=low, max=high, step=step, description=name,
                                          continuous_update=False, style={"description_width": "initial"})
    return sliders


def player(draw_frame: Callable[[int], object], num_frames: int, *, interval_ms: int = 600,
           description: str = "step", start: int = 0) -> LiveFigure:
    """A play button linked to a slider over frames ``0 .. num_frames - 1``.

    ``draw_frame(index)`` returns the Figure of one frame. Press play to step through the
    frames every ``interval_ms`` milliseconds, or drag the slider. The play control and the
    slider are linked in the kernel (``ipywidgets.link``), so setting either one's value from
    code moves the other. The returned :class:`LiveFigure` also has ``.play`` and ``.slider``.
    """
    if num_frames < 1:
        raise ValueError(f"player needs at least one frame; got num_frames={num_frames}")
    start = min(max(int(start), 0), num_frames - 1)
    slider = widgets.IntSlider(value=start, min=0, max=num_frames - 1, description=description,
                               continuous_update=True)
    play = widgets.Play(value=start, min=0, max=num_frames - 1, step=1, interval=interval_ms,
                        description="play")
    link = widgets.link((play, "value"), (slider, "value"))
    live = LiveFigure(lambda index: draw_frame(index), {"index": slider}, children=[widgets.HBox([play, slider])])
    live.play, live.slider, live.link = play, slider, link
    return live
