"""Drawings of speculative decoding, from the engine's own traces and batches.

- :func:`verify_rows` / :func:`draw_spec_steps`: what every step of every request did: the
  drafts the target accepted and rejected, and the token the target added itself (the
  *bonus* token after a fully accepted run, the *recovered* token in place of the first
  rejected draft), one line per step (``LLM(..., record_traces=True)``).
- :func:`request_forwards`: target forwards per output token, counted per request (the
  steps a request is scheduled in, divided by the tokens it gets).
- :func:`lockstep_rows` / :func:`draw_lockstep`: the main ``InputBatch`` and a draft
  proposer's ``ProposerInputBatch`` row for row, before and after a decode-first reorder.
- :func:`draw_spec_sweep`: acceptance and target forwards per output token against ``k``.
- :func:`token_histogram` / :func:`draw_token_histogram`: a sampled token's frequencies with
  speculation on and off against the target's own probabilities (rejection sampling keeps
  the distribution).
- :func:`draw_spec_benchmark`: the stored result of ``python -m fleetlab bench spec``.

Everything here reads public state only (``StepTrace``/``RowTrace``, ``fleetlab.inspect.batch.batch_snapshot``
and ``np(name)``, ``ProposerInputBatch.np(name)`` and ``reach()``); nothing reaches into the engine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import ConnectionPatch, Patch, Rectangle

from fleetlab.inspect.batch import batch_snapshot
from fleetlab.lab.viz._style import ALERT_COLOR, EDGE_COLOR, integer_steps, phase_color, request_color

# What a token cell in a step line is, and its colour.
TOKEN_KINDS = {
    "previous": "#eeeeee",   # kept in an earlier step
    "sampled": "#a6c8e8",    # the target's token in a step with no drafts (a prefill's first token)
    "accepted": "#8fd18f",   # a draft the target agreed with
    "rejected": "#f4a3a3",   # a draft the target refused (struck through)
    "recovered": "#c9a0dc",  # the target's own token in place of the first rejected draft
    "bonus": "#6fa8dc",      # the target's extra token after every draft was accepted
    "dropped": "#ffffff",    # accepted, but after a stop token: cut (hatched)
}
KIND_LABELS = {
    "previous": "kept earlier",
    "sampled": "target token (no drafts)",
    "accepted": "draft accepted",
    "rejected": "draft rejected",
    "recovered": "recovered (target's token for the first rejected draft)",
    "bonus": "bonus (target's token after all drafts accepted)",
    "dropped": "accepted, cut after a stop token",
}
NEW_KINDS = ("sampled", "accepted", "rejected", "recovered", "bonus", "dropped")


def token_label(token_id: int, tokenizer=None) -> str:
    """A short printable label of one token: its text (a space as ``␣``, special tokens by
    name without brackets), or its id without a tokenizer."""
    if tokenizer is None:
        return str(int(token_id))
    text = tokenizer.decode([int(token_id)], skip_special_tokens=False)
    if text.startswith("<") and text.endswith(">") and len(text) > 2:
        return text[1:-1]
    return text.replace(" ", "␣").replace("\n", "⏎") or "∅"


# ---------------------------------------------------------------- per step: drafts and verdicts
@dataclass(slots=True)
class VerifyRow:
    """One request in one step that drafted or kept tokens.

    start: the output index of the first token this step kept; previous: the output tokens
    kept before it; cells: ``(token id, kind)`` in drawing order: accepted (and dropped)
    drafts, rejected drafts, then the target's own token (``sampled``, ``recovered`` or
    ``bonus``) when the request kept it. ``kept``: the tokens the request kept this step.
    """

    step: int
    request_id: str
    phase: str
    start: int
    previous: list[int]
    cells: list[tuple[int, str]]
    kept: list[int]

    @property
    def num_drafts(self) -> int:
        return sum(kind in ("accepted", "rejected", "dropped") for _, kind in self.cells)

    @property
    def num_accepted(self) -> int:
        return sum(kind in ("accepted", "dropped") for _, kind in self.cells)


def _cells(row) -> list[tuple[int, str]]:
    drafts, m, kept = list(row.draft_token_ids), int(row.num_accepted_tokens), list(row.token_ids)
    cells = [(t, "accepted" if i < len(kept) else "dropped") for i, t in enumerate(drafts[:m])]
    cells += [(t, "rejected") for t in drafts[m:]]
    if len(kept) > m:
        kind = "sampled" if not drafts else ("bonus" if m == len(drafts) else "recovered")
        cells.append((kept[m], kind))
    return cells


def verify_rows(traces: Sequence, request_ids: Sequence[str] | None = None) -> list[VerifyRow]:
    """:class:`VerifyRow` s of every step in ``traces`` (``LLM.traces``), in step order; rows
    that neither drafted nor kept a token (prompt chunks short of the end) are skipped.
    ``request_ids``: only these requests."""
    wanted = None if request_ids is None else {str(r) for r in request_ids}
    kept_so_far: dict[str, list[int]] = {}
    out = []
    for trace in traces:
        for row in trace.rows:
            rid = row.request_id
            previous = kept_so_far.setdefault(rid, [])
            if (row.token_ids or row.draft_token_ids) and (wanted is None or rid in wanted):
                out.append(VerifyRow(trace.step, rid, row.phase, len(previous), list(previous), _cells(row),
                                     list(row.token_ids)))
            previous.extend(row.token_ids)
    return out


@dataclass(slots=True)
class RequestCost:
    """Target forwards a request took (steps it was scheduled in) and the tokens it got."""

    num_forwards: int
    num_tokens: int

    @property
    def forwards_per_token(self) -> float:
        return self.num_forwards / self.num_tokens if self.num_tokens else float("nan")


def request_forwards(traces: Sequence) -> dict[str, RequestCost]:
    """``{request id: RequestCost}`` from ``LLM.traces``: a request pays one target forward in
    every step that schedules it (prefill chunks, decodes, verify rows, recomputation after a
    preemption) and gets the tokens it kept. Without speculation a request whose prompt fits
    one step pays exactly one forward per token."""
    costs: dict[str, RequestCost] = {}
    for trace in traces:
        for row in trace.rows:
            cost = costs.setdefault(row.request_id, RequestCost(0, 0))
            cost.num_forwards += 1
            cost.num_tokens += len(row.token_ids)
    return costs


def _line(ax, y: float, tokens: Sequence[tuple[int, str]], tokenizer, gid: str) -> float:
    """Draw one step line at height ``y``; returns its width in cells.

    A recovered token takes the slot of the first rejected draft (it is the target's token
    for that position): the slot is split, the rejected draft on top, the recovered token below.
    """
    kinds = [kind for _, kind in tokens]
    first_rejected = kinds.index("rejected") if "rejected" in kinds else None
    x = 0
    for token, kind in tokens:
        height, bottom, size, slot = 0.8, y, 7, x
        if kind == "recovered" and first_rejected is not None:
            slot, height, size = first_rejected, 0.38, 6
        elif kind == "rejected" and x == first_rejected and "recovered" in kinds:
            bottom, height, size = y + 0.42, 0.38, 6
        ax.add_patch(Rectangle((slot, bottom), 0.94, height, facecolor=TOKEN_KINDS[kind],
                               edgecolor="#bbbbbb" if kind == "previous" else EDGE_COLOR,
                               linewidth=0.5 if kind == "previous" else 0.8,
                               hatch="///" if kind == "dropped" else None, gid=f"{gid}:{slot}:{kind}"))
        ax.text(slot + 0.47, bottom + height / 2, token_label(token, tokenizer), ha="center", va="center",
                fontsize=size, color="#888888" if kind in ("previous", "dropped") else "#111111")
        if kind == "rejected":
            ax.add_line(Line2D([slot + 0.1, slot + 0.84], [bottom + 0.2 * height, bottom + 0.8 * height],
                               color=ALERT_COLOR, linewidth=1.2))
        x += slot == x
    return x


def draw_spec_steps(traces: Sequence, tokenizer=None, *, request_ids: Sequence[str] | None = None,
                    prompts: Mapping[str, str] | None = None, max_previous: int = 24, title: str | None = None):
    """Each step of each request as one line of token cells, one panel per request.

    A line starts with the tokens the request kept in earlier steps (grey, at most
    ``max_previous`` of the latest), then what this step did: drafts the target accepted
    (green), drafts it rejected (red, struck through), and the token the target added
    itself: the *bonus* token (blue) after a fully accepted run, the *recovered* token
    (purple) in the first rejected draft's slot (drawn under that draft), or a plain sampled token (light blue) in
    a step with no drafts. Accepted drafts after a stop token are cut (hatched).

    Args:
      traces: ``LLM.traces`` of a run with ``record_traces=True``.
      tokenizer: labels cells with text (else token ids).
      request_ids: the requests to draw (default: all, in order of first appearance).
      prompts: ``{request id: prompt text}`` for the panel titles.
    Returns the Figure; cells have gid ``"cell:<request>:<step>:<x>:<kind>"``, and each panel
    is titled with the request's target forwards and tokens.
    """
    rows = verify_rows(traces, request_ids)
    order = list(dict.fromkeys(str(r) for r in request_ids)) if request_ids is not None else \
        list(dict.fromkeys(r.request_id for r in rows))
    if not order:
        raise ValueError("draw_spec_steps: no step kept or drafted a token (record_traces=True?)")
    costs = request_forwards(traces)
    by_request = {rid: [r for r in rows if r.request_id == rid] for rid in order}
    width = max(min(len(r.previous), max_previous) + len(r.cells) for r in rows)
    heights = [max(1, len(by_request[rid])) + 1.2 for rid in order]
    fig = Figure(figsize=(max(7.5, 0.3 * width + 2.2), 0.32 * sum(heights) + 1.0), layout="constrained")
    axes = fig.subplots(len(order), 1, gridspec_kw={"height_ratios": heights}, squeeze=False)[:, 0]
    seen = set()
    for ax, rid in zip(axes, order):
        lines = by_request[rid]
        for y, vr in enumerate(lines):
            prev = vr.previous[-max_previous:] if max_previous else []
            cells = [(t, "previous") for t in prev] + vr.cells
            _line(ax, -y, cells, tokenizer, f"cell:{rid}:{vr.step}")
            seen.update(kind for _, kind in vr.cells)
            if len(vr.previous) > len(prev):
                ax.text(-0.2, -y + 0.4, "…", ha="right", va="center", fontsize=8, color="#888888")
        ax.set_yticks([-y + 0.4 for y in range(len(lines))], [f"step {vr.step}" for vr in lines], fontsize=7)
        ax.set_xticks([])
        ax.set_xlim(-0.6, width + 0.2)
        ax.set_ylim(-len(lines) + 0.8, 1.0)
        for side in ("top", "right", "bottom"):
            ax.spines[side].set_visible(False)
        cost = costs[rid]
        prompt = f" {prompts[rid]!r} ->" if prompts and rid in prompts else ""
        ax.set_title(f"request {rid}:{prompt} {cost.num_tokens} tokens in {cost.num_forwards} target forwards "
                     f"({cost.forwards_per_token:.2f} per token)", fontsize=8, loc="left",
                     color=request_color(rid))
    handles = [Patch(facecolor=TOKEN_KINDS[k], edgecolor=EDGE_COLOR, hatch="///" if k == "dropped" else None,
                     label=KIND_LABELS[k]) for k in NEW_KINDS if k in seen]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(3, len(handles)), fontsize=7, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


# ---------------------------------------------------------------- the proposer's batch, row for row
@dataclass(slots=True)
class LockstepRow:
    """Row ``row`` of the main ``InputBatch`` and of the proposer's ``ProposerInputBatch``.

    Main batch: request, phase (decode when it runs at most ``decode_threshold`` tokens),
    tokens it runs this step, drafts it verifies, tokens in the target's cache. Proposer
    batch: the request it holds in that row, tokens in the draft model's own cache, and the
    drafts it proposed last.
    """

    row: int
    req_id: object
    phase: str
    num_scheduled_tokens: int
    num_spec_tokens: int
    num_computed_tokens: int
    proposer_req_id: object
    draft_num_computed_tokens: int
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def in_step(self) -> bool:
        return self.req_id == self.proposer_req_id


def draft_state(proposer_batch) -> dict:
    """``{request id: (draft num_computed_tokens, drafts)}`` of every row of a proposer batch,
    as it stands now: take it before a step to show the step's rows as they began
    (``lockstep_rows(..., draft_state=...)``)."""
    p_req, p_computed = proposer_batch.np("req_id"), proposer_batch.reach()
    p_drafts, p_num = proposer_batch.np("draft_token_ids"), proposer_batch.np("num_draft_tokens")
    return {p_req[r]: (int(p_computed[r]), p_drafts[r, : int(p_num[r])].tolist())
            for r in range(len(p_req)) if p_req[r] is not None}


def lockstep_rows(batch, proposer_batch, decode_threshold: int = 1, proposer_state: dict | None = None
                  ) -> list[LockstepRow]:
    """The :class:`LockstepRow` s of rows ``[0, batch.num_rows)`` (holes included).

    After a step the main batch still holds each row's counts as the step began (the next
    step's message updates them), while the proposer's already hold what it drafted in the
    step. ``proposer_state`` (from :func:`draft_state`, taken before the step) puts the
    proposer's counts and drafts back to the step's start, keyed by request, so both halves
    of a row show the same moment; the row order stays the proposer batch's own."""
    spec = batch.np("num_spec_tokens")
    p_req = proposer_batch.np("req_id")
    state = draft_state(proposer_batch) if proposer_state is None else proposer_state
    rows = []
    for rec in batch_snapshot(batch, decode_threshold):
        r = rec.row
        live = rec.phase != "empty"
        computed, drafts = state.get(p_req[r], (0, []))
        rows.append(LockstepRow(r, rec.req_id, rec.phase, rec.num_scheduled_tokens, int(spec[r]) if live else 0,
                                rec.num_computed_tokens, p_req[r], computed, drafts))
    return rows


