"""The radix-tree prefix cache (SGLang's RadixAttention) over a paged pool.

The tree is keyed by token ids. Each node's edge is a run of whole *pages* (one page = one KV
block of ``block_size`` tokens) and holds the block id of each page; the path from the root to
a node spells the tokens whose K/V those blocks hold. Children are keyed by their first page,
so two children of a node never start with the same page. A leaf may end in a *tail page*: the
partly filled last block of a finished request (:meth:`RadixCache.cache_tail`), never shared
whole, only copied from::

    root ── [sys prompt: 3 pages] ─┬─ [question A: 2 pages]
                                   └─ [question B: 1 page] ── [answer B: 4 pages]

- **match** walks the tree page by page from the root and returns the blocks of the longest
  cached prefix (:meth:`RadixCache.lookup`);
- **insert** walks the same way and hangs the request's new pages where the walk stops: at
  the end of a leaf it extends the leaf, inside an edge it **splits** the node in two there
  (:meth:`RadixCache._split`) and adds a child (:meth:`RadixCache.cache_blocks`);
- **reference counts** are the pool's: a block a running request holds has a count above
  zero and is never evicted; a request always holds the whole path to its pages, so an
  unreferenced page has only unreferenced pages below it;
- **eviction** takes unreferenced pages from the tail of the least recently released leaf,
  removing the leaf once empty (its parent may become a leaf in turn) (:meth:`RadixCache.evict`).

**A match that ends inside a page** is token granular: the pages matched whole are shared, and
:meth:`RadixCache.lookup_partial` names the page whose head continues the match (the next page
of the edge the walk stopped in, or the child page sharing the most leading tokens) and how many
of its tokens match. The KV manager copies those tokens' K/V into the request's own first new
block (:mod:`fleetlab.kv.copies`) instead of recomputing them; the hash chain, keyed by whole
blocks, recomputes them. README "Prefix caching" gives the copy's cost per token beside a
recomputed token's, as measured.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection, Iterator, Sequence

from fleetlab.prefix_cache import PrefixCache


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class RadixNode:
    """One edge of the tree: ``token_ids`` (whole pages), the ``block_ids`` holding them (one per
    page), its ``children`` by first page, and when its last page was released (``last_access``)."""

    __slots__ = ("block_ids", "children", "last_access", "parent", "token_ids")

    def __init__(self, token_ids: tuple[int, ...], block_ids: list[int], parent: RadixNode | None):
        self.token_ids, self.block_ids, self.parent = token_ids, block_ids, parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.last_access = 0

    def __repr__(self) -> str:
        return f"RadixNode(pages={len(self.block_ids)}, blocks={self.block_ids}, children={len(self.children)})"


class RadixCache(PrefixCache):
    """A radix tree over token ids whose edges are runs of whole pages (see the module)."""

    name = "radix"

    def __init__(self, block_size: int):
        super().__init__(block_size)
        self.root = RadixNode((), [], None)
        self._node_of: dict[int, RadixNode] = {}  # block id -> the node holding its page
        self._clock = itertools.count(1)

    def _page(self, token_ids: Sequence[int], i: int) -> tuple[int, ...]:
        return tuple(int(t) for t in token_ids[i * self.block_size : (i + 1) * self.block_size])

    # ------------------------------------------------------------------ match
    def _walk(self, token_ids: Sequence[int], num_pages: int) -> Iterator[tuple[RadixNode, int]]:
        """``(node, j)`` for each of the first ``num_pages`` pages of ``token_ids`` found in the
        tree, in order: page ``j`` of ``node`` holds it. Stops at the first page not found."""
        node, i = self.root, 0
        while i < num_pages:
            node = node.children.get(self._page(token_ids, i))
            if node is None:
                return
            for j in range(len(node.block_ids)):
                if i == num_pages or (j and self._page(node.token_ids, j) != self._page(token_ids, i)):
                    return
                yield node, j
                i += 1

    def _end_of_walk(self, token_ids: Sequence[int], num_pages: int) -> tuple[RadixNode, int] | None:
        """Where the walk over the first ``num_pages`` pages of ``token_ids`` ends: ``(node, j)``, after
        page ``j - 1`` of ``node`` (the root and 0 for no pages); None if the tree lacks one of them."""
        end, walked = (self.root, 0), 0
        for node, j in self._walk(token_ids, num_pages):
            end, walked = (node, j + 1), walked + 1
        return end if walked == num_pages else None

    def lookup(self, token_ids: Sequence[int], *, record_stats: bool = True) -> list[int]:
        """Blocks holding the longest cached page-granular prefix of ``token_ids`` (never the
        whole prompt); counts one query unless ``record_stats=False``; takes no references."""
        hits = [node.block_ids[j] for node, j in self._walk(token_ids, self.max_hit_blocks(len(token_ids)))]
        if record_stats:
            self.record_lookup(len(token_ids), len(hits))
        return hits

    def lookup_partial(self, token_ids: Sequence[int], num_hit_blocks: int,
                       exclude: Collection[int] = ()) -> tuple[int, int] | None:
        """The page whose head continues the match after the first ``num_hit_blocks`` pages (what
        :meth:`lookup` found) and how many of its tokens match, short of the prompt's last token:
        ``(block_id, num_tokens)``, or None if no page (outside ``exclude``) starts with the next token."""
        bs, i = self.block_size, int(num_hit_blocks)
        want = tuple(int(t) for t in token_ids[i * bs : min((i + 1) * bs, len(token_ids) - 1)])
        if not want:
            return None
        end = self._end_of_walk(token_ids, i)
        if end is None:  # not the pages lookup found
            return None
        node, j = end
        candidates = ([(node.block_ids[j], self._page(node.token_ids, j))] if j < len(node.block_ids) else
                      [(child.block_ids[0], first) for first, child in node.children.items()])
        best = max(((_common_prefix(page, want), b) for b, page in candidates if b not in exclude), default=(0, None))
        return (best[1], best[0]) if best[0] else None

    # ------------------------------------------------------------------ insert
    def cache_blocks(self, token_ids, block_ids, num_cached_blocks, num_full_blocks) -> int:
        """Insert the request's full pages ``[0, num_full_blocks)`` (those before
        ``num_cached_blocks`` are found on the way). Returns ``num_full_blocks``.

        The walk stops at a page the tree already holds in *another* block (two requests
        computed it side by side): the request's copy and its later pages stay out of the tree,
        so every page in it hangs below pages its owners hold.
        """
        _, end = self.check_cache_args(token_ids, block_ids, num_cached_blocks, num_full_blocks)
        node, j, i = self.root, 0, 0  # the walk is after page j - 1 of node, at page i of the request
        for node, j in self._walk(token_ids, end):
            if node.block_ids[j] != block_ids[i]:
                return end
            i, j = i + 1, j + 1
        if i < end:
            bs = self.block_size
            self._attach(node, j, tuple(int(t) for t in token_ids[i * bs : end * bs]), list(block_ids[i:end]))
        return end

    def cache_tail(self, token_ids, block_ids, num_tokens: int) -> bool:
        """Keep a finished request's last, partly filled page: block ``block_ids[num_tokens //
        block_size]`` holds the K/V of the ``num_tokens % block_size`` tokens after its full pages.
        It hangs where the walk over those full pages ends (all of them must be in the tree, in
        any blocks: K/V depend on the tokens only), as a *tail page*: the last page of a leaf,
        never matched whole, only copied from (:meth:`lookup_partial`). False if it is not kept
        (no full-page path, no token past the last full page, or the same tail kept already)."""
        bs, num_tokens = self.block_size, int(num_tokens)
        i, n = divmod(num_tokens, bs)
        if not n or i >= len(block_ids) or block_ids[i] in self._node_of:
            return False
        end = self._end_of_walk(token_ids, i)
        if end is None:
            return False
        node, j = end
        tail = tuple(int(t) for t in token_ids[i * bs : num_tokens])
        if tail in node.children if j == len(node.block_ids) else self._page(node.token_ids, j) == tail:
            return False  # the same tail is kept already
        self._attach(node, j, tail, [block_ids[i]])
        return True

    def _attach(self, node: RadixNode, j: int, tokens: tuple[int, ...], blocks: list[int]) -> None:
        """Hang pages ``tokens`` (in ``blocks``; the last may be a tail page) after page ``j - 1`` of ``node``."""
        if j < len(node.block_ids):  # the walk stopped inside the edge: split it there
            node = self._split(node, j)
        if node is not self.root and not node.children:  # a leaf grows in place
            node.token_ids += tokens
            node.block_ids += blocks
        else:
            child = RadixNode(tokens, blocks, node)
            node.children[tokens[: self.block_size]] = child
            node = child
        for b in blocks:
            self._node_of[b] = node

    def _split(self, node: RadixNode, j: int) -> RadixNode:
        """Cut ``node``'s edge after ``j`` pages: a new node takes the first ``j`` pages and
        becomes ``node``'s parent. Returns the new node."""
        cut = j * self.block_size
        upper = RadixNode(node.token_ids[:cut], node.block_ids[:j], node.parent)
        upper.last_access = node.last_access
        node.parent.children[node.token_ids[: self.block_size]] = upper
        node.token_ids, node.block_ids, node.parent = node.token_ids[cut:], node.block_ids[j:], upper
        upper.children[node.token_ids[: self.block_size]] = node
        for b in upper.block_ids:
            self._node_of[b] = upper
        return upper

    # ------------------------------------------------------------------ pool hooks: release, evict
    def keeps(self, block_id: int) -> bool:
        """A page's last owner let it go: the tree keeps it (until evicted) and notes when."""
        node = self._node_of.get(block_id)
        if node is None:
            return False
        node.last_access = next(self._clock)
        return True

    def evict(self, n: int) -> list[int]:
        """Give back up to ``n`` unreferenced pages, least recently released leaves first,
        each leaf from its tail (the pages of a prefix's head go last)."""
        heap = [(leaf.last_access, id(leaf), leaf) for leaf in self._leaves()]
        heapq.heapify(heap)
        out: list[int] = []
        while len(out) < n and heap:
            _, _, leaf = heapq.heappop(heap)
            key = leaf.token_ids[: self.block_size]
            while len(out) < n and leaf.block_ids and self._ref_count(leaf.block_ids[-1]) == 0:
                out.append(self._pop_page(leaf))
            parent = leaf.parent
            if not leaf.block_ids:
                del parent.children[key]
                if parent is not self.root and not parent.children:
                    heapq.heappush(heap, (parent.last_access, id(parent), parent))
        self.evictions += len(out)
        return out

    def _pop_page(self, node: RadixNode) -> int:
        block_id = node.block_ids.pop()
        node.token_ids = node.token_ids[: len(node.block_ids) * self.block_size]  # (a tail page is shorter)
        del self._node_of[block_id]
        return block_id

    def _leaves(self) -> Iterator[RadixNode]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                yield node

    # ------------------------------------------------------------------ undo, queries
    def uncache(self, block_ids: Sequence[int]) -> list[int]:
        """Drop these pages, everything after them on their edge and the subtree below (their
        K/V will never be written); returns every block that left the tree."""
        dropped: list[int] = []
        for block_id in block_ids:
            node = self._node_of.get(block_id)
            if node is None:
                continue  # already dropped with an earlier page
            j = node.block_ids.index(block_id)
            gone, stack = node.block_ids[j:], list(node.children.values())
            while stack:
                child = stack.pop()
                stack.extend(child.children.values())
                gone += child.block_ids
            if j == 0:
                del node.parent.children[node.token_ids[: self.block_size]]
            node.children = {}
            node.block_ids, node.token_ids = node.block_ids[:j], node.token_ids[: j * self.block_size]
            for b in gone:
                del self._node_of[b]
            dropped += gone
        return dropped

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._node_of

    @property
    def num_cached_blocks(self) -> int:
        return len(self._node_of)

    def eviction_order(self, block_ids) -> list[int]:
        """Approximately :meth:`evict`'s order: least recently released node first, tail page first."""
        def rank(b):
            node = self._node_of[b]
            return node.last_access, -node.block_ids.index(b)
        return sorted(block_ids, key=rank)

    def nodes(self) -> Iterator[tuple[int, RadixNode]]:
        """Every node but the root with its depth (root's children at 1), depth first."""
        stack = [(1, child) for child in reversed(list(self.root.children.values()))]
        while stack:
            depth, node = stack.pop()
            yield depth, node
            stack.extend((depth + 1, c) for c in reversed(list(node.children.values())))

    def check_invariants(self) -> None:
        bs, seen = self.block_size, 0
        for _, node in self.nodes():
            last = len(node.token_ids) - (len(node.block_ids) - 1) * bs  # tokens of its last page
            if not node.block_ids or not 0 < last <= bs or (last < bs and node.children):
                raise RuntimeError(f"{node!r}: {len(node.token_ids)} tokens for {len(node.block_ids)} pages "
                                   f"(only a leaf's last page may be a tail page)")
            if node.parent.children.get(node.token_ids[:bs]) is not node:
                raise RuntimeError(f"{node!r} is not its parent's child under its first page")
            before = node.parent.block_ids[-1:]  # the page before this node's first
            for b in node.block_ids:
                if self._node_of.get(b) is not node:
                    raise RuntimeError(f"block {b} is on {node!r} but mapped to {self._node_of.get(b)!r}")
                if self._ref_count(b) > 0 and before and self._ref_count(before[0]) == 0:
                    raise RuntimeError(f"block {b} is referenced but the page before it ({before[0]}) is not")
                before = [b]
            seen += len(node.block_ids)
        if seen != len(self._node_of):
            raise RuntimeError(f"the tree holds {seen} pages but maps {len(self._node_of)} blocks")
