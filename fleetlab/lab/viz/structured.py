"""Structured outputs drawn: the token bitmask step by step, the grammar state moving with its
row, and the masks of a speculative verify row.

The masks come from the engine itself: every constrained row keeps the masks of its last scored
step in the InputBatch field ``grammar_bitmask`` (``[k + 1, ceil(vocab / 32)]`` int32 words);
:func:`allowed_tokens` unpacks them.
"""

from __future__ import annotations

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Rectangle

from fleetlab.lab.viz._style import ALERT_COLOR, EDGE_COLOR, REVIVED_COLOR, new_axes, request_color

ALLOWED_COLOR = "#cfe8cf"
CHOSEN_COLOR = "#1f4e79"


def allowed_tokens(words, vocab_size: int) -> np.ndarray:
    """bool ``[..., vocab_size]``: the tokens a packed bitmask (int32 words ``[..., W]``) allows."""
    words = np.ascontiguousarray(words, dtype=np.int32)
    bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")
    return bits[..., :vocab_size].astype(bool)


def token_labels(tokenizer, vocab_size: int) -> list[str]:
    """Each token id's text for an axis: the character, ``␣`` for a space, ``⏎`` for a newline,
    ``EOS`` and the other special tokens by short names."""
    names = {tokenizer.eos_token_id: "EOS", tokenizer.bos_token_id: "BOS"}
    labels = []
    for t in range(vocab_size):
        if t in names:
            labels.append(names[t])
        elif t in getattr(tokenizer, "special_token_ids", ()):
            labels.append("·")
        else:
            text = tokenizer.decode([t])
            labels.append({" ": "␣", "\n": "⏎"}.get(text, text))
    return labels


def _mask_image(ax, masks: np.ndarray, labels: list[str]) -> None:
    ax.imshow(masks, cmap=ListedColormap(["#ffffff", ALLOWED_COLOR]), vmin=0, vmax=1, aspect="auto",
              interpolation="nearest").set_gid("masks")
    ax.set_xticks(range(len(labels)), labels, fontsize=6, fontfamily="monospace")
    for tick in ax.get_xticklabels():
        if len(tick.get_text()) > 1:  # EOS, BOS: upright they would run into their neighbours
            tick.set_rotation(90)
    ax.set_xticks(np.arange(-0.5, len(labels)), minor=True)
    ax.set_yticks(np.arange(-0.5, len(masks)), minor=True)
    ax.grid(which="minor", color="#eeeeee", linewidth=0.4)
    ax.tick_params(which="minor", length=0)


def draw_mask_steps(masks, chosen, labels: list[str], *, title: str | None = None, ax=None):
    """One row per step of one constrained request: the vocabulary its mask allowed (green) and
    the token the sampler chose (a dark square; gid ``chosen:<step>``).

    masks: bool ``[steps, vocab]``; chosen: the token id chosen at each step; labels: each
    token's text (:func:`token_labels`).
    """
    masks = np.asarray(masks, dtype=bool)
    fig, ax = new_axes(ax, figsize=(max(8.0, 0.11 * masks.shape[1]), 0.9 + 0.22 * len(masks)))
    _mask_image(ax, masks, labels)
    for step, token in enumerate(chosen):
        ax.add_patch(Rectangle((token - 0.5, step - 0.5), 1, 1, color=CHOSEN_COLOR, gid=f"chosen:{step}"))
    ax.set_yticks(range(len(masks)), [f"step {s}: {labels[t]!s} ({int(m.sum())} allowed)"
                                      for s, (t, m) in enumerate(zip(chosen, masks))], fontsize=7)
    ax.set_xlabel("token (the vocabulary)")
    ax.set_title(title or "the mask at each step (green: allowed) and the token chosen (dark)", fontsize=9)
    return fig