def _main_text(row: LockstepRow) -> str:
    if row.phase == "empty":
        return "(empty)"
    drafts = f" = 1 + {row.num_spec_tokens} drafts" if row.num_spec_tokens else ""
    return (f"req {row.req_id}  {row.phase}  {row.num_scheduled_tokens} tok{drafts}  "
            f"(target KV {row.num_computed_tokens})")


def _draft_text(token_ids, tokenizer) -> str:
    """Drafts as one string: characters run together, longer labels (``eos``) in angle brackets."""
    if tokenizer is None:
        return ",".join(str(t) for t in token_ids)
    labels = [token_label(t, tokenizer) for t in token_ids]
    return "".join(label if len(label) == 1 else f"<{label}>" for label in labels)


def _proposer_text(row: LockstepRow, tokenizer) -> str:
    if row.proposer_req_id is None:
        return "(empty)"
    return (f"req {row.proposer_req_id}  draft KV {row.draft_num_computed_tokens}  "
            f"drafts [{_draft_text(row.draft_token_ids, tokenizer)}]")


def _draw_lockstep_panel(ax, rows, texts, phases, *, highlight=(), num_decodes=None, labels_right=False,
                         gid_prefix="row") -> None:
    for y, (row, text, phase) in enumerate(zip(rows, texts, phases)):
        moved = y in highlight
        bad = not row.in_step
        ax.add_patch(Rectangle((0, -y), 10.0, 0.8, facecolor=phase_color(phase),
                               edgecolor=ALERT_COLOR if (moved or bad) else EDGE_COLOR,
                               linewidth=2.5 if (moved or bad) else 0.8, alpha=0.9, gid=f"{gid_prefix}:{y}"))
        req = row.req_id if gid_prefix.startswith("main") else row.proposer_req_id
        if req is not None:
            ax.add_patch(Rectangle((0.15, -y + 0.15), 0.5, 0.5, facecolor=request_color(req), edgecolor="white"))
        ax.text(0.9, -y + 0.4, text, va="center", fontsize=8)
    if num_decodes is not None and 0 < num_decodes < len(rows):
        ax.axhline(-num_decodes + 0.9, color="#222222", linestyle="--", linewidth=1)
    ax.set_yticks([-y + 0.4 for y in range(len(rows))], [f"row {r.row}" for r in rows], fontsize=8)
    ax.set_xticks([])
    ax.set_xlim(0, 10.0)
    ax.set_ylim(-max(len(rows), 1) + 0.9, 0.9)
    if labels_right:
        ax.yaxis.tick_right()
    for side in ("top", "bottom", "left" if labels_right else "right"):
        ax.spines[side].set_visible(False)


