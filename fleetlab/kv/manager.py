"""``KVCacheManager``: the scheduler's request-level view of the block pool.

The pool knows blocks; the manager knows which blocks each request holds, how many of a
new request's tokens the prefix cache already holds, and which blocks become shareable.
The scheduler never touches the pool: it asks the manager. ``allocate_slots`` answers with the
block ids it handed out (a tuple; None: no room) and ``get_computed_blocks`` with the prefix-cache
hits (a tuple the scheduler passes back to ``allocate_slots``); a request's whole block table,
what the scheduler sends the runner, comes from :meth:`KVCacheManager.get_block_ids`.

Same-step sharing: a full block of *known* tokens (prompt or accepted output, never a
speculative draft) is registered in the prefix cache as soon as it is allocated for tokens
scheduled in this step, so a request admitted later in the same step can hit it. That is
safe because of the invariant the attention backends keep: **every layer writes the whole
step's K/V into the cache before it attends**, so a row that reads a block another row of
the same step fills sees the written values. If the step then fails, or the request is
preempted before the step runs, :meth:`KVCacheManager.rollback_step` / :meth:`free` take
those registrations back, so no cached block ever points at K/V that was never written.
An overlapped loop (:mod:`fleetlab.overlap`) plans a step while the one before is in flight:
:meth:`KVCacheManager.open_step` starts the next step's log, so two steps' registrations are
open at once; ``commit_step`` closes the oldest, ``rollback_step`` takes back all of them.

A match that ends inside a block (:meth:`~fleetlab.prefix_cache.PrefixCache.lookup_partial`, the
radix tree's) is served by a copy: ``get_computed_blocks`` returns the whole-block hits with the
block to copy from (:class:`ComputedBlocks`), ``allocate_slots`` pins that block (a reference,
so no allocation can reuse it) and plans a :class:`~fleetlab.kv.copies.BlockCopy` of its head into
the request's first new block; :meth:`KVCacheManager.take_copies` hands the copy to the first
step that schedules the request (each layer of that step's forward copies right after writing the step's K/V, so a
block the same step fills can lend its head, as it can be shared whole), and the pin is released
when that step commits. A block that a planned copy writes into is never a source.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fleetlab.kv.block_pool import BlockPool
from fleetlab.kv.copies import BlockCopy
from fleetlab.prefix_cache import cache_call, check_partial_hit, checked_hits, checked_num_cached


@dataclass(slots=True)
class _Registration:
    """Blocks a request registered in the prefix cache during one step (undo log)."""

    num_cached_before: int
    block_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _StepLog:
    """One open step's undo log: its registrations per request, the hit-rate counters before its
    first admission (None: it admitted nobody with prefix caching on), and the copies it carries
    (their source blocks pinned until it commits)."""

    registrations: dict[str, _Registration] = field(default_factory=dict)
    counters_before: object = None
    copies: list[BlockCopy] = field(default_factory=list)


class ComputedBlocks(tuple):
    """A new request's prefix-cache hits: the whole blocks to share (the tuple's items), then
    ``num_copy_tokens`` tokens to copy from the head of block ``copy_from`` (None: no copy)."""

    copy_from: int | None
    num_copy_tokens: int

    def __new__(cls, block_ids=(), copy_from: int | None = None, num_copy_tokens: int = 0):
        self = super().__new__(cls, block_ids)
        self.copy_from, self.num_copy_tokens = copy_from, num_copy_tokens
        return self


class KVCacheManager:
    """Allocates, shares and frees each request's blocks in a :class:`~fleetlab.BlockPool`.

    Args:
      pool: the block pool (``num_blocks`` blocks of ``block_size`` tokens).

    A request is anything with ``request_id``, ``all_token_ids``, ``num_tokens``,
    ``num_computed_tokens`` and ``num_cacheable_tokens`` (the scheduler's ``Request``: tokens
    past a replaced embedding are never shared, their K/V depend on more than token ids).
    """

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.prefix_cache = pool.prefix_cache  # None: nothing is shared
        self.block_size = pool.block_size
        self._blocks: dict[str, list[int]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks already in the prefix cache
        self._step_logs: list[_StepLog] = [_StepLog()]  # open steps, oldest first; the last one plans now
        self._pending_copies: dict[str, BlockCopy] = {}  # planned, not yet in a step (source pinned)

    # ------------------------------------------------------------------ queries
    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens (ceil division)."""
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (a copy)."""
        return list(self._blocks.get(request_id, ()))

    # ------------------------------------------------------------------ allocation
    def get_computed_blocks(self, request) -> tuple[ComputedBlocks, int]:
        """Cached blocks holding a prefix of a new request (with the partial block to copy, if the
        cache matches inside one), and the tokens they cover.

        Never the whole request: at least one token is always computed. No hits for a
        request that ``skip_reading_prefix_cache`` (its blocks are still cached for others). Counts
        nothing in the hit rate (a request that cannot be admitted is looked up again next
        step); the scheduler counts the query once, on admission, with :meth:`record_lookup`.
        """
        if self.prefix_cache is None or getattr(request, "skip_reading_prefix_cache", False):
            return ComputedBlocks(), 0
        tokens = request.all_token_ids[: request.num_cacheable_tokens]
        hits = checked_hits(self.prefix_cache, cache_call(self.prefix_cache, "lookup", tokens, record_stats=False),
                            len(tokens), self.pool.num_blocks)
        # A step's copies are applied together (each reads its source as the layer's write left it):
        # a block that a copy not yet applied writes into cannot lend its head.
        copying = {c.dst_block for c in self._pending_copies.values()}
        partial = check_partial_hit(self.prefix_cache, cache_call(self.prefix_cache, "lookup_partial", tokens,
                                                                  len(hits), copying), tokens, len(hits), copying)
        if partial is None:
            return ComputedBlocks(hits), len(hits) * self.block_size
        return ComputedBlocks(hits, *partial), len(hits) * self.block_size + partial[1]

    def record_lookup(self, request, num_hit_tokens: int) -> None:
        """Count one admission's prefix-cache query in the hit rate (undone if the step fails)."""
        log = self._step_logs[-1]
        log.counters_before = log.counters_before or self.prefix_cache.lookup_counters()
        self.prefix_cache.record_lookup(request.num_tokens, *divmod(num_hit_tokens, self.block_size))

    def allocate_slots(self, request, num_new_tokens: int, num_lookahead_tokens: int = 0,
                       hits: tuple[int, ...] = (), max_num_tokens: int | None = None) -> tuple[int, ...] | None:
        """Make room for the request's next ``num_new_tokens`` tokens; returns the blocks it handed
        out (``hits``, then the new ones)::

            |<------------------------- tokens the request will hold --------------------->|
            | computed |         hits          | num_new_tokens (this step) | num_lookahead |
            |<- held ->|<- prefix-cache hits ->|<-------- allocated now, if not held ------>|
                                        ^ full blocks of known tokens up to here are registered

        ``hits`` (first admission only; vLLM's ``new_computed_blocks``) are the prefix-cache hits of
        :meth:`get_computed_blocks`: the request takes a reference on them and its
        ``num_computed_tokens`` moves past them (the caller sets it); a partial hit
        (``hits.copy_from``) is pinned and its copy into the first new block planned.
        ``num_lookahead_tokens`` reserves slots past this step's tokens (a draft model writes its
        proposals there); ``max_num_tokens`` caps the slots (the model's length). Returns None,
        changing nothing, when the pool cannot supply the blocks.
        """
        rid = request.request_id
        held = self._blocks.get(rid, [])
        copy_from = getattr(hits, "copy_from", None)
        num_computed = request.num_computed_tokens + len(hits) * self.block_size + getattr(hits, "num_copy_tokens", 0)
        num_slots = num_computed + num_new_tokens + num_lookahead_tokens
        if max_num_tokens is not None:
            num_slots = min(num_slots, max_num_tokens)
        num_new_blocks = max(0, self.blocks_needed(num_slots) - len(held) - len(hits))
        if not num_new_blocks and not hits:  # most decode steps: the next slots are in blocks it holds
            self._cache_known_blocks(request, num_computed + num_new_tokens)
            return ()
        # A hit on a block nobody holds takes it out of the free queue: it costs a free block too.
        pinned = [copy_from] if copy_from is not None else []
        revived = sum(1 for b in (*hits, *pinned) if self.pool.ref_count(b) == 0)
        if num_new_blocks + revived > self.pool.num_free_blocks:
            return None
        self.pool.touch([*hits, *pinned])  # before allocating: the allocation may not hand these out
        try:
            new_blocks = self.pool.allocate(num_new_blocks) if num_new_blocks else []
        except BaseException:  # (the prefix cache failed) nothing taken
            self.pool.free([*hits, *pinned])
            raise
        blocks = self._blocks.setdefault(rid, [])
        blocks += [*hits, *new_blocks]
        if hits:
            self._num_cached[rid] = len(blocks) - len(new_blocks)
        if pinned:  # (a partial hit leaves at least one token to compute: there is a new block)
            self._pending_copies[rid] = BlockCopy(rid, copy_from, new_blocks[0], hits.num_copy_tokens)
        self._cache_known_blocks(request, num_computed + num_new_tokens)
        return (*hits, *new_blocks)

    def _cache_known_blocks(self, request, num_tokens: int) -> None:
        """Register the request's blocks that are full of known (and cacheable) tokens among
        its first ``num_tokens`` once this step runs."""
        rid = request.request_id
        num_cached = self._num_cached.get(rid, 0)
        if num_tokens // self.block_size <= num_cached or self.prefix_cache is None:
            return  # no block filled up this step (checked first: it is the common case)
        num_full = min(num_tokens, request.num_cacheable_tokens) // self.block_size
        if num_full <= num_cached:
            return
        blocks = self._blocks[rid]
        try:
            self._num_cached[rid] = checked_num_cached(self.prefix_cache, cache_call(
                self.prefix_cache, "cache_blocks", request.all_token_ids, blocks, num_cached, num_full),
                num_cached, num_full)
        except BaseException:  # whatever it registered before it failed is not to be trusted
            self.pool.uncache(blocks[num_cached:num_full])
            raise
        # Fresh blocks have no key, so the keyed ones are this call's (a block whose content is
        # already cached under another block stays unkeyed).
        log = self._step_logs[-1].registrations.setdefault(rid, _Registration(num_cached))
        log.block_ids.extend(b for b in blocks[num_cached:num_full] if self.pool.is_cached(b))

    def free(self, request) -> None:
        """Give back every block of the request (tail first, so its prefix lives longest).

        Blocks it registered in an open step lose their cache entry first: their K/V may
        never be written (the request is preempted or aborted before its step runs). A request
        that finished by itself offers its partly filled last block to the cache first (``cache_tail``).
        """
        rid = request.request_id
        for step_log in self._step_logs:
            log = step_log.registrations.pop(rid, None)
            if log is not None:
                self.pool.uncache(log.block_ids)
        self._cache_tail(request)
        self.pool.free(self._blocks.pop(rid, []))
        self._num_cached.pop(rid, None)
        copy = self._pending_copies.pop(rid, None)  # (one a step carries stays pinned until that step ends)
        if copy is not None:
            self.pool.free([copy.src_block])

    def _cache_tail(self, request) -> None:
        """A request that finished by itself (a stop, or its length) offers the prefix cache its last,
        partly filled block: every token but the last sampled one has its K/V written by a committed
        step (an aborted, preempted or rolled-back request's count may run ahead of its K/V)."""
        if self.prefix_cache is None or getattr(request, "finish_reason", None) not in ("stop", "length"):
            return
        num_tokens = min(request.num_computed_tokens, request.num_tokens - 1, request.num_cacheable_tokens)
        self.prefix_cache.cache_tail(request.all_token_ids, self._blocks.get(request.request_id, []), num_tokens)

    def free_blocks_beyond(self, request, num_tokens: int) -> int:
        """Free the request's blocks past the first ``num_tokens`` slots (after rejected
        drafts rolled ``num_computed_tokens`` back); returns how many were freed."""
        blocks = self._blocks.get(request.request_id, [])
        keep = self.blocks_needed(num_tokens)
        tail = blocks[keep:]
        del blocks[keep:]
        self.pool.free(tail)  # (none when it holds no more than it keeps)
        return len(tail)

    # ------------------------------------------------------------------ copies and step transactions
    def take_copies(self, scheduled_req_ids) -> list[BlockCopy]:
        """The planned copies of the requests this step schedules (``SchedulerOutput.kv_copies``):
        the runner applies them before the step's forward; their sources stay pinned until the
        step commits. A request not scheduled yet (its K/V still arriving) keeps its copy."""
        copies = [self._pending_copies.pop(rid) for rid in scheduled_req_ids if rid in self._pending_copies]
        self._step_logs[-1].copies += copies
        return copies

    def pinned_copies(self) -> list[BlockCopy]:
        """Every copy whose source block is pinned: planned, or carried by an open step."""
        return [*self._pending_copies.values(), *(c for log in self._step_logs for c in log.copies)]

    def open_step(self) -> None:
        """The step just planned stays open (in flight); the next one plans into a log of its own."""
        self._step_logs.append(_StepLog())

    def commit_step(self) -> None:
        """The oldest open step ran: its registrations stand, its copies are done (unpin their sources)."""
        done = self._step_logs.pop(0)
        if done.copies:
            self.pool.free([c.src_block for c in done.copies])
        if not self._step_logs:
            self._step_logs.append(_StepLog())

    def rollback_step(self) -> None:
        """The step failed: drop every prefix-cache registration of every open step (newest first,
        so each request's cached count ends as it was before the oldest), and their queries' counts;
        their copies are due again (pending, the source still pinned) for requests still held."""
        counters = next((log.counters_before for log in self._step_logs if log.counters_before is not None), None)
        if counters is not None:
            self.prefix_cache.restore_lookup_counters(counters)
        for step_log in reversed(self._step_logs):
            for rid, log in step_log.registrations.items():
                self.pool.uncache(log.block_ids)
                if rid in self._num_cached:
                    self._num_cached[rid] = log.num_cached_before
            for copy in step_log.copies:  # not done (or undone with the step): due again, pin and all
                if copy.dst_block in self._blocks.get(copy.req_id, ()):
                    self._pending_copies[copy.req_id] = copy
                else:
                    self.pool.free([copy.src_block])
        self._step_logs = [_StepLog()]