def draw_rows_moving(before, after, *, title: str | None = None, ax=None):
    """The batch's rows before and after a step's condense and reorder, each row labelled with
    what its ``structured_output`` field holds; a line joins a request's two rows (gid
    ``move:<request id>``), solid for a constrained request.

    before, after: one ``(request id, label, constrained)`` per row, in row order.
    """
    n = max(len(before), len(after))
    fig, ax = new_axes(ax, figsize=(7.5, 0.45 * n + 1.0))
    boxes = {}
    for col, rows in ((0, before), (1, after)):
        x = col * 3.0
        for r, (rid, label, constrained) in enumerate(rows):
            color = request_color(rid)
            ax.add_patch(Rectangle((x, -r - 0.4), 2.0, 0.8, facecolor=color if constrained else "#ffffff",
                                   edgecolor=color, linewidth=1.5, alpha=0.85 if constrained else 1.0,
                                   gid=f"row:{col}:{rid}"))
            ax.text(x + 1.0, -r, f"row {r}: {rid} · {label}", ha="center", va="center", fontsize=7,
                    color="#ffffff" if constrained else EDGE_COLOR)
            boxes.setdefault(rid, []).append(-r)
    for rid, ys in boxes.items():
        if len(ys) == 2:
            constrained = any(c for r, _, c in before if r == rid)
            ax.plot([2.0, 3.0], ys, color=request_color(rid), linestyle="-" if constrained else ":",
                    linewidth=2 if constrained else 1)[0].set_gid(f"move:{rid}")
    ax.text(1.0, 0.8, "before (condense done)", ha="center", fontsize=8)
    ax.text(4.0, 0.8, "after the decode-first reorder", ha="center", fontsize=8)
    ax.set_xlim(-0.2, 5.2)
    ax.set_ylim(-n + 0.3, 1.3)
    ax.axis("off")
    ax.set_title(title or "the grammar state is a field of the row: it moves with it", fontsize=9)
    return fig


def draw_verify_masks(masks, drafts, num_accepted: int, kept, labels: list[str], *, title: str | None = None,
                      ax=None):
    """The ``k + 1`` masks of one verify row: row ``i`` is what the grammar allows after the first
    ``i`` drafts. At row ``i`` the draft that position verifies is a ring, green where its own mask
    allows it and red where the grammar refuses it (gid ``draft:<i>:allowed|refused``); the
    tokens the request kept are dark squares (gid ``kept:<i>``); rows after a refused draft are
    greyed out (gid ``unused:<i>``): they are all ones, and no token is ever taken from them.

    masks: bool ``[k + 1, vocab]``; drafts: the ``k`` drafts; num_accepted: how many the target
    accepted; kept: the tokens the step kept (the accepted drafts, then the target's own).
    """
    masks = np.asarray(masks, dtype=bool)
    fig, ax = new_axes(ax, figsize=(max(8.0, 0.11 * masks.shape[1]), 1.1 + 0.3 * len(masks)))
    _mask_image(ax, masks, labels)
    for i, token in enumerate(kept):
        ax.add_patch(Rectangle((token - 0.5, i - 0.5), 1, 1, color=CHOSEN_COLOR, gid=f"kept:{i}"))
    refused = [i for i, d in enumerate(drafts) if not masks[i, d]]
    for i in range(refused[0] + 1, len(masks)) if refused else ():  # past a refused draft: never used
        ax.add_patch(Rectangle((-0.5, i - 0.5), masks.shape[1], 1, facecolor="#bbbbbb", alpha=0.6, gid=f"unused:{i}"))
        ax.text(masks.shape[1] / 2, i, "never used: it follows a draft the grammar refused", ha="center",
                va="center", fontsize=7, color=EDGE_COLOR)
    for i, d in enumerate(drafts):
        ok = bool(masks[i, d])
        ax.plot(d, i, marker="o", markersize=9, markerfacecolor="none", markeredgewidth=2,
                color=REVIVED_COLOR if ok else ALERT_COLOR)[0].set_gid(f"draft:{i}:{'allowed' if ok else 'refused'}")
    names = ["after the last token"] + [f"after draft {i + 1} ({labels[d]})" for i, d in enumerate(drafts)]
    ax.set_yticks(range(len(masks)), names, fontsize=7)
    ax.set_xlabel("token (the vocabulary)")
    ax.set_title(title or f"one verify row: {len(drafts)} drafts, {num_accepted} accepted "
                          "(ring: the draft a position verifies; dark: kept)", fontsize=9)
    return fig
