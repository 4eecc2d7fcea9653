"""Why an engine caches keys and values, drawn: attention over a growing sequence, the work
each new token costs with and without a KV cache, and what one forward pass costs as it
carries more tokens (prefill against decode).

Timings come in as ``[repeats, points]`` arrays of seconds, one row per timed run (warm-up
runs left out by the caller). Each curve is drawn at the fastest run, with a band up to the
slowest: on a shared machine other work only ever adds time, so the fastest run is the best
estimate of what the code costs (as ``timeit`` reports it), and the band shows how far the
run-to-run wobble goes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import FuncFormatter

from fleetlab.lab.viz._style import EDGE_COLOR, PALETTE, new_axes

CACHED_KV_COLOR = "#8fd18f"   # keys and values read from the cache
NEW_KV_COLOR = "#f9c38f"      # computed in this pass
EARLIER_COLOR = "#e6e6e6"     # rows computed in earlier passes


def draw_attention_pattern(labels: Sequence[str], *, ax=None, title: str | None = None):
    """Which tokens each token's query attends to, as a grid: row ``i`` is token ``i``'s
    query, column ``j`` token ``j``'s key and value; a cell is filled when ``j <= i`` (causal:
    nothing attends to a later token).

    The last row is the token being computed in this pass: its own key and value are new
    (orange), every earlier one (green) is the same as in the previous pass, so a cache can
    hand it over. Earlier rows (grey) were finished in earlier passes. Cells have gid
    ``"attn:<i>:<j>"``. Returns the Figure.
    """
    n = len(labels)
    if n < 2:
        raise ValueError("draw_attention_pattern: give at least two tokens")
    fig, ax = new_axes(ax, figsize=(0.32 * n + 2.6, 0.3 * n + 1.2))
    for i in range(n):
        for j in range(i + 1):
            last = i == n - 1
            color = (NEW_KV_COLOR if j == i else CACHED_KV_COLOR) if last else EARLIER_COLOR
            ax.add_patch(Rectangle((j, -i), 0.92, 0.92, facecolor=color, edgecolor="white", gid=f"attn:{i}:{j}"))
    ax.set_xlim(-0.1, n)
    ax.set_ylim(-n + 0.9, 1.0)
    ax.set_aspect("equal")
    ax.set_xticks([j + 0.46 for j in range(n)], list(labels), fontsize=7)
    ax.set_yticks([-i + 0.46 for i in range(n)], list(labels), fontsize=7)
    ax.xaxis.tick_top()
    ax.set_xlabel("keys and values of token j", fontsize=8)
    ax.xaxis.set_label_position("top")
    ax.set_ylabel("query of token i", fontsize=8)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.legend(handles=[Patch(facecolor=EARLIER_COLOR, label="computed in earlier passes"),
                       Patch(facecolor=CACHED_KV_COLOR, label="K, V unchanged since then:\nread from the cache"),
                       Patch(facecolor=NEW_KV_COLOR, label="the new token's own K, V")],
              loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=7, frameon=False)
    ax.set_title(title or f"attention of {n} tokens: the newest row needs every earlier K and V", fontsize=9)
    return fig


def _band(ax, x, seconds, color, label, gid):
    """The fastest run as a line (gid) and a band up to the slowest, of ``seconds [repeats, points]``, in ms."""
    ms = 1e3 * np.atleast_2d(np.asarray(seconds, dtype=float))
    ax.fill_between(x, ms.min(0), ms.max(0), color=color, alpha=0.25, linewidth=0)
    ax.plot(x, ms.min(0), color=color, marker="o", markersize=3, label=label, gid=gid)


def draw_cache_cost(no_cache_tokens: Sequence[int], cached_tokens: Sequence[int], lengths: Sequence[int],
                    no_cache_s, cached_lengths: Sequence[int], cached_s, *, clock: str = "wall-clock"):
    """Generating with and without a KV cache, in work and in time.

    Left: tokens run through the model for each generated token (``no_cache_tokens``: the
    whole sequence every time; ``cached_tokens``: the prompt once, then one token), with the
    totals. Right: milliseconds per generated token against the sequence's length:
    ``no_cache_s [repeats, len(lengths)]`` (a pass over the whole sequence) and ``cached_s
    [repeats, len(cached_lengths)]`` (a decode step), measured on ``clock`` (named on the axis).
    Lines have gid ``"work:<no-cache|cached>"`` and ``"time:<no-cache|cached>"``. Returns the Figure.
    """
    fig = Figure(figsize=(11.0, 3.4), layout="constrained")
    ax_work, ax_time = fig.subplots(1, 2)
    steps = np.arange(len(no_cache_tokens))
    ax_work.step(steps, no_cache_tokens, where="mid", color=PALETTE[2], gid="work:no-cache",
                 label=f"no cache: the whole sequence ({sum(no_cache_tokens)} tokens in all)")
    ax_work.step(np.arange(len(cached_tokens)), cached_tokens, where="mid", color=PALETTE[0], gid="work:cached",
                 label=f"KV cache: the prompt, then 1 ({sum(cached_tokens)} in all)")
    ax_work.set_xlabel("generated token")
    ax_work.set_ylabel("tokens through the model")
    ax_work.set_title("work per generated token (counted)", fontsize=9)
    ax_work.legend(fontsize=7, loc="upper left", frameon=False)
    _band(ax_time, lengths, no_cache_s, PALETTE[2], "no cache: one pass over the sequence", "time:no-cache")
    _band(ax_time, cached_lengths, cached_s, PALETTE[0], "KV cache: one engine decode step", "time:cached")
    ax_time.set_xlabel("sequence length (tokens)")
    ax_time.set_ylabel(f"{clock} ms per generated token")
    ax_time.set_ylim(0, None)
    ax_time.set_title("time per generated token (measured: fastest run, band up to the slowest)", fontsize=9)
    ax_time.legend(fontsize=7, loc="upper left", frameon=False)
    return fig


def _two_and_five(value, _) -> str:
    """Label the 2s and 5s of a log axis's minor ticks (0.2, 0.5, 2, 5, 20 ...), as plain numbers."""
    text = f"{value:g}"
    return text if text.lstrip("0.")[:1] in ("2", "5") else ""


