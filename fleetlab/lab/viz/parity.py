"""Drawing logits parity: does the patched model (paged attention) compute what the model
itself computes?

Inputs are the per-request logits that :func:`fleetlab.patching.parity.reference_greedy`
(the oracle: the unpatched model's own full forward) and
:func:`fleetlab.patching.parity.paged_greedy` (the patched model over a paged cache)
return: a list with one ``[steps, vocab]`` array per request. A single 2-D array is taken
as one request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from fleetlab.lab.viz._style import request_color


def _as_requests(logits) -> list[np.ndarray]:
    if isinstance(logits, np.ndarray) and logits.ndim == 2:
        return [logits.astype(np.float64)]
    arrays = [np.asarray(a, dtype=np.float64) for a in logits]
    if any(a.ndim != 2 for a in arrays):
        raise ValueError("logits must be [steps, vocab] per request")
    return arrays


@dataclass(slots=True)
class ParityReport:
    """How far two sets of logits are apart.

    max_abs_diff: the largest ``|reference - paged|`` over every request, step and token.
    per_step: per request, ``[steps]`` of the largest difference over the vocabulary.
    argmax_agreement: share of (request, step) pairs whose greedy token is the same.
    """

    max_abs_diff: float
    per_step: list[np.ndarray]
    argmax_agreement: float


def logits_parity(reference, paged) -> ParityReport:
    """Compare per-request logits (``[steps, vocab]`` each) of the oracle and the patched model."""
    ref, new = _as_requests(reference), _as_requests(paged)
    if len(ref) != len(new) or any(a.shape != b.shape for a, b in zip(ref, new)):
        raise ValueError(f"logits shapes differ: {[a.shape for a in ref]} vs {[b.shape for b in new]}")
    per_step = [np.abs(a - b).max(axis=-1) for a, b in zip(ref, new)]
    agree = [a.argmax(-1) == b.argmax(-1) for a, b in zip(ref, new)]
    flat = np.concatenate(agree) if agree else np.zeros(0, bool)
    return ParityReport(
        max_abs_diff=float(max((d.max(initial=0.0) for d in per_step), default=0.0)),
        per_step=per_step,
        argmax_agreement=float(flat.mean()) if flat.size else 1.0,
    )


def draw_logits_parity(reference, paged, *, max_points: int = 4000, seed: int = 0):
    """Two panels: oracle vs paged logits as a scatter, and the worst difference per step.

    Args:
      reference, paged: per-request ``[steps, vocab]`` logits (see the module docstring).
      max_points: scatter at most this many (request, step, token) points, sampled with ``seed``.
    Left: each point is one logit, x from the oracle, y from the patched model; on the
    diagonal means equal. Right: one point per (request, step) at the max |difference| over
    the vocabulary, on a log axis (a ``Line2D`` with gid ``"diff:<request>:<step>"``, in the
    request's colour, named in the legend), beside a
    dashed line at float32's rounding step for logits of this size (machine epsilon x the
    largest |logit|): points near it differ by rounding alone. Exact zeros, which a log axis
    cannot show, are hollow markers on the bottom edge. Returns the Figure.
    """
    ref, new = _as_requests(reference), _as_requests(paged)
    report = logits_parity(ref, new)
    fig = Figure(figsize=(9.0, 3.4), layout="constrained")
    ax_scatter, ax_bars = fig.subplots(1, 2, width_ratios=[1, 1.6])
    x = np.concatenate([a.reshape(-1) for a in ref])
    y = np.concatenate([b.reshape(-1) for b in new])
    if x.size > max_points:
        keep = np.random.default_rng(seed).choice(x.size, max_points, replace=False)
        x, y = x[keep], y[keep]
    ax_scatter.scatter(x, y, s=4, alpha=0.5, color="#4e79a7", gid="logits")
    lo, hi = float(min(x.min(initial=0), y.min(initial=0))), float(max(x.max(initial=0), y.max(initial=0)))
    ax_scatter.plot([lo, hi], [lo, hi], color="black", linewidth=0.8, linestyle="--")
    ax_scatter.set_xlabel("oracle logit (unpatched full forward)")
    ax_scatter.set_ylabel("paged logit (patched model)")
    ax_scatter.set_title(f"{x.size} logits", fontsize=9)
    rounding = float(np.finfo(np.float32).eps) * max(abs(lo), abs(hi), 1e-30)
    nonzero = [float(d) for diffs in report.per_step for d in diffs if d > 0]
    floor = min([rounding, *nonzero]) / 10
    pos = 0
    for i, diffs in enumerate(report.per_step):
        for s, d in enumerate(diffs):
            zero = float(d) == 0.0
            ax_bars.plot([pos], [floor if zero else float(d)], marker="o", markersize=5, linestyle="none",
                         color=request_color(i), markerfacecolor="none" if zero else request_color(i),
                         clip_on=False, gid=f"diff:{i}:{s}")
            pos += 1
        pos += 1  # a gap between requests
    ax_bars.axhline(rounding, color="#555555", linestyle="--", linewidth=1,
                    label=f"float32 rounding at |logit| {max(abs(lo), abs(hi)):.2g} ({rounding:.0e})")
    ax_bars.set_yscale("log")
    ax_bars.set_ylim(floor, max([rounding, *nonzero]) * 30)  # room for the legend above the points
    handles, _ = ax_bars.get_legend_handles_labels()
    handles += [Line2D([], [], marker="o", linestyle="none", color=request_color(i), label=f"request {i}")
                for i in range(len(report.per_step))]
    ax_bars.legend(handles=handles, fontsize=7, loc="upper right", frameon=False, ncols=2 if len(handles) > 4 else 1)
    ax_bars.set_xticks([])
    ax_bars.set_xlabel("generation steps, request by request (hollow: exactly 0)")
    ax_bars.set_ylabel("max |oracle - paged|")
    ax_bars.set_title(f"worst difference {report.max_abs_diff:.1e}; greedy tokens agree "
                      f"{100 * report.argmax_agreement:.0f}%", fontsize=9)
    return fig


def greedy_table(tokens_a: Sequence[Sequence[int]], tokens_b: Sequence[Sequence[int]], decode=None) -> str:
    """Side-by-side greedy outputs of two runs, one line per request, ``==`` when equal.

    ``decode``: optional ``ids -> str`` (a tokenizer's decode) to show text instead of ids.
    """
    lines = []
    for i, (a, b) in enumerate(zip(tokens_a, tokens_b)):
        show = (lambda ids: repr(decode(list(ids)))) if decode else (lambda ids: str(list(ids)))
        mark = "==" if list(a) == list(b) else "!="
        lines.append(f"req {i}: {show(a)} {mark} {show(b)}")
    return "\n".join(lines)