def draw_lockstep(before: Sequence[LockstepRow] | None, after: Sequence[LockstepRow], *, tokenizer=None,
                  num_decodes: int | None = None, titles=("before", "after"), title: str | None = None, fig=None):
    """The main batch and the proposer's batch, row for row.

    With ``before``: the main batch (top) and the proposer's batch (bottom), before (left)
    and after (right) a condense + decode-first reorder, an arrow for each request that
    changed rows (the moved rows outlined in red). With ``before=None``: ``after`` alone,
    the main batch (left) beside the proposer's (right).

    Row boxes are coloured by phase (the proposer's by the main row's phase), with the
    request's colour on the left; a row whose two batches hold different requests is
    outlined in red and named in its panel's title (lockstep broken). ``num_decodes``: the
    decode | prefill boundary to dash in ``after``. ``fig``: draw into this figure or subfigure
    (``before=None`` only; e.g. one ``fig.subfigures`` panel per frame of a strip). Returns the
    Figure (or the given subfigure); row boxes have gid
    ``"main-<before|after>:<row>"`` / ``"proposer-<before|after>:<row>"``, arrows (in
    ``fig.artists``) ``"move:<main|proposer>:<request id>"``.
    """
    texts = {"main": _main_text, "proposer": lambda r: _proposer_text(r, tokenizer)}
    names = {"main": "main InputBatch", "proposer": "ProposerInputBatch"}
    if before is None:
        fig = fig if fig is not None else Figure(figsize=(13.0, 0.42 * max(len(after), 1) + 1.0),
                                                 layout="constrained")
        for ax, which in zip(fig.subplots(1, 2), ("main", "proposer")):
            _draw_lockstep_panel(ax, after, [texts[which](r) for r in after], [r.phase for r in after],
                                 num_decodes=num_decodes, labels_right=which == "proposer",
                                 gid_prefix=f"{which}-after")
            broken = [r.row for r in after if not r.in_step]
            ax.set_title(names[which] + (f": OUT OF STEP at rows {broken}" if broken else ""), fontsize=9,
                         color=ALERT_COLOR if broken else "black")
        if title:
            fig.suptitle(title, fontsize=9)
        return fig
    fig = Figure(figsize=(13.0, 0.84 * max(len(before), len(after)) + 1.6), layout="constrained")
    fig.get_layout_engine().set(wspace=0.12)
    axes = fig.subplots(2, 2)
    row_before = {r.req_id: y for y, r in enumerate(before) if r.phase != "empty"}
    moved = [y for y, r in enumerate(after) if r.phase != "empty" and row_before.get(r.req_id, y) != y]
    for i, which in enumerate(("main", "proposer")):
        for j, (rows, label) in enumerate(((before, "before"), (after, "after"))):
            ax = axes[i, j]
            _draw_lockstep_panel(ax, rows, [texts[which](r) for r in rows], [r.phase for r in rows],
                                 highlight=moved if j else (), num_decodes=num_decodes if j else None,
                                 labels_right=bool(j), gid_prefix=f"{which}-{label}")
            broken = [r.row for r in rows if not r.in_step]
            status = f"OUT OF STEP at rows {broken}" if broken else ("" if not j else f"{len(moved)} rows moved")
            ax.set_title(f"{names[which]}, {titles[j]}" + (f": {status}" if status else ""), fontsize=9,
                         color=ALERT_COLOR if broken else "black")
        for y in moved:
            rid = after[y].req_id
            arrow = ConnectionPatch((10.0, -row_before[rid] + 0.4), (0, -y + 0.4), "data", "data", axesA=axes[i, 0],
                                    axesB=axes[i, 1], arrowstyle="->", color=request_color(rid), linewidth=1.5)
            arrow.set_gid(f"move:{which}:{rid}")
            fig.add_artist(arrow)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


