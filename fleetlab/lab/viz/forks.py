"""Parallel sampling (``n > 1``) in the block pool: the children's block tables, shared two ways.

fleetlab (as vLLM v1) runs a request's ``n`` sequences as child requests that share the
prompt's full blocks through the prefix cache; each child holds its own last, partial
prompt block. The paged-attention paper forks the block tables instead: every child points
at the same blocks, the partial one included, and a child that writes into a shared block
first copies it (copy-on-write).

- :func:`fork_tables`: the paper's tables right after the prompt's step, from the engine's.
- :func:`draw_parallel_sampling`: both ways side by side, right after the prompt's step and
  some tokens later.

Cells have gid ``"cell:<panel>:<child>:<logical block>"`` with panel ``prefix-prompt``,
``prefix-now``, ``cow-prompt`` or ``cow-now``; a hatched cell is a block more than one child
holds, and its label says ``xN``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from fleetlab.lab.viz._style import EDGE_COLOR, REVIVED_COLOR, request_color
from fleetlab.lab.viz.blocks import block_owners

# outlines: the partial prompt block a child computed itself; a copy made at a first write
COMPUTED_OUTLINE = {"edgecolor": REVIVED_COLOR, "linestyle": "-"}
COPY_OUTLINE = {"edgecolor": "#111111", "linestyle": "--"}


def fork_tables(tables: Mapping[str, Sequence[int]], num_prompt_tokens: int, block_size: int) -> dict[str, list]:
    """The paper's block tables right after the prompt's step: every child holds the first
    child's prompt blocks (the last, partial one too), computed once and forked.

    ``tables``: the engine's tables at that moment (the first child's holds the whole prompt).
    """
    first = list(tables)[0]
    num_prompt_blocks = -(-int(num_prompt_tokens) // int(block_size))
    return {child: list(tables[first][:num_prompt_blocks]) for child in tables}


def _draw_panel(ax, tables, num_tokens, block_size, panel: str, notes: Mapping[str, str], marked: Mapping) -> None:
    owners = block_owners(tables)
    width = max(len(t) for t in tables.values())
    for y, (child, blocks) in enumerate(tables.items()):
        for j, block in enumerate(blocks):
            holders = owners[int(block)]
            shared = len(holders) > 1
            fill = min(1.0, max(0.0, (num_tokens[child] - j * block_size) / block_size))
            ax.add_patch(Rectangle((j, -y), 0.92, 0.8, facecolor="white", edgecolor=EDGE_COLOR,
                                   gid=f"cell:{panel}:{child}:{j}"))
            ax.add_patch(Rectangle((j, -y), 0.92 * fill, 0.8, facecolor=request_color(holders[0]), alpha=0.8,
                                   hatch="xx" if shared else None, edgecolor="white" if shared else "none",
                                   linewidth=0))
            label = f"{block} x{len(holders)}" if shared else str(block)
            ax.text(j + 0.46, -y + 0.4, label, ha="center", va="center", fontsize=7.5,
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.6, "alpha": 0.8})
            if (child, j) in marked:
                ax.add_patch(Rectangle((j - 0.04, -y - 0.04), 1.0, 0.88, facecolor="none", linewidth=2.2,
                                       gid=f"mark:{panel}:{child}:{j}", **marked[child, j]))
        ax.text(width + 0.15, -y + 0.4, notes.get(child, ""), va="center", fontsize=7.5)
    ax.set_yticks([-y + 0.4 for y in range(len(tables))], list(tables), fontsize=8)
    ax.set_xticks([j + 0.46 for j in range(width)], [str(j) for j in range(width)], fontsize=7)
    ax.set_xlim(-0.1, width + 3.6)
    ax.set_ylim(-len(tables) + 0.8, 1.0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)


def draw_parallel_sampling(at_prompt: Mapping[str, Sequence[int]], now: Mapping[str, Sequence[int]],
                           num_prompt_tokens: int, num_tokens_now: Mapping[str, int], block_size: int,
                           computed: Mapping[str, int]):
    """The block tables of one request's ``n`` children, two ways, at two moments.

    Args:
      at_prompt: ``{child: block ids}`` from the engine right after the step that ran the prompt.
      now: ``{child: block ids}`` from the engine some tokens later.
      num_prompt_tokens: the prompt's length; num_tokens_now: ``{child: tokens held now}``.
      block_size: tokens per block.
      computed: ``{child: prompt tokens the engine computed for it}`` (the first child the
        whole prompt, the others only what the prefix cache did not hold).
    Left: the engine's tables (prefix-cache sharing; the partial prompt block each child
    computed itself outlined in green). Right: the paper's fork: after the prompt every child
    holds the first child's blocks, the partial one shared too; at the first write into it,
    each other child copies it into a block of its own (dashed black outline; given the id the
    engine's child holds, so the two columns' memory compares block for block).
    Returns the Figure.
    """
    partial = num_prompt_tokens // block_size if num_prompt_tokens % block_size else None
    first = list(at_prompt)[0]
    forked = fork_tables(at_prompt, num_prompt_tokens, block_size)
    prompt_tokens = dict.fromkeys(at_prompt, num_prompt_tokens)
    prefix_notes = {c: f"computed {computed[c]} prompt tokens" for c in at_prompt}
    cow_notes = {c: (f"computed {num_prompt_tokens} prompt tokens" if c == first else "computed 0 (forked)")
                 for c in at_prompt}
    copy_notes = {c: f"copied block {at_prompt[first][partial]}" for c in now if c != first and partial is not None}
    own_partial = {(c, partial): COMPUTED_OUTLINE for c in at_prompt if c != first} if partial is not None else {}
    copies = {(c, partial): COPY_OUTLINE for c in now if c != first} if partial is not None else {}
    later = f"{max(num_tokens_now.values()) - num_prompt_tokens} tokens later"
    fig = Figure(figsize=(12.5, 4.6), layout="constrained")
    axes = fig.subplots(2, 2)
    panels = [
        (axes[0, 0], at_prompt, prompt_tokens, "prefix-prompt", prefix_notes, own_partial,
         "prefix cache (fleetlab, vLLM v1): after the prompt's step"),
        (axes[0, 1], forked, prompt_tokens, "cow-prompt", cow_notes, {},
         "fork + copy-on-write (the paged-attention paper): after the prompt's step"),
        (axes[1, 0], now, num_tokens_now, "prefix-now", {}, own_partial, f"prefix cache: {later}"),
        (axes[1, 1], now, num_tokens_now, "cow-now", copy_notes, copies, f"copy-on-write: {later}"),
    ]
    for ax, tables, tokens, panel, notes, marked, title in panels:
        _draw_panel(ax, tables, tokens, block_size, panel, notes, marked)
        ax.set_title(title, fontsize=9)
    for ax in axes[1]:
        ax.set_xlabel("logical block; cell text = physical block id (xN: N children hold it)", fontsize=8)
    fig.legend(handles=[Patch(facecolor="white", linewidth=2.2, label="the prompt's last block, computed by this child",
                              **COMPUTED_OUTLINE),
                        Patch(facecolor="white", linewidth=2.2, label="a copy made at the child's first write",
                              **COPY_OUTLINE),
                        Patch(facecolor="#bbbbbb", hatch="xx", edgecolor="white", label="held by several children")],
               loc="outside lower center", ncols=3, fontsize=7.5, frameon=False)
    return fig
