"""Drawings of the decode loop over time, from the engine's per-step traces.

Inputs are ``fleetlab.LLM`` traces (``LLM(..., record_traces=True).traces``, or the traces of
a ``fleetlab.StepRecorder``): one ``StepTrace`` per step with its rows (request, phase, tokens
run, blocks held), preemptions, finished requests and free blocks.

- :func:`draw_timeline`: which request ran prefill or decode in which step (and, given the
  waits of :func:`fleetlab.lab.viz.queue_waits`, when each arrived and what kept it waiting).
- :func:`admissions`: when each request was admitted (or re-admitted after a preemption) and
  how many of its tokens it found already in the prefix cache.
- :func:`draw_kv_occupancy`: KV blocks held per request, step by step, against capacity.
- :func:`draw_step_tokens`: decode and prefill tokens batched per step, against the budget.
- :func:`draw_engine_step`: those three (and the block pool, given ``pool_frames``) up to one
  step, for a play control.
- :func:`draw_row_usage` / :func:`draw_batching_comparison`: the batch's rows step by step,
  busy or idle (static against continuous batching).
- :func:`draw_step_timings`: where each step's time went (schedule, forward, sample...).

All take ``upto``: draw steps ``<= upto`` only, on axes sized for the whole run so a
player's frames do not jump around.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from fleetlab.engine.hooks import STEP_PHASES
from fleetlab.lab.viz._style import (
    ALERT_COLOR,
    EDGE_COLOR,
    PALETTE,
    REVIVED_COLOR,
    integer_steps,
    new_axes,
    phase_color,
    request_color,
)
from fleetlab.lab.viz.blocks import draw_block_pool
from fleetlab.lab.viz.waiting import WAIT_REASONS


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
    integer_steps(ax)


@dataclass(slots=True)
class Admission:
    """A request entering the batch: first at ``step``, or again after a preemption (``resumed``).

    num_cached_tokens: tokens it found already computed in the prefix cache (its first
    ``num_cached_tokens // block_size`` blocks, ``cached_block_ids``), so it computes only
    the rest. After a preemption these are its own earlier blocks, if nobody evicted them.
    chunks: the prefill chunks it then ran, step by step, until it decoded, was preempted
    again or the traces ended: once ``rebuilt``, ``num_cached_tokens + sum(chunks)`` is the
    length it had to rebuild (its prompt, plus after a preemption the tokens it had generated).
    rebuilt: it went on to decode or finished (False: preempted again first, or the traces end).
    """

    step: int
    request_id: str
    num_cached_tokens: int
    cached_block_ids: list[int]
    resumed: bool
    chunks: list[int] = field(default_factory=list)
    rebuilt: bool = False

    def describe(self) -> str:
        """One sentence: when it came, what it found cached, and how it rebuilt the rest."""
        came = "came back" if self.resumed else "was admitted"
        text = f"req {self.request_id} {came} in step {self.step} with {self.num_cached_tokens} tokens in the cache"
        if self.cached_block_ids:
            text += f" (blocks {self.cached_block_ids})"
        done = sum(self.chunks)
        if self.chunks and self.rebuilt:
            return f"{text}, then ran prefill chunks {self.chunks}: {self.num_cached_tokens} + {done} = " \
                   f"{self.num_cached_tokens + done}"
        if self.chunks:
            return text + f", ran prefill chunks {self.chunks} and was preempted again"
        if self.rebuilt:
            return text + " and decoded at once: only its newest token was left to compute"
        return text + " and was preempted again"


def admissions(traces: Sequence, block_size: int | None = None) -> list[Admission]:
    """Every admission and re-admission in ``traces``, in step order (see :class:`Admission`).

    ``block_size``: the pool's block size, to name the cached blocks (``cached_block_ids``
    stays empty without it)."""
    out, admitted, preempted, filling = [], set(), set(), {}
    for trace in traces:
        for row in trace.rows:
            if row.request_id not in admitted:
                admitted.add(row.request_id)
                cached = row.num_computed_tokens
                blocks = list(row.block_ids[: cached // block_size]) if block_size else []
                filling[row.request_id] = Admission(trace.step, row.request_id, cached, blocks,
                                                    resumed=row.request_id in preempted)
                out.append(filling[row.request_id])
            if row.request_id in filling:
                if row.phase == "prefill":
                    filling[row.request_id].chunks.append(row.num_scheduled_tokens)
                else:
                    filling.pop(row.request_id).rebuilt = True
        for req_id in trace.finished:  # finished on its last prefill chunk: rebuilt all the same
            if req_id in filling:
                filling.pop(req_id).rebuilt = True
        for req_id in trace.preempted:
            filling.pop(req_id, None)
        admitted.difference_update(trace.preempted)
        preempted.update(trace.preempted)
    return out


# Waiting bars, by what kept the request out (keys of fleetlab.lab.viz.waiting.WAIT_REASONS).
WAIT_COLORS = {"rows": "#bdbdbd", "budget": "#d5bdf0", "pool": "#f1a1a1", "pool or budget": "#f1a1a1",
               "preemption": "#f1a1a1"}
WAIT_HATCHES = {"preemption": "////"}
WAIT_LABELS = {"rows": "all rows taken", "budget": "token budget spent", "pool": "KV pool full",
               "pool or budget": "pool full or prompt\nover the budget left",
               "preemption": "a preemption\nin this step"}


def draw_timeline(traces: Sequence, *, upto: int | None = None, ax=None, title: str | None = None,
                  waits: Sequence | None = None, request_ids: Sequence[str] | None = None):
    """Draw one lane per request and one box per (request, step) it ran in.

    Boxes are orange for prefill (labelled with the tokens run, so chunked prefill shows as
    several boxes) and blue for decode. A red ``x`` marks a preemption (the request lost its
    blocks and waits to be recomputed); a black ``|`` marks the step a request finished; a
    green number in a box counts the tokens a request found in the prefix cache when it was
    admitted (after a preemption: its own earlier blocks, so it recomputes only the rest).

    ``waits`` (from :func:`fleetlab.lab.viz.queue_waits`): also mark each request's arrival (a
    black triangle) and draw a thin bar through every step it waited, coloured by what kept it
    out (``WAIT_COLORS``: rows taken, budget spent, pool full, a preemption).

    Returns the Figure. Boxes have gid ``"<phase>:<request id>:<step>"``; markers
    ``"preempted:<id>:<step>"``, ``"finished:<id>:<step>"``, ``"arrived:<id>:<step>"``; texts
    ``"cached:<id>:<step>"``; waiting bars ``"wait:<id>:<step>:<reason>"``. ``request_ids``: the
    lanes' order, top down (default: first appearance), e.g. the same for two runs drawn together.
    """
    req_ids = [str(r) for r in request_ids] if request_ids is not None else []
    req_ids += [r for r in request_order(traces) if r not in req_ids]
    req_ids += list(dict.fromkeys(w.request_id for w in waits or () if w.request_id not in req_ids))
    lane = {req_id: y for y, req_id in enumerate(req_ids)}
    fig, ax = new_axes(ax, figsize=(max(5.0, 0.28 * len(traces) + 2.5), 0.35 * len(req_ids) + 1.2))
    visible = _visible(traces, upto)
    hits = {(a.request_id, a.step): a.num_cached_tokens for a in admissions(visible) if a.num_cached_tokens}
    shown_reasons = _draw_waits(ax, waits or (), lane, upto)
    for trace in visible:
        for row in trace.rows:
            _draw_box(ax, trace.step, lane[row.request_id], row, hits.get((row.request_id, trace.step)))
        for req_id in trace.preempted:
            ax.plot([trace.step], [lane[req_id]], marker="x", color=ALERT_COLOR, markersize=8, markeredgewidth=2,
                    linestyle="none", gid=f"preempted:{req_id}:{trace.step}")
        for req_id in trace.finished:
            ax.plot([trace.step + 0.5], [lane[req_id]], marker="|", color="black", markersize=12,
                    linestyle="none", gid=f"finished:{req_id}:{trace.step}")
    _step_xlim(ax, traces)
    ax.set_ylim(len(req_ids) - 0.5, -0.5)
    ax.set_yticks(range(len(req_ids)), [f"req {r}" for r in req_ids], fontsize=8)
    ax.set_xlabel("engine step")
    ax.legend(handles=_timeline_legend(bool(hits), waits is not None, shown_reasons), fontsize=7, loc="upper left",
              bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.set_title(title or "who ran what in each step", fontsize=9)
    return fig


def _draw_box(ax, step: int, y: int, row, cached: int | None) -> None:
    """One (request, step) box; the tokens it ran below, the tokens it found cached above (green)."""
    ax.add_patch(Rectangle((step - 0.45, y - 0.38), 0.9, 0.76, facecolor=phase_color(row.phase),
                           edgecolor=request_color(row.request_id), linewidth=1.2,
                           gid=f"{row.phase}:{row.request_id}:{step}"))
    if cached:
        ax.text(step, y - 0.2 if row.phase == "prefill" else y, str(cached), ha="center", va="center", fontsize=5.5,
                color=REVIVED_COLOR, fontweight="bold", gid=f"cached:{row.request_id}:{step}")
    if row.phase == "prefill":
        ax.text(step, y + 0.14 if cached else y, str(row.num_scheduled_tokens), ha="center", va="center",
                fontsize=6)


def _draw_waits(ax, waits: Sequence, lane: Mapping[str, int], upto: int | None) -> list[str]:
    """Arrival triangles and waiting bars; returns the reasons drawn, in first-seen order."""
    reasons: dict[str, None] = {}
    for w in waits:
        y = lane[w.request_id]
        if not w.after_preemption and (upto is None or w.start <= upto):
            ax.plot([w.start - 0.5], [y], marker=">", color="black", markersize=4.5, linestyle="none",
                    gid=f"arrived:{w.request_id}:{w.start}")
        for step, reason in sorted(w.reasons.items()):
            if upto is not None and step > upto:
                break
            ax.add_patch(Rectangle((step - 0.5, y - 0.12), 1.0, 0.24, facecolor=WAIT_COLORS[reason], linewidth=0,
                                   hatch=WAIT_HATCHES.get(reason), edgecolor="white",
                                   gid=f"wait:{w.request_id}:{step}:{reason}"))
            reasons.setdefault(reason, None)
    return list(reasons)


def _timeline_legend(cached: bool, arrivals: bool, reasons: Sequence[str]) -> list:
    legend = [Patch(facecolor=phase_color("prefill"), edgecolor=EDGE_COLOR, label="prefill (n: tokens run)"),
              Patch(facecolor=phase_color("decode"), edgecolor=EDGE_COLOR, label="decode (1 token)"),
              Line2D([], [], marker="x", color=ALERT_COLOR, linestyle="none", markeredgewidth=2,
                     label="preempted"),
              Line2D([], [], marker="|", color="black", linestyle="none", markersize=10, label="finished")]
    if cached:
        legend.append(Line2D([], [], marker="$n$", color=REVIVED_COLOR, linestyle="none",
                             label="admitted with n tokens\nfrom the prefix cache"))
    if arrivals:
        legend.append(Line2D([], [], marker=">", color="black", linestyle="none", markersize=5, label="arrived"))
    for reason in reasons:
        legend.append(Patch(facecolor=WAIT_COLORS[reason], hatch=WAIT_HATCHES.get(reason), edgecolor="white",
                            label=f"waiting: {WAIT_LABELS[reason]}"))
    return legend


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


def draw_kv_occupancy(traces: Sequence, *, upto: int | None = None, ax=None, title: str | None = None,
                      max_legend: int = 12):
    """Stacked bars of KV blocks held per request in each step, against the pool's size.

    Bars count the blocks of the requests that ran in the step (gid
    ``"kv:<request id>:<step>"``, height = blocks), in each request's colour (legend: up to
    ``max_legend`` requests); the black line is the blocks still in use after the step
    (finished requests have freed theirs). The y axis fits the run's peak: the pool's
    capacity is a red dashed line when it is near that peak, and named in the title when it
    is far above (a tall empty axis would squash the bars). Returns the Figure.
    """
    fig, ax = new_axes(ax, figsize=(5.5, 2.6))
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
                color="black", linewidth=1.2, label="held after the step\n(finished ones freed)", gid="kv:in-use")
    capacity_note = ""
    if traces:
        capacity = traces[0].num_blocks
        peak = max(max(sum(blocks_by_request(t).values()), t.num_blocks - t.num_free_blocks) for t in traces)
        if capacity <= 1.6 * max(peak, 1):
            ax.axhline(capacity, color=ALERT_COLOR, linestyle="--", linewidth=1, label=f"pool size ({capacity})")
            ax.set_ylim(0, capacity * 1.1)
        else:
            ax.set_ylim(0, max(peak, 1) * 1.25)
            capacity_note = f" (pool: {capacity} blocks, far above)"
    _step_xlim(ax, traces)
    integer_steps(ax, "y")
    ax.set_xlabel("engine step")
    ax.set_ylabel("KV blocks")
    handles, _ = ax.get_legend_handles_labels()
    req_ids = request_order(traces)
    handles += [Patch(color=request_color(r), label=f"req {r}") for r in req_ids[:max_legend]]
    if len(req_ids) > max_legend:
        handles.append(Patch(color="white", label=f"... {len(req_ids) - max_legend} more"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False,
              ncols=2 if len(handles) > 9 else 1)
    ax.set_title((title or "KV cache occupancy: blocks held per request") + capacity_note, fontsize=9)
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
    integer_steps(ax, "y")
    ax.set_xlabel("engine step")
    ax.set_ylabel("tokens")
    ax.set_title(title or "tokens per step (blue decode, orange prefill)", fontsize=9)
    return fig


# The parts of a step in the order they run (keys of ``StepTrace.timings``).
TIMING_PARTS = STEP_PHASES


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


def describe_pool_change(traces: Sequence, step: int, block_size: int | None = None) -> str:
    """What happened to the block pool in ``step``, in words: blocks taken from the prefix
    cache, blocks given back by preemption."""
    parts = []
    for a in admissions([t for t in traces if t.step <= step], block_size):
        if a.step == step and a.num_cached_tokens:
            kind = "came back" if a.resumed else "was admitted"
            blocks = f"blocks {a.cached_block_ids} " if a.cached_block_ids else ""
            parts.append(f"req {a.request_id} {kind} and took {blocks}({a.num_cached_tokens} tokens) "
                         "from the prefix cache")
    current = next((t for t in traces if t.step == step), None)
    if current is not None and current.preempted:
        parts.append(f"preempted {', '.join(current.preempted)}: blocks freed (full ones stay cached)")
    return "; ".join(parts)


def draw_engine_step(traces: Sequence, step: int, *, budget: int | None = None, pool_frames=None,
                     ncols: int = 16, waits: Sequence | None = None):
    """The run up to ``step``: timeline on top, KV occupancy and tokens per step below, and,
    given ``pool_frames`` (one :class:`fleetlab.lab.viz.PoolFrame` per step, from
    :func:`fleetlab.lab.viz.pool_frame`), the block pool as it stood after the step.

    The current step is shaded in every panel and described in the title
    (:func:`describe_step`, and with ``waits`` who waited in it and why). In the pool, blocks a
    request took from the prefix cache in this step are outlined in green. Returns the Figure.
    """
    current = [t for t in traces if t.step == step]
    if not current:
        raise ValueError(f"no trace for step {step} (steps {traces[0].step}..{traces[-1].step})" if traces
                         else "no traces to draw")
    frame = None
    if pool_frames is not None:
        frame = next((f for f in pool_frames if f.step == step), None)
        if frame is None:
            raise ValueError(f"no pool frame for step {step}")
    num_requests = len(request_order(traces))
    pool_rows = -(-len(frame.blocks) // ncols) if frame is not None else 0
    heights = [max(2, num_requests) * 0.35 + 0.8, 2.4] + ([0.45 * pool_rows + 0.9] if frame is not None else [])
    fig = Figure(figsize=(max(9.0, 0.3 * len(traces) + 3.5), sum(heights) + 0.8), layout="constrained")
    grid = fig.add_gridspec(len(heights), 2, height_ratios=heights)
    ax_time, ax_kv, ax_tok = fig.add_subplot(grid[0, :]), fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])
    draw_timeline(traces, upto=step, ax=ax_time, waits=waits)
    draw_kv_occupancy(traces, upto=step, ax=ax_kv, max_legend=8)
    draw_step_tokens(traces, budget=budget, upto=step, ax=ax_tok)
    for ax in (ax_time, ax_kv, ax_tok):
        ax.axvspan(step - 0.5, step + 0.5, color="#ffe08a", alpha=0.35, zorder=0)
    title = describe_step(current[0])
    waiting = [w.request_id for w in waits or () if step in w.reasons]
    if waiting:
        reason = next(w.reasons[step] for w in waits if step in w.reasons)
        title += f"\nwaiting: {', '.join(waiting)} ({WAIT_REASONS[reason]})"
    if frame is not None:
        ax_pool = fig.add_subplot(grid[2, :])
        revived = [b for a in admissions([t for t in traces if t.step <= step], frame.block_size)
                   if a.step == step for b in a.cached_block_ids]
        change = describe_pool_change(traces, step, frame.block_size)
        draw_block_pool(frame, ncols=ncols, ax=ax_pool, revived=revived,
                        title=f"block pool after step {step}: {sum(i.ref_count > 0 for i in frame.blocks)}/"
                              f"{len(frame.blocks)} blocks in use" + (f"\n{change}" if change else ""))
    fig.suptitle(title, fontsize=9)
    return fig


def row_lanes(traces: Sequence, num_rows: int) -> dict[int, dict[int, str]]:
    """``{step: {row: request id}}``: each running request keeps one of ``num_rows`` rows from
    the step it is admitted to the step it finishes or is preempted (the lowest free row)."""
    lanes: dict[str, int] = {}
    out: dict[int, dict[int, str]] = {}
    for trace in traces:
        for row in trace.rows:
            if row.request_id not in lanes:
                free = sorted(set(range(num_rows)) - set(lanes.values()))
                if not free:
                    raise ValueError(f"step {trace.step}: more than num_rows={num_rows} requests run at once")
                lanes[row.request_id] = free[0]
        out[trace.step] = {lanes[r.request_id]: r.request_id for r in trace.rows}
        for req_id in [*trace.finished, *trace.preempted]:
            lanes.pop(req_id, None)
    return out


def idle_row_steps(traces: Sequence, num_rows: int) -> int:
    """Row-steps in which a row of the batch ran nothing: ``num_rows * steps - busy row-steps``."""
    return sum(num_rows - len(t.rows) for t in traces)


def draw_row_usage(traces: Sequence, num_rows: int, *, ax=None, title: str | None = None, xmax: int | None = None):
    """The batch's ``num_rows`` rows over the steps: a box in the request's colour where a
    row ran a request (darker for prefill), hatched grey where it sat idle. The request's id
    is written where it enters its row (texts with gid ``"enters:<request id>:<step>"``).

    A request keeps its row while it runs (:func:`row_lanes`). Boxes have gid
    ``"busy:<row>:<step>"`` and ``"idle:<row>:<step>"``. ``xmax``: draw the x axis up to this
    step (to line up runs of different lengths). Returns the Figure.
    """
    fig, ax = new_axes(ax, figsize=(max(6.0, 0.12 * len(traces) + 2.5), 0.4 * num_rows + 1.2))
    lanes = row_lanes(traces, num_rows)
    phase = {(t.step, r.request_id): r.phase for t in traces for r in t.rows}
    previous: dict[int, str] = {}
    for trace in traces:
        for row in range(num_rows):
            req_id = lanes[trace.step].get(row)
            if req_id is not None and previous.get(row) != req_id:
                ax.text(trace.step - 0.4, row, req_id, ha="left", va="center", fontsize=6, color="black",
                        gid=f"enters:{req_id}:{trace.step}")
            previous[row] = req_id
            x = trace.step - 0.5
            if req_id is None:
                ax.add_patch(Rectangle((x, row - 0.4), 1.0, 0.8, facecolor="#f2f2f2", edgecolor="#bbbbbb",
                                       hatch="////", linewidth=0.0, gid=f"idle:{row}:{trace.step}"))
            else:
                prefill = phase[(trace.step, req_id)] == "prefill"
                ax.add_patch(Rectangle((x, row - 0.4), 1.0, 0.8, facecolor=request_color(req_id),
                                       alpha=0.95 if prefill else 0.6, edgecolor="white", linewidth=0.3,
                                       gid=f"busy:{row}:{trace.step}"))
    last = traces[-1].step if traces else 0
    ax.set_xlim(-0.6, (xmax if xmax is not None else last) + 0.6)
    integer_steps(ax)
    ax.set_ylim(num_rows - 0.5, -0.5)
    ax.set_yticks(range(num_rows), [f"row {r}" for r in range(num_rows)], fontsize=8)
    ax.set_xlabel("engine step")
    idle = idle_row_steps(traces, num_rows)
    total = num_rows * len(traces)
    ax.set_title(title or "batch rows", fontsize=9)
    ax.text(1.0, 1.02, f"{len(traces)} steps; {idle} of {total} row-steps idle ({idle / max(total, 1):.0%})",
            transform=ax.transAxes, ha="right", va="bottom", fontsize=8)
    return fig


def draw_batching_comparison(runs: Mapping[str, Sequence], num_rows: int):
    """Several runs' batch rows (:func:`draw_row_usage`), one panel each, one above the other on
    the same step axis, so the longer run and its idle rows show at a glance. ``runs``:
    ``{name: traces}``. Returns the Figure."""
    if not runs:
        raise ValueError("draw_batching_comparison: no runs to draw")
    longest = max((t[-1].step for t in runs.values() if t), default=0)
    fig = Figure(figsize=(max(8.0, 0.1 * longest + 3.0), (0.4 * num_rows + 1.0) * len(runs) + 0.8),
                 layout="constrained")
    axes = fig.subplots(len(runs), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (name, traces) in zip(axes, runs.items()):
        draw_row_usage(traces, num_rows, ax=ax, title=name, xmax=longest)
    for ax in axes[:-1]:
        ax.set_xlabel("")
    axes[0].legend(handles=[Patch(facecolor="#888888", alpha=0.95, label="prefill (request colour)"),
                            Patch(facecolor="#888888", alpha=0.6, label="decode"),
                            Patch(facecolor="#f2f2f2", edgecolor="#bbbbbb", hatch="////", label="idle row")],
                   fontsize=7, loc="lower left", bbox_to_anchor=(0.0, 1.08), ncols=3, frameon=False)
    return fig