# ---------------------------------------------------------------- acceptance against k
def draw_spec_sweep(runs: Sequence[Mapping], baseline: Mapping | None = None, *, k: int | None = None,
                    title: str | None = None):
    """Acceptance and target forwards per output token against ``k``.

    Args:
      runs: one mapping per ``k`` (``fleetlab.lab.bench.spec.measure`` results): ``k``,
        ``acceptance_rate``, ``acceptance_by_position``, ``forwards_per_token``.
      baseline: the same run without speculation (its ``forwards_per_token`` is drawn as a
        line, and half of it dashed: the benchmark's goal).
      k: the run to highlight (and whose per-position acceptance the left panel shows;
        default the largest).
    Left: acceptance by draft position for ``k``; middle: acceptance rate against ``k``;
    right: target forwards per output token against ``k``. Returns the Figure; points have
    gid ``"acceptance:<k>"`` / ``"forwards:<k>"``, position bars ``"position:<i>"``.
    """
    runs = sorted(runs, key=lambda r: r["k"])
    if not runs:
        raise ValueError("draw_spec_sweep: no runs")
    ks = [r["k"] for r in runs]
    k = ks[-1] if k is None else k
    if k not in ks:
        raise ValueError(f"draw_spec_sweep: k={k} was not measured; measured {ks}")
    chosen = runs[ks.index(k)]
    fig = Figure(figsize=(12.0, 3.3), layout="constrained")
    ax_pos, ax_acc, ax_fwd = fig.subplots(1, 3)
    by_pos = chosen["acceptance_by_position"]
    for i, rate in enumerate(by_pos):
        ax_pos.bar(i + 1, rate, color=TOKEN_KINDS["accepted"], edgecolor=EDGE_COLOR, gid=f"position:{i + 1}")
        ax_pos.text(i + 1, rate, f"{rate:.2f}", ha="center", va="bottom", fontsize=7)
    ax_pos.set_xlim(0.4, max(ks) + 0.6)
    ax_pos.set_ylim(0, 1.12)
    ax_pos.set_xlabel("draft position")
    ax_pos.set_ylabel("accepted / drafted")
    ax_pos.set_title(f"k={k}: acceptance by draft position", fontsize=9)
    integer_steps(ax_pos)
    acc = [r["acceptance_rate"] for r in runs]
    fwd = [r["forwards_per_token"] for r in runs]
    ax_acc.plot(ks, acc, "o-", color="#59a14f")
    ax_fwd.plot(ks, fwd, "o-", color="#4e79a7", label="speculation on")
    for x, a, f in zip(ks, acc, fwd):
        ax_acc.plot([x], [a], "o", markersize=11 if x == k else 5, color="#59a14f", gid=f"acceptance:{x}")
        ax_fwd.plot([x], [f], "o", markersize=11 if x == k else 5, color="#4e79a7", gid=f"forwards:{x}")
    ax_acc.annotate(f"{chosen['acceptance_rate']:.2f}", (k, chosen["acceptance_rate"]), textcoords="offset points",
                    xytext=(0, 9), ha="center", fontsize=8)
    ax_acc.set_ylim(0, 1.05)
    ax_acc.set_xlabel("k (drafts per step)")
    ax_acc.set_ylabel("acceptance rate")
    ax_acc.set_title("drafts accepted / drafts verified", fontsize=9)
    integer_steps(ax_acc)
    if baseline is not None:
        off = baseline["forwards_per_token"]
        ax_fwd.axhline(off, color="#555555", linewidth=1, label=f"speculation off ({off:.2f})", gid="baseline")
        ax_fwd.axhline(off / 2, color="#555555", linewidth=1, linestyle="--", label="half of off", gid="half")
    ax_fwd.annotate(f"{chosen['forwards_per_token']:.2f}", (k, chosen["forwards_per_token"]),
                    textcoords="offset points", xytext=(0, 9), ha="center", fontsize=8)
    ax_fwd.set_ylim(0, 1.15 * max([*fwd, baseline["forwards_per_token"] if baseline else 0]))
    ax_fwd.set_xlabel("k (drafts per step)")
    ax_fwd.set_ylabel("target forwards / output token")
    ax_fwd.set_title("target forwards per output token (mean over requests)", fontsize=9)
    ax_fwd.legend(fontsize=7, frameon=False, loc="lower left")
    integer_steps(ax_fwd)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


