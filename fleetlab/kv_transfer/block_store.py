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
A load that fails (a file gone, a token mismatch, a geometry that differs) is reported and the
request recomputed: a connector never serves K/V it cannot vouch for.
"""

from __future__ import annotations

import hashlib
import logging
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
    """Blocks of one request to load or save: store keys, pool block ids, their token ids."""

    req_id: str
    keys: list[str]
    block_ids: list[int]
    token_ids: list[list[int]]


@dataclass(slots=True)
class BlockStoreMeta:
    """One step's work for the worker side."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass(slots=True)
class _ReqState:
    keys: list[str] = field(default_factory=list)  # chain keys computed so far
    num_saved: int = 0  # leading blocks already saved (or found in the store)


class BlockStoreConnector(KVConnector):
    """Loads and saves blocks through a store (subclasses give ``has``, ``read``, ``write``,
    ``flush``)."""

    name = "block_store"

    def __init__(self, config=None, spec=None):
        super().__init__(config, spec)
        self._reqs: dict[str, _ReqState] = {}
        self._pending_loads: list[BlockTransfer] = []
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
        if not self.loads:
            return
        self.stats.lookups += 1
        self.stats.query_tokens += request.num_tokens
        if not num_external_tokens:
            return
        bs = self.spec.block_size
        first, last = num_computed_tokens // bs, (num_computed_tokens + num_external_tokens) // bs
        tokens = request.all_token_ids
        self._pending_loads.append(BlockTransfer(
            request.request_id, self._keys(request, last)[first:], list(block_ids[first:last]),
            [tokens[i * bs:(i + 1) * bs] for i in range(first, last)]))
        self.stats.hit_lookups += 1
        self.stats.loaded_tokens += num_external_tokens

    def build_connector_meta(self, scheduler_output, scheduler) -> BlockStoreMeta:
        meta = BlockStoreMeta(loads=self._pending_loads)
        self._pending_loads = []
        if self.saves:
            for rid, n in scheduler_output.num_scheduled_tokens.items():
                save = self._blocks_to_save(scheduler.requests[rid], n, scheduler.kv.get_block_ids(rid))
                if save is not None:
                    meta.saves.append(save)
        return meta

    def _blocks_to_save(self, req, num_new_tokens: int, block_ids: list[int]) -> BlockTransfer | None:
        """The request's blocks that this step fills with known tokens and the store lacks."""
        bs = self.spec.block_size
        state = self._reqs.setdefault(req.request_id, _ReqState())
        num_full = min(req.num_computed_tokens + num_new_tokens, req.num_cacheable_tokens) // bs
        if num_full <= state.num_saved:
            return None
        keys = self._keys(req, num_full)
        wanted = [i for i in range(state.num_saved, num_full) if not self.has(keys[i])]
        state.num_saved = num_full
        if not wanted:
            return None
        tokens = req.all_token_ids
        return BlockTransfer(req.request_id, [keys[i] for i in wanted], [block_ids[i] for i in wanted],
                             [tokens[i * bs:(i + 1) * bs] for i in wanted])

    def request_finished(self, request, block_ids) -> bool:
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
            if layer_id == self.spec.num_layers - 1:
                self.stats.loaded_blocks += len(load.block_ids)

    def _read_checked(self, key, layer_id, tokens):
        k, v, stored_tokens = self.read(key, layer_id)
        want = (self.spec.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise LoadError(f"block {key} holds K/V {list(k.shape)}, the cache wants {list(want)}")
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
        saves = self._meta.saves
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
