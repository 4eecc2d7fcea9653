"""The prefix cache drawn as the tree it is: the radix tree's nodes, or the hash chain's blocks.

Both designs hold a tree of prefixes. The radix tree stores it as such, one node per run of
pages (a split makes two nodes of one); the hash chain stores one key per full block, each
naming its parent block's key, which is the same tree with one node per block. Drawing both
from live caches after the same requests shows the same shape at two granularities.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetlab.lab.viz._style import CACHED_FREE_COLOR, EDGE_COLOR, PALETTE, new_axes


@dataclass(slots=True, frozen=True)
class TreeNode:
    """One node to draw: its ``key``, its parent's (None: a child of the root), the tokens its
    edge adds, the blocks holding them, and whether a running request holds any of them."""

    key: int
    parent: int | None
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    held: bool


def radix_nodes(cache, pool=None) -> list[TreeNode]:
    """The nodes of a :class:`~fleetlab.prefix_cache.radix.RadixCache`, depth first."""
    held = (lambda b: pool.ref_count(b) > 0) if pool is not None else (lambda b: False)
    return [TreeNode(id(node), None if node.parent is cache.root else id(node.parent), tuple(node.token_ids),
                     tuple(node.block_ids), any(held(b) for b in node.block_ids)) for _, node in cache.nodes()]


def hash_chain_nodes(cache, pool=None) -> list[TreeNode]:
    """One node per cached block of a :class:`~fleetlab.prefix_cache.hash_chain.HashChainCache`,
    its parent the block caching its key's parent (blocks whose parent is gone are left out)."""
    held = (lambda b: pool.ref_count(b) > 0) if pool is not None else (lambda b: False)
    nodes, keys = [], dict(cache._block_key)
    for block_id, key in sorted(keys.items()):
        parent = None if key.parent is None else cache._cached.get(key.parent)
        if key.parent is not None and parent is None:
            continue
        nodes.append(TreeNode(block_id, parent, key.token_ids, (block_id,), held(block_id)))
    return nodes


def _layout(nodes: list[TreeNode]) -> dict[int, tuple[float, int]]:
    """``{key: (x, depth)}``: leaves at consecutive x, a parent centred over its children."""
    children: dict[int | None, list[int]] = {}
    for n in nodes:
        children.setdefault(n.parent, []).append(n.key)
    pos: dict[int, tuple[float, int]] = {}
    next_x = [0.0]

    def place(key: int, depth: int) -> float:
        kids = children.get(key, [])
        x = sum(place(k, depth + 1) for k in kids) / len(kids) if kids else next_x[0]
        if not kids:
            next_x[0] += 1.0
        pos[key] = (x, depth)
        return x

    for root_child in children.get(None, []):
        place(root_child, 1)
    return pos


def _label(node: TreeNode, decode, max_chars: int) -> str:
    text = decode(list(node.token_ids)) if decode else " ".join(map(str, node.token_ids))
    text = text if len(text) <= max_chars else text[: max_chars - 1] + "…"
    blocks = ",".join(map(str, node.block_ids))
    return f"{text!r}\nblock{'s' if len(node.block_ids) > 1 else ''} {blocks}"


def draw_prefix_tree(nodes: list[TreeNode], ax=None, title: str | None = None, decode=None, max_chars: int = 18):
    """Draw ``nodes`` (:func:`radix_nodes` or :func:`hash_chain_nodes`) as a tree growing left
    to right from the root; a node a running request holds is coloured, one only the cache keeps
    is grey. ``decode`` turns token ids into text for the labels. Returns the figure."""
    pos = _layout(nodes)
    leaves = max([x for x, _ in pos.values()], default=0.0) + 1
    depth = max([d for _, d in pos.values()], default=0)
    fig, ax = new_axes(ax, figsize=(1.0 + 1.25 * (depth + 0.6), 0.6 + 0.62 * leaves))
    root_y = (leaves - 1) / 2
    ax.plot([0], [-root_y], marker="o", color=EDGE_COLOR, gid="prefix-tree:root")
    ax.annotate("root", (0, -root_y), xytext=(0, 6), textcoords="offset points", ha="center", fontsize=8)
    for n in nodes:
        y, d = pos[n.key]
        py, pd = pos[n.parent] if n.parent is not None else (root_y, 0)
        ax.plot([pd, d], [-py, -y], color=EDGE_COLOR, lw=1, zorder=1)
        ax.text(d, -y, _label(n, decode, max_chars), ha="center", va="center", fontsize=7, zorder=2,
                gid=f"prefix-tree:{'/'.join(map(str, n.block_ids))}",
                bbox=dict(boxstyle="round,pad=0.3", ec=EDGE_COLOR, fc=PALETTE[0] if n.held else CACHED_FREE_COLOR))
    ax.set_xlim(-0.3, depth + 0.6)
    ax.set_ylim(-leaves + 0.5, 0.5)
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=9)
    return fig
