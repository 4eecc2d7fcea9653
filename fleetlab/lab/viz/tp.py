"""Pictures of tensor parallelism: who holds which heads and columns, KV bytes per rank,
the all-reduces of one step, and step times of 1 vs 2 processes.

Inputs are plain records -- a :class:`~fleetlab.distributed.ShardPlan`, a worker report
(``fleetlab.lab.tp_worker``) or a ``bench tp`` result -- so stored results redraw
without running anything. Rank ``r`` has colour ``RANK_COLORS[r]`` in every picture.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from fleetlab.lab.viz._style import EDGE_COLOR, PALETTE

RANK_COLORS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2", "#edc948", "#9c755f")


def rank_color(rank: int) -> str:
    """The colour of tensor-parallel rank ``rank`` in every picture."""
    return RANK_COLORS[rank % len(RANK_COLORS)]


def _owners(plan) -> dict[str, list[list[int]]]:
    """Per item of each row, the ranks holding it (KV heads may have several)."""
    q = [[] for _ in range(plan.num_heads)]
    kv = [[] for _ in range(plan.num_kv_heads)]
    ffn_blocks = plan.tp_size * 2  # draw the F columns as 2 blocks per rank, enough to see the split
    f = [[] for _ in range(ffn_blocks)]
    per_block = plan.intermediate_size / ffn_blocks
    for s in plan.ranks:
        for h in s.q_heads:
            q[h].append(s.rank)
        for h in s.kv_heads:
            kv[h].append(s.rank)
        for b in range(ffn_blocks):
            if s.mlp_columns[0] <= b * per_block < s.mlp_columns[1]:
                f[b].append(s.rank)
    qkv = q + kv + kv  # the packed [q | k | v] projection, head by head
    return {"query heads": q, "KV heads (cached)": kv, "QKV columns [q | k | v]": qkv,
            "MLP columns (gate, up; down rows)": f}


def _cell_labels(plan, rows) -> dict[str, list[str]]:
    """The text of each cell: head ids (``q0``, ``k1``...) and MLP column ranges."""
    q = [f"q{h}" for h in range(plan.num_heads)]
    kv = [str(h) for h in range(plan.num_kv_heads)]
    blocks = len(rows["MLP columns (gate, up; down rows)"])
    per_block = plan.intermediate_size // blocks
    return {"query heads": [str(h) for h in range(plan.num_heads)], "KV heads (cached)": kv,
            "QKV columns [q | k | v]": q + [f"k{h}" for h in kv] + [f"v{h}" for h in kv],
            "MLP columns (gate, up; down rows)": [f"{b * per_block}-{(b + 1) * per_block - 1}" for b in range(blocks)]}


def draw_shard_plan(plans: Sequence, titles: Sequence[str] | None = None):
    """One panel per :class:`ShardPlan`: which rank holds each query head, KV head, QKV
    projection column block and MLP column block (labelled with its columns). A KV head held
    by several ranks (replicated) is drawn as one band per rank, in their colours, each band
    labelled. Cells have gid ``"<row>:<item>"``, labels ``"label:<row>:<item>:<rank>"``."""
    plans = list(plans)
    fig = Figure(figsize=(10.0, 1.9 * len(plans) + 0.4), layout="constrained")
    axes = np.atleast_1d(fig.subplots(len(plans), 1))
    for ax, plan, title in zip(axes, plans, titles or [None] * len(plans)):
        rows = _owners(plan)
        width = max(len(v) for v in rows.values())
        labels = _cell_labels(plan, rows)
        for y, (row, items) in enumerate(rows.items()):
            cell = width / len(items)
            for i, owners in enumerate(items):
                h = 0.8 / max(len(owners), 1)
                for k, r in enumerate(owners):  # a replicated item: one band per rank, each labelled
                    ax.add_patch(Rectangle((i * cell, y + 0.1 + k * h), cell, h, facecolor=rank_color(r),
                                           edgecolor=EDGE_COLOR, linewidth=0.6, gid=f"{row}:{i}"))
                    ax.text(i * cell + cell / 2, y + 0.1 + (k + 0.5) * h, labels[row][i], ha="center", va="center",
                            fontsize=7 if len(owners) == 1 else 6, color="white", gid=f"label:{row}:{i}:{r}")
        ax.set_xlim(0, width)
        ax.set_ylim(len(rows), 0)
        ax.set_yticks([y + 0.5 for y in range(len(rows))], list(rows), fontsize=8)
        ax.set_xticks([])
        ax.set_title(title or (f"tensor_parallel_size={plan.tp_size}: {plan.num_heads} query heads, "
                               f"{plan.num_kv_heads} KV heads, {plan.intermediate_size} MLP columns"
                               + (f" (each KV head on {plan.kv_replicas} ranks)" if plan.kv_replicas > 1 else "")),
                     fontsize=9)
        for spine in ax.spines.values():
            spine.set_visible(False)
    handles = [Rectangle((0, 0), 1, 1, facecolor=rank_color(r)) for r in range(max(p.tp_size for p in plans))]
    fig.legend(handles, [f"rank {r}" for r in range(len(handles))], loc="outside right upper", fontsize=8,
               frameon=False)
    return fig


def draw_kv_bytes_per_rank(sizes: Sequence[int], bytes_per_rank: Sequence[int], num_kv_heads: Sequence[int],
                           ax=None):
    """Bars: KV-cache bytes one rank allocates for the same blocks, per ``tensor_parallel_size``,
    labelled with the KV heads that rank holds. Bars have gid ``"kv_bytes:<size>"``."""
    fig = ax.figure if ax is not None else Figure(figsize=(5.0, 3.0), layout="constrained")
    ax = ax or fig.add_subplot()
    for i, (n, b, h) in enumerate(zip(sizes, bytes_per_rank, num_kv_heads)):
        ax.bar(i, b / 2**10, color=PALETTE[i % len(PALETTE)], gid=f"kv_bytes:{n}")
        ax.text(i, b / 2**10, f"{b / 2**10:.0f} KiB\n{h} KV head{'s' if h > 1 else ''}", ha="center", va="bottom",
                fontsize=8)
    ax.set_xticks(range(len(sizes)), [f"tp={n}" for n in sizes])
    ax.set_ylabel("KV cache per rank (KiB)")
    ax.set_ylim(0, max(bytes_per_rank) / 2**10 * 1.3)
    ax.set_title("same blocks, fewer KV heads per rank", fontsize=9)
    return fig


def draw_step_all_reduces(records: Sequence[dict], title: str = "", ax=None):
    """The all-reduces of one step, in call order: one horizontal bar per call (its
    milliseconds), labelled with the layer that called it and the bytes summed. Bars have
    gid ``"all_reduce:<index>"``; attention calls and MLP calls get different colours."""
    fig = ax.figure if ax is not None else Figure(figsize=(7.0, 0.32 * len(records) + 1.0), layout="constrained")
    ax = ax or fig.add_subplot()
    for i, r in enumerate(records):
        color = PALETTE[0] if "attention" in r["name"] else PALETTE[1]
        ax.barh(i, r["seconds"] * 1e3, color=color, gid=f"all_reduce:{i}")
        ax.text(r["seconds"] * 1e3, i, f" {r['nbytes'] / 1024:.1f} KiB {list(r['shape'])}", va="center", fontsize=7)
    ax.set_yticks(range(len(records)), [r["name"] for r in records], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds (includes waiting for the other rank)")
    ax.set_xlim(0, max([r["seconds"] for r in records] + [1e-6]) * 1e3 * 1.6)
    ax.set_title(title or f"{len(records)} all-reduces in one step", fontsize=9)
    return fig


def draw_tp_step_times(result: dict):
    """A ``bench tp`` result: mean decode-step and prefill-step milliseconds per run, the
    part spent in all-reduce stacked at the bottom of the tensor-parallel bars.
    Bars have gid ``"<decode|prefill>:<run name>"``."""
    runs = result["runs"]
    fig = Figure(figsize=(9.0, 3.2), layout="constrained")
    axes = fig.subplots(1, 2)
    for ax, kind in zip(axes, ("decode", "prefill")):
        for i, r in enumerate(runs):
            total = r[f"{kind}_step_ms"]
            ax.bar(i, total, color=PALETTE[i % len(PALETTE)], gid=f"{kind}:{r['name']}")
            if r["tp_size"] > 1:
                ar = r.get(f"{kind}_all_reduce_ms", float("nan"))
                if np.isfinite(ar):
                    ax.bar(i, ar, color="none", edgecolor="black", hatch="///", gid=f"{kind}_all_reduce:{r['name']}")
                    ax.text(i, ar / 2, f"all-reduce\n{ar:.1f} ms", ha="center", va="center", fontsize=7,
                            bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.5})
            ax.text(i, total, f"{total:.1f} ms", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(runs)), [r["name"] for r in runs], fontsize=8)
        ax.set_ylabel("ms per step")
        ax.set_title(f"{'decode-only' if kind == 'decode' else 'with prefill'} steps (lower is better)", fontsize=9)
    return fig


def draw_rank_steps(reports: Sequence[dict], title: str = ""):
    """Every step of a launched run, per rank: step milliseconds (bars, gid
    ``"step:<rank>:<step>"``) with the part inside all-reduces hatched, and the step's
    scheduled tokens on a second axis. ``reports``: one worker report per rank (same family)."""
    fig = Figure(figsize=(10.0, 3.2), layout="constrained")
    ax = fig.add_subplot()
    n = len(reports)
    width = 0.8 / n
    for r, rep in enumerate(reports):
        steps = np.arange(len(rep["step_s"]))
        total = np.array(rep["step_s"]) * 1e3
        ar = np.array([c[1] for c in rep["step_all_reduce"]]) * 1e3
        x = steps + (r - (n - 1) / 2) * width
        for s in steps:
            ax.bar(x[s], total[s], width, color=rank_color(r), gid=f"step:{r}:{s}",
                   label=f"rank {r}" if s == 0 else None)
        ax.bar(x, ar, width, color="none", edgecolor="black", hatch="///", linewidth=0.5,
               label="inside all-reduce" if r == 0 else None)
    ax.set_xlabel("engine step")
    ax.set_ylabel("ms")
    ax2 = ax.twinx()
    ax2.plot(np.arange(len(reports[0]["step_num_tokens"])), reports[0]["step_num_tokens"], "k.-", linewidth=0.8,
             label="tokens in the step")
    ax2.set_ylabel("tokens scheduled")
    ax2.set_ylim(0, max(reports[0]["step_num_tokens"]) * 1.4)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, frameon=False, loc="upper right", ncols=2)
    ax.set_title(title or "each step on each rank (same steps, same tokens)", fontsize=9)
    return fig
