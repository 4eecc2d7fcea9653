"""Connectors over a store of blocks keyed by their prefix: the shared-storage and offload tiers.

A full block's key is a hash chain over token ids, ``key_i = sha256(key_{i-1}, tokens of block
i)``: the same idea as the block pool's ``BlockKey`` (the K/V of a token depend on every token
before it), but stable across processes and restarts (Python's ``hash`` is per process). A
store holds, per key and per layer, the block's K and V ``[block_size, num_kv_heads,
head_dim]`` and its token ids (checked on load, so a hash collision is caught, not served).

The scheduler side counts, at admission, the blocks past the pool's own prefix hits that the
store holds (consecutive from there: a gap ends the match); the worker side copies them into
the blocks the scheduler allocated, layer by layer, before each layer reads the cache, and
saves each newly full block of known tokens layer by layer, right after the layer wrote it.
A load that fails (a file gone, a token mismatch, a dtype or geometry that differs) is reported
and the request recomputed: a connector never serves K/V it cannot vouch for. Nor does it store
any: a save that depends on a block whose load failed in that step (the request's own, or one it
shares) is skipped, layer by layer from the failure on, so the block never becomes whole in the
store. Saves are planned with the step (so the overlapped plan of the next step does not plan
them again) and taken back if the step is rolled back (:meth:`KVConnector.rollback`) or a save
is skipped: they are planned again. Stats count what arrived (``loaded_tokens``: blocks loaded
through every layer).

A request's load is done, layer by layer, inside the first step that runs it: a load waits in
``_arriving`` until the request is scheduled (at once, unless the connector ``load_kv_async``:
then the request waits outside the batch for the future ``update_state_after_alloc`` returns,
done at once here; a subclass may return one of its own, as a slower store would) and is
dropped if the request is preempted or retires first; a rolled-back step's loads wait again.
"""

from __future__ import annotations

import hashlib
import logging
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import paddle

from fleetlab.kv.paged_cache import gather_rows
from fleetlab.kv_transfer.base import KVConnector

logger = logging.getLogger(__name__)


def chain_keys(token_ids, block_size: int, num_blocks: int, keys: list[str] | None = None) -> list[str]:
    """Keys of the first ``num_blocks`` full blocks of ``token_ids`` (extending ``keys``, the
    keys of a prefix already computed)."""
    keys = list(keys or [])
    for i in range(len(keys), num_blocks):
        h = hashlib.sha256((keys[-1] if keys else "").encode())
        h.update(np.asarray(token_ids[i * block_size:(i + 1) * block_size], dtype=np.int64).tobytes())
        keys.append(h.hexdigest()[:32])
    return keys


class LoadError(RuntimeError):
    """A block the store promised cannot be loaded (gone, corrupt, or not what was asked for)."""


@dataclass(slots=True)
class BlockTransfer:
    """Blocks of one request to load or save: store keys, pool block ids, their token ids.
    A save also has ``first`` (the request's block index of its first block) and ``table`` (the
    request's blocks up to its last: what its K/V was computed from)."""

    req_id: str
    keys: list[str]
    block_ids: list[int]
    token_ids: list[list[int]]
    first: int = 0
    table: list[int] = field(default_factory=list)


