"""Drawings of the decode loop over time, from the engine's per-step traces.

Inputs are ``fleetlab.LLM`` traces (``LLM(..., record_traces=True).traces`` or the second
value of ``llm.step(trace=True)``): one ``StepTrace`` per step with its rows (request,
phase, tokens run, blocks held), preemptions, finished requests and free blocks.

- :func:`draw_timeline`: which request ran prefill or decode in which step.
- :func:`draw_kv_occupancy`: KV blocks held per request, step by step, against capacity.
- :func:`draw_step_tokens`: decode and prefill tokens batched per step, against the budget.
- :func:`draw_engine_step`: the three together, up to one step (for a play control).
- :func:`draw_step_timings`: where each step's time went (schedule, forward, sample...).

All take ``upto``: draw steps ``<= upto`` only, on axes sized for the whole run so a
player's frames do not jump around.
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from fleetlab.engine.outputs import STEP_TIMING_PARTS
from fleetlab.viz._style import ALERT_COLOR, EDGE_COLOR, PALETTE, new_axes, phase_color, request_color


def request_order(traces: Sequence) -> list[str]:
    """Request ids in order of their first appearance in ``traces`` (rows or preemptions)."""
    seen: dict[str, None] = {}
    for trace in traces:
        for row in trace.rows:
            seen.setdefault(row.request_id, None)
        for req_id in trace.preempted:
            seen.setdefault(req_id, None)
    return list(seen)


def _visible(traces: Sequence, upto: int | None) -> list:
    return [t for t in traces if upto is None or t.step <= upto]


def _step_xlim(ax, traces: Sequence) -> None:
    if traces:
        ax.set_xlim(traces[0].step - 0.6, traces[-1].step + 0.6)


def draw_timeline(traces: Sequence, *, upto: int | None = None, ax=None, title: str | None = None):
    """Draw one lane per request and one box per (request, step) it ran in.

    Boxes are orange for prefill (labelled with the tokens run, so chunked prefill shows as
    several boxes) and blue for decode. A red ``x`` marks a preemption (the request lost its
    blocks and waits to be recomputed); a black ``|`` marks the step a request finished.
    Returns the Figure. Boxes have gid ``"<phase>:<request id>:<step>"``; markers
    ``"preempted:<id>:<step>"`` and ``"finished:<id>:<step>"``.
    """
    req_ids = request_order(traces)
    lane = {req_id: y for y, req_id in enumerate(req_ids)}
    fig, ax = new_axes(ax, figsize=(max(5.0, 0.28 * len(traces) + 2.0), 0.35 * len(req_ids) + 1.2))
    for trace in _visible(traces, upto):
        for row in trace.rows:
            y = lane[row.request_id]
            ax.add_patch(Rectangle((trace.step - 0.45, y - 0.38), 0.9, 0.76, facecolor=phase_color(row.phase),
                                   edgecolor=request_color(row.request_id), linewidth=1.2,
                                   gid=f"{row.phase}:{row.request_id}:{trace.step}"))
            if row.phase == "prefill":
                ax.text(trace.step, y, str(row.num_scheduled_tokens), ha="center", va="center", fontsize=6)
        for req_id in trace.preempted:
            ax.plot([trace.step], [lane[req_id]], marker="x", color=ALERT_COLOR, markersize=9, markeredgewidth=2,
                    linestyle="none", gid=f"preempted:{req_id}:{trace.step}")
        for req_id in trace.finished:
            ax.plot([trace.step + 0.5], [lane[req_id]], marker="|", color="black", markersize=12,
                    linestyle="none", gid=f"finished:{req_id}:{trace.step}")
    _step_xlim(ax, traces)
    ax.set_ylim(len(req_ids) - 0.5, -0.5)
    ax.set_yticks(range(len(req_ids)), [f"req {r}" for r in req_ids], fontsize=8)
    ax.set_xlabel("engine step")
    ax.legend(handles=[Patch(color=phase_color("prefill"), label="prefill"),
                       Patch(color=phase_color("decode"), label="decode")],
              fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.set_title(title or "who ran what in each step", fontsize=9)
    return fig


def blocks_by_request(trace) -> dict[str, int]:
    """KV blocks held by each request that ran in ``trace``; a shared block counts once,
    for the first row (in batch order) that holds it."""
    seen: set[int] = set()
    held: dict[str, int] = {}
    for row in trace.rows:
        new = [b for b in row.block_ids if b not in seen]
        seen.update(new)
        held[row.request_id] = len(new)
    return held


def draw_kv_occupancy(traces: Sequence, *, upto: int | None = None, ax=None, title: str | None = None):
    """Stacked bars of KV blocks held per request in each step, against the pool's size.

    Bars count the blocks of the requests that ran in the step (gid
    ``"kv:<request id>:<step>"``, height = blocks); the black line is the blocks still in
    use after the step (finished requests have freed theirs); the red dashed line is the
    pool's capacity. Returns the Figure.
    """
    fig, ax = new_axes(ax, figsize=(5.0, 2.6))
    visible = _visible(traces, upto)
    for trace in visible:
        bottom = 0
        for req_id, n in blocks_by_request(trace).items():
            bar = ax.bar(trace.step, n, bottom=bottom, width=0.85, color=request_color(req_id),
                         edgecolor="white", linewidth=0.5)[0]
            bar.set_gid(f"kv:{req_id}:{trace.step}")
            bottom += n
    if visible:
        ax.step([t.step for t in visible], [t.num_blocks - t.num_free_blocks for t in visible], where="mid",
                color="black", linewidth=1.2, label="in use after step")
    if traces:
        ax.axhline(traces[0].num_blocks, color=ALERT_COLOR, linestyle="--", linewidth=1, label="pool size")
        ax.set_ylim(0, traces[0].num_blocks * 1.1)
    _step_xlim(ax, traces)
    ax.set_xlabel("engine step")
    ax.set_ylabel("KV blocks")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.set_title(title or "KV cache occupancy", fontsize=9)
    return fig


def draw_step_tokens(traces: Sequence, *, budget: int | None = None, upto: int | None = None, ax=None,
                     title: str | None = None):
    """Stacked bars of decode and prefill tokens batched in each step.

    ``budget``: draw ``max_num_batched_tokens`` as a dashed line. Bars have gid
    ``"tokens:<decode|prefill>:<step>"``. Returns the Figure.
    """
    fig, ax = new_axes(ax, figsize=(5.0, 2.6))
    for trace in _visible(traces, upto):
        decode = sum(r.num_scheduled_tokens for r in trace.rows if r.phase == "decode")
        prefill = sum(r.num_scheduled_tokens for r in trace.rows if r.phase == "prefill")
        ax.bar(trace.step, decode, width=0.85, color=phase_color("decode"))[0].set_gid(f"tokens:decode:{trace.step}")
        ax.bar(trace.step, prefill, bottom=decode, width=0.85,
               color=phase_color("prefill"))[0].set_gid(f"tokens:prefill:{trace.step}")
    if budget is not None:
        ax.axhline(budget, color=EDGE_COLOR, linestyle="--", linewidth=1, label="token budget")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    highest = max([t.num_batched_tokens for t in traces] + [budget or 0, 1])
    ax.set_ylim(0, highest * 1.1)
    _step_xlim(ax, traces)
    ax.set_xlabel("engine step")
    ax.set_ylabel("tokens")
    ax.set_title(title or "tokens per step (blue decode, orange prefill)", fontsize=9)
    return fig


# The parts of a step in the order they run (keys of ``StepTrace.timings``).
TIMING_PARTS = STEP_TIMING_PARTS


def draw_step_timings(traces: Sequence, *, ax=None, title: str | None = None):
    """Stacked bars of where each step's time went, in milliseconds.

    Parts are ``TIMING_PARTS`` (schedule, batch_update, metadata, forward, sample, update),
    bottom to top; parts a trace lacks count as 0. Bars have gid
    ``"timing:<part>:<step>"``. Returns the Figure.
    """
    fig, ax = new_axes(ax, figsize=(6.0, 2.8))
    for trace in traces:
        bottom = 0.0
        for i, part in enumerate(TIMING_PARTS):
            ms = 1e3 * float(trace.timings.get(part, 0.0))
            bar = ax.bar(trace.step, ms, bottom=bottom, width=0.85, color=PALETTE[i],
                         label=part if trace is traces[0] else None)[0]
            bar.set_gid(f"timing:{part}:{trace.step}")
            bottom += ms
    _step_xlim(ax, traces)
    ax.set_xlabel("engine step")
    ax.set_ylabel("ms")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.set_title(title or "where a step's time goes", fontsize=9)
    return fig


def describe_step(trace) -> str:
    """One line about a step: rows in batch order, decodes, preemptions, finishes."""
    rows = ", ".join(f"{r.request_id}:{r.phase[0]}{r.num_scheduled_tokens}" for r in trace.rows)
    text = f"step {trace.step}: rows [{rows}]  ({trace.num_batched_tokens} tokens)"
    if trace.reordered and trace.order_before != trace.order_after:
        text += f"  reordered {trace.order_before} -> {trace.order_after}"
    if trace.preempted:
        text += f"  preempted {trace.preempted}"
    if trace.finished:
        text += f"  finished {trace.finished}"
    return text


def draw_engine_step(traces: Sequence, step: int, *, budget: int | None = None):
    """The run up to ``step``: timeline on top, KV occupancy and tokens per step below.

    The current step is shaded in every panel and described in the title
    (:func:`describe_step`). Returns the Figure.
    """
    current = [t for t in traces if t.step == step]
    if not current:
        raise ValueError(f"no trace for step {step} (steps {traces[0].step}..{traces[-1].step})" if traces
                         else "no traces to draw")
    num_requests = len(request_order(traces))
    fig = Figure(figsize=(max(7.0, 0.3 * len(traces) + 3.0), 0.35 * num_requests + 4.2), layout="constrained")
    grid = fig.add_gridspec(2, 2, height_ratios=[max(2, num_requests) * 0.35 + 0.8, 2.4])
    ax_time, ax_kv, ax_tok = fig.add_subplot(grid[0, :]), fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])
    draw_timeline(traces, upto=step, ax=ax_time)
    draw_kv_occupancy(traces, upto=step, ax=ax_kv)
    draw_step_tokens(traces, budget=budget, upto=step, ax=ax_tok)
    for ax in (ax_time, ax_kv, ax_tok):
        ax.axvspan(step - 0.5, step + 0.5, color="#ffe08a", alpha=0.35, zorder=0)
    fig.suptitle(describe_step(current[0]), fontsize=9)
    return fig