def draw_pass_cost(sizes: Sequence[int], seconds, *, clock: str = "wall-clock"):
    """What one forward pass costs as it carries more tokens: ``seconds [repeats, len(sizes)]``.

    Left: milliseconds per pass; right: milliseconds per token (the pass divided by its
    tokens), both against the tokens in the pass (a linear axis; per token on a log scale),
    measured on ``clock``. A prefill
    of ``n`` prompt tokens is one pass of ``n``; a decode step of one request is a pass of 1.
    Lines have gid ``"pass"`` and ``"per-token"``. Returns the Figure.
    """
    sizes = np.asarray(sizes, dtype=float)
    seconds = np.atleast_2d(np.asarray(seconds, dtype=float))
    fig = Figure(figsize=(11.0, 3.2), layout="constrained")
    ax_pass, ax_token = fig.subplots(1, 2)
    _band(ax_pass, sizes, seconds, PALETTE[0], "one forward pass", "pass")
    _band(ax_token, sizes, seconds / sizes, PALETTE[1], "per token", "per-token")
    ticks = [s for s in sizes if s == sizes[0] or s >= sizes[-1] / 16]  # linear: the small sizes would overlap
    for ax in (ax_pass, ax_token):
        ax.set_xticks(ticks, [f"{int(s)}" for s in ticks])  # a linear axis: linear growth looks linear
        ax.set_xlabel("tokens in the pass")
        ax.grid(True, which="major", color=EDGE_COLOR, alpha=0.15)
    ax_pass.set_ylim(0, None)
    ax_pass.set_ylabel(f"{clock} ms per pass")
    ax_pass.set_title("one forward pass (measured: fastest run, band up to the slowest)", fontsize=9)
    ax_token.set_yscale("log")  # per token spans a decade or two; plain numbers, not 3x10^0
    ax_token.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax_token.yaxis.set_minor_formatter(FuncFormatter(_two_and_five))
    ax_token.set_ylabel(f"{clock} ms per token")
    ax_token.set_title("per token: the pass divided by the tokens it carries", fontsize=9)
    return fig