@dataclass(slots=True)
class BlockStoreMeta:
    """One step's work for the worker side, and the admissions it counts (``(tokens, loaded)`` each)."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    lookups: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class _ReqState:
    keys: list[str] = field(default_factory=list)  # chain keys computed so far
    num_saved: int = 0  # leading blocks saved, found in the store, or planned to be saved by a step in flight


class BlockStoreConnector(KVConnector):
    """Loads and saves blocks through a store (subclasses give ``has``, ``read``, ``write``,
    ``flush``)."""

    name = "block_store"

    def __init__(self, config=None, spec=None):
        super().__init__(config, spec)
        self._reqs: dict[str, _ReqState] = {}
        self._arriving: dict[str, BlockTransfer] = {}  # loads of admitted requests, done in their first step that runs
        self._pending_lookups: list[tuple[int, int]] = []
        self._failed_reqs: set[str] = set()  # never offered again: recomputed instead
        self._meta = BlockStoreMeta()
        self._kv_cache = None
        self._failed_blocks: set[int] = set()

    # ------------------------------------------------------------------ the store
    def has(self, key: str) -> bool:
        raise NotImplementedError

    def read(self, key: str, layer_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(k, v, token_ids)`` of one block and layer; raise :class:`LoadError`."""
        raise NotImplementedError

    def write(self, key: str, layer_id: int, k: np.ndarray, v: np.ndarray, token_ids: list[int]) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """The step's writes are complete (every layer of every saved block)."""

    # ------------------------------------------------------------------ scheduler side
    def _keys(self, request, num_blocks: int) -> list[str]:
        state = self._reqs.setdefault(request.request_id, _ReqState())
        if len(state.keys) < num_blocks:
            state.keys = chain_keys(request.all_token_ids, self.spec.block_size, num_blocks, state.keys)
        return state.keys[:num_blocks]

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        if not self.loads or request.request_id in self._failed_reqs or request.skip_reading_prefix_cache:
            return 0
        bs = self.spec.block_size
        if num_computed_tokens % bs:  # a prefix cache that hits inside a block: the store holds whole blocks
            return 0
        max_blocks = (min(request.num_cacheable_tokens, request.num_tokens - 1)) // bs  # one token always runs
        start = num_computed_tokens // bs
        keys = self._keys(request, max_blocks)
        end = start
        while end < max_blocks and self.has(keys[end]):
            end += 1
        return (end - start) * bs

    def update_state_after_alloc(self, request, block_ids, num_computed_tokens, num_external_tokens):
        self._arriving.pop(request.request_id, None)  # (one left from a rolled-back admission is stale)
        if not self.loads:
            return None
        self._pending_lookups.append((request.num_tokens, num_external_tokens))  # counted when the plan is made
        if not num_external_tokens:
            return None
        bs = self.spec.block_size
        first, last = num_computed_tokens // bs, (num_computed_tokens + num_external_tokens) // bs
        tokens = request.all_token_ids
        self._arriving[request.request_id] = BlockTransfer(
            request.request_id, self._keys(request, last)[first:], list(block_ids[first:last]),
            [tokens[i * bs:(i + 1) * bs] for i in range(first, last)])
        if self.load_kv_async:  # the store is at hand: it may join at once (a subclass may return its own future)
            arrived = Future()
            arrived.set_result(True)
            return arrived
        return None

    def build_connector_meta(self, scheduler_output, scheduler) -> BlockStoreMeta:
        for rid in scheduler_output.preempted_req_ids:
            self._arriving.pop(rid, None)  # preempted before its first step ran: it asks again when re-admitted
        meta = BlockStoreMeta(lookups=self._pending_lookups)
        meta.loads = [self._arriving.pop(rid) for rid in scheduler_output.num_scheduled_tokens if rid in self._arriving]
        if self.saves:
            for rid, n in scheduler_output.num_scheduled_tokens.items():
                save = self._blocks_to_save(scheduler.requests[rid], n, scheduler.kv.get_block_ids(rid))
                if save is not None:
                    meta.saves.append(save)
        for save in meta.saves:  # planned: a step planned before this one runs does not plan them again
            self._reqs[save.req_id].num_saved = max(self._reqs[save.req_id].num_saved, save.first + len(save.keys))
        self._pending_lookups = []
        self._count_lookups(meta.lookups, 1)
        return meta

    def _count_lookups(self, lookups: list[tuple[int, int]], sign: int) -> None:
        self.stats.lookups += sign * len(lookups)
        self.stats.query_tokens += sign * sum(n for n, _ in lookups)
        self.stats.hit_lookups += sign * sum(1 for _, loaded in lookups if loaded)

    def rollback(self, scheduler_output) -> None:
        """The step never happened: its lookups are uncounted, its loads wait for the next step
        that runs their request (one sent back to the queue is looked up again when re-admitted),
        and the saves it planned are planned again."""
        self._pending_lookups = []
        meta = scheduler_output.kv_connector_metadata
        if isinstance(meta, BlockStoreMeta):
            self._count_lookups(meta.lookups, -1)
            for load in meta.loads:
                self._arriving.setdefault(load.req_id, load)
            self._unplan(meta.saves)

    def _unplan(self, saves: list[BlockTransfer]) -> None:
        """These saves did not happen: their blocks are planned again (if the store still lacks them)."""
        for save in saves:
            state = self._reqs.get(save.req_id)
            if state is not None:
                state.num_saved = min(state.num_saved, save.first)

    def _blocks_to_save(self, req, num_new_tokens: int, block_ids: list[int]) -> BlockTransfer | None:
        """The request's blocks that this step fills with known tokens and the store lacks."""
        bs = self.spec.block_size
        state = self._reqs.setdefault(req.request_id, _ReqState())
        num_full = min(req.num_computed_tokens + num_new_tokens, req.num_cacheable_tokens) // bs
        if num_full <= state.num_saved:
            return None
        keys = self._keys(req, num_full)
        first = state.num_saved
        while first < num_full and self.has(keys[first]):  # found in the store: nothing to save
            first += 1
        state.num_saved = first
        if first == num_full:
            return None
        tokens = req.all_token_ids
        return BlockTransfer(req.request_id, keys[first:num_full], block_ids[first:num_full],
                             [tokens[i * bs:(i + 1) * bs] for i in range(first, num_full)], first,
                             block_ids[:num_full])

    def request_finished(self, request, block_ids) -> bool:
        self._arriving.pop(request.request_id, None)
        self._reqs.pop(request.request_id, None)
        self._failed_reqs.discard(request.request_id)
        return False

    # ------------------------------------------------------------------ worker side
    def start_load_kv(self, metadata, kv_cache) -> None:
        self._meta = metadata if metadata is not None else BlockStoreMeta()
        self._kv_cache = kv_cache

    def wait_for_layer_load(self, layer_id: int) -> None:
        for load in self._meta.loads:
            if load.req_id in self._failed_reqs:
                continue
            try:
                ks, vs = zip(*(self._read_checked(key, layer_id, tokens)
                               for key, tokens in zip(load.keys, load.token_ids)))
            except LoadError as exc:
                logger.warning("KV connector %s: load of request %s failed (%s); it will be recomputed",
                               self.name, load.req_id, exc)
                self._failed_reqs.add(load.req_id)
                self._failed_blocks.update(load.block_ids)
                self.stats.failed_loads += 1
                continue
            self._write_blocks(layer_id, load.block_ids, np.stack(ks), np.stack(vs))
            if layer_id == self.spec.num_layers - 1:  # it arrived whole: count it now
                self.stats.loaded_blocks += len(load.block_ids)
                self.stats.loaded_tokens += len(load.block_ids) * self.spec.block_size

    def _read_checked(self, key, layer_id, tokens):
        k, v, stored_tokens = self.read(key, layer_id)
        want = (self.spec.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        dtype = np.dtype(np.uint16 if self.spec.dtype == "bfloat16" else self.spec.dtype)  # bfloat16: its bits
        if tuple(np.shape(k)) != want or tuple(np.shape(v)) != want:
            raise LoadError(f"block {key} holds K/V {list(np.shape(k))}, the cache wants {list(want)}")
        if getattr(k, "dtype", None) != dtype or getattr(v, "dtype", None) != dtype:
            raise LoadError(f"block {key} holds K/V of dtype {getattr(k, 'dtype', type(k).__name__)}, the cache "
                            f"is {self.spec.dtype}")
        if list(stored_tokens) != list(tokens):
            raise LoadError(f"block {key} holds other tokens (hash collision?)")
        self.stats.bytes_loaded += k.nbytes + v.nbytes
        return k, v

    def _write_blocks(self, layer_id: int, block_ids: list[int], k: np.ndarray, v: np.ndarray) -> None:
        """Blocks ``[n, block_size, H, D]`` into the cache, through the cache's own slot write."""
        bs = self.spec.block_size
        slots = (np.asarray(block_ids, dtype=np.int64)[:, None] * bs + np.arange(bs)).reshape(-1)
        shape = [-1, self.spec.num_kv_heads, self.spec.head_dim]
        self._kv_cache.write(layer_id, _to_tensor(k, self.spec.dtype).reshape(shape),
                             _to_tensor(v, self.spec.dtype).reshape(shape), paddle.to_tensor(slots))

    def save_kv_layer(self, layer_id: int, kv_cache, attn_metadata) -> None:
        if not self._meta.saves:
            return
        # K/V computed on top of a block whose load failed (this layer or before) is not to be stored.
        saves = [s for s in self._meta.saves if not self._failed_blocks.intersection(s.table)]
        if not saves:
            return
        index = paddle.to_tensor([b for s in saves for b in s.block_ids], dtype="int64")
        k = _to_numpy(gather_rows(kv_cache.key_cache(layer_id), index))
        v = _to_numpy(gather_rows(kv_cache.value_cache(layer_id), index))
        i = 0
        for save in saves:
            for key, tokens in zip(save.keys, save.token_ids):
                self.write(key, layer_id, k[i], v[i], tokens)
                self.stats.bytes_saved += k[i].nbytes + v[i].nbytes
                i += 1
        if layer_id == self.spec.num_layers - 1:
            self.stats.saved_blocks += i

    def wait_for_save(self) -> None:
        self.flush()
        self._unplan([s for s in self._meta.saves if self._failed_blocks.intersection(s.table)])  # skipped
        self._meta = BlockStoreMeta()

    def get_finished(self, finished_req_ids):
        failed, self._failed_blocks = self._failed_blocks, set()
        return set(), failed


def _to_numpy(t: paddle.Tensor) -> np.ndarray:
    """A cache tensor on the host; bfloat16 travels as its uint16 bits (numpy has no bfloat16)."""
    if t.dtype == paddle.bfloat16:
        return t.view(paddle.uint16).numpy()
    return t.numpy()


def _to_tensor(a: np.ndarray, dtype: str) -> paddle.Tensor:
    t = paddle.to_tensor(a)
    return t.view(paddle.bfloat16) if dtype == "bfloat16" else t