# ---------------------------------------------------------------- rejection sampling keeps the distribution
@dataclass(slots=True)
class TokenHistogram:
    """Observed frequencies of one sampled token against the target's probabilities.

    token_ids: the categories (tokens with probability >= ``min_prob``), then ``-1`` for all
    others pooled; probs: the target's probability of each category; counts: per label,
    the samples in each category; chi_square: per label ``(statistic, degrees of freedom,
    0.1% critical value)`` of the counts against ``probs``.
    """

    token_ids: list[int]
    probs: np.ndarray
    counts: dict[str, np.ndarray]
    chi_square: dict[str, tuple[float, int, float]]

    def frequencies(self, label: str) -> np.ndarray:
        c = self.counts[label]
        return c / max(1, c.sum())


def chi_square_critical(dof: int, z: float = 3.09) -> float:
    """The chi-square critical value at one-sided normal quantile ``z`` (3.09: 0.1%), by the
    Wilson-Hilferty approximation."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def token_histogram(samples: Mapping[str, Sequence[int]], probs, *, min_prob: float = 0.01) -> TokenHistogram:
    """Bin each label's sampled token ids (``samples``) into the tokens the target gives at
    least ``min_prob`` (``probs``: ``[vocab]``), the rest pooled, and test each against ``probs``."""
    probs = np.asarray(probs, dtype=np.float64)
    probs = probs / probs.sum()
    shown = [int(t) for t in np.argsort(-probs) if probs[t] >= min_prob]
    index = {t: i for i, t in enumerate(shown)}
    expected_p = np.append(probs[shown], max(0.0, 1.0 - probs[shown].sum()))
    counts, chi = {}, {}
    for label, tokens in samples.items():
        c = np.zeros(len(shown) + 1)
        for t in tokens:
            c[index.get(int(t), len(shown))] += 1
        counts[label] = c
        n = c.sum()
        keep = expected_p * n >= 5  # the usual rule: pool categories too rare to test
        obs = np.append(c[keep], c[~keep].sum())
        exp = np.append(expected_p[keep] * n, expected_p[~keep].sum() * n)
        obs, exp = obs[exp > 0], exp[exp > 0]
        dof = max(1, len(obs) - 1)
        chi[label] = (float(((obs - exp) ** 2 / exp).sum()), dof, chi_square_critical(dof))
    return TokenHistogram(shown + [-1], expected_p, counts, chi)


def draw_token_histogram(hist: TokenHistogram, tokenizer=None, *, title: str | None = None):
    """Grouped bars per token: the target's probability, then each label's observed
    frequency, the chi-square statistic of each label in the legend. Returns the Figure;
    bars have gid ``"bar:<label>:<token id>"`` (``"target"`` for the probabilities)."""
    labels = list(hist.counts)
    series = [("target", hist.probs)] + [(label, hist.frequencies(label)) for label in labels]
    width = 0.8 / len(series)
    colors = ["#555555", "#4e79a7", "#59a14f", "#e15759", "#b07aa1"]
    fig = Figure(figsize=(max(6.0, 0.9 * len(hist.token_ids) + 2.0), 3.2), layout="constrained")
    ax = fig.add_subplot()
    x = np.arange(len(hist.token_ids))
    for s, (label, values) in enumerate(series):
        if label == "target":
            name = "target probability p (from its logits)"
        else:
            stat, dof, crit = hist.chi_square[label]
            name = (f"{label}: {int(hist.counts[label].sum())} samples, chi-square {stat:.1f} "
                    f"(dof {dof}; 0.1% level {crit:.1f})")
        for xi, (token, v) in enumerate(zip(hist.token_ids, values)):
            ax.bar(x[xi] + (s - (len(series) - 1) / 2) * width, v, width, color=colors[s % len(colors)],
                   label=name if xi == 0 else None, gid=f"bar:{label}:{token}")
    ax.set_xticks(x, ["other" if t < 0 else repr(token_label(t, tokenizer)) for t in hist.token_ids], fontsize=8)
    ax.set_ylabel("probability / frequency")
    ax.set_ylim(0, 1.3 * max(float(np.max(v)) for _, v in series))
    ax.legend(fontsize=7, frameon=False, loc="upper right")
    if title:
        ax.set_title(title, fontsize=9)
    return fig


# ---------------------------------------------------------------- the benchmark's result
def draw_spec_benchmark(result: Mapping):
    """The result of ``python -m fleetlab bench spec`` (its ``spec.json``), four panels:
    target forwards per output token per run (mean bar, one dot per request, the goal of half
    of speculation off dashed); acceptance rate against ``k``; engine steps for the whole
    batch against ``k``; wall-clock speed-up over speculation off against ``k`` (the whole
    batch, and, when the result has it, requests served one at a time).
    Returns the Figure; bars have gid ``"forwards:<workload>:<run>"``."""
    workloads = result["workloads"]
    fig = Figure(figsize=(12.5, 7.2), layout="constrained")
    (ax_fwd, ax_acc), (ax_steps, ax_speed) = fig.subplots(2, 2)
    names, xs, x = [], [], 0.0
    headline = result["config"]["headline_k"]
    for wname, wl in workloads.items():
        group = [r for r in wl["runs"] if r["method"] == "off" or r["k"] == headline]
        start = x
        for run in group:
            color = "#bbbbbb" if run["method"] == "off" else ("#4e79a7" if run["method"] == "draft" else "#f28e2b")
            ax_fwd.bar(x, run["forwards_per_token"], color=color, edgecolor=EDGE_COLOR,
                       gid=f"forwards:{wname}:{run['name']}")
            per = run["forwards_per_token_by_request"]
            ax_fwd.plot(x + np.linspace(-0.25, 0.25, len(per)), per, ".", color="#222222", markersize=3)
            ax_fwd.text(x, max([run["forwards_per_token"], *per]) + 0.02, f"{run['forwards_per_token']:.2f}",
                        ha="center", va="bottom", fontsize=8)
            names.append(f"{wname}\n{run['name']}")
            xs.append(x)
            x += 1
        off = next(r for r in group if r["method"] == "off")
        ax_fwd.hlines(off["forwards_per_token"] / 2, start - 0.45, x - 0.55, colors="#555555", linestyles="--",
                      linewidth=1, gid=f"goal:{wname}")
        x += 0.6
    ax_fwd.set_xticks(xs, names, fontsize=7)
    ax_fwd.set_ylim(0, 1.15 * max(b.get_height() for b in ax_fwd.patches) + 0.05)
    ax_fwd.set_ylabel("target forwards / output token")
    ax_fwd.set_title(f"per request (dots), mean (bars); k={headline}; "
                     "dashed: half of speculation off", fontsize=9)
    for wname, wl in workloads.items():
        for method, style in (("draft", "o-"), ("ngram", "s--")):
            runs = sorted((r for r in wl["runs"] if r["method"] == method), key=lambda r: r["k"])
            if not runs:
                continue
            ks = [r["k"] for r in runs]
            label = f"{method}, {wname}"
            ax_acc.plot(ks, [r["acceptance_rate"] for r in runs], style, label=label, gid=f"acceptance:{label}")
            ax_steps.plot(ks, [r["num_steps"] for r in runs], style, label=label, gid=f"steps:{label}")
            ax_speed.plot(ks, [r["speedup"] for r in runs], style, label=label, gid=f"speedup:{label}")
    all_ks = [r["k"] for wl in workloads.values() for r in wl["runs"] if r["method"] != "off"]
    for wname, wl in workloads.items():
        off = next(r for r in wl["runs"] if r["method"] == "off")
        ax_steps.axhline(off["num_steps"], linewidth=1, color="#888888", linestyle=":", gid=f"steps-off:{wname}")
        ax_steps.text(min(all_ks), off["num_steps"], f"off, {wname}: {off['num_steps']} steps", fontsize=7,
                      va="bottom", color="#555555")
    alone = [r for r in result.get("alone", {}).get("runs", []) if r["method"] != "off"]
    if alone:
        ax_speed.plot([r["k"] for r in alone], [r["speedup"] for r in alone], "D:", color="#76b7b2",
                      label="draft, trained, one request at a time", gid="speedup:alone")
    ax_speed.axhline(1.0, linewidth=1, color="#555555")
    for ax, ylabel, t in ((ax_acc, "acceptance rate", "drafts accepted / drafts verified"),
                          (ax_steps, "engine steps", "engine steps for the whole batch (dotted: speculation off)"),
                          (ax_speed, "speed-up (x)", "wall-clock speed-up over speculation off, interleaved")):
        ax.set_xlabel("k (drafts per step)")
        ax.set_ylabel(ylabel)
        ax.set_title(t, fontsize=9)
        ax.legend(fontsize=7, frameon=False)
        integer_steps(ax)
    ax_acc.set_ylim(0, 1.05)
    ax_steps.set_ylim(0, None)
    speedups = [r["speedup"] for wl in workloads.values() for r in wl["runs"]] + [r["speedup"] for r in alone]
    ax_speed.set_ylim(0, max(1.2, 1.15 * max(speedups)))
    return fig
