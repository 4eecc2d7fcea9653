"""The paged KV cache: per-layer K and V tensors addressed through block tables.

Every layer owns one K and one V tensor of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``. A token at logical position ``p``
of a request lives in ``slot = block_table[p // block_size] * block_size + p % block_size``,
i.e. at ``[slot // block_size, slot % block_size]``. Which blocks a request owns is the
block pool's business (``fleetlab.BlockPool``); this module only holds the tensors,
writes a step's K/V into its slots, and does the memory arithmetic.
"""

from __future__ import annotations

import logging
import operator

import numpy as np
import paddle

from fleetlab.device import upload
from fleetlab.kv.copies import CopyPlan, copy_slots

logger = logging.getLogger(__name__)

# Bytes per element of the cache dtypes we support.
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def normalize_dtype(dtype) -> str:
    """``"float32"`` / ``paddle.float32`` / ``"paddle.float32"`` -> ``"float32"``; others raise."""
    name = "float32" if dtype is None else str(dtype).removeprefix("paddle.")
    if name not in _ITEMSIZE:
        raise TypeError(f"KV cache dtype must be one of {sorted(_ITEMSIZE)}; got {dtype!r}")
    return name


def gather_rows(x: paddle.Tensor, index: paddle.Tensor) -> paddle.Tensor:
    """``paddle.gather(x, index)`` along axis 0 for every cache dtype.

    Paddle's CPU gather has no float16 kernel, so float16 rows move as their int16 bits.
    """
    if x.dtype == paddle.float16:
        return paddle.gather(x.view(paddle.int16), index).view(paddle.float16)
    return paddle.gather(x, index)


class PagedKVCache:
    """K/V tensors of every layer, shaped ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    Args:
      num_layers: number of attention layers (ids ``0 .. num_layers - 1``).
      num_blocks: physical blocks per layer.
      block_size: tokens per block.
      num_kv_heads, head_dim: the model's KV head count and head size.
      dtype: ``"float32"``, ``"bfloat16"``, ``"float16"`` or the matching paddle dtype.
      place: Paddle place of the tensors (default: Paddle's current device).

    The tensors are created zero-filled and are updated in place by :meth:`write`, so a
    tensor returned by :meth:`key_cache` earlier sees later writes.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype="float32", place=None):
        sizes = {"num_layers": num_layers, "num_blocks": num_blocks, "block_size": block_size,
                 "num_kv_heads": num_kv_heads, "head_dim": head_dim}
        for name, value in sizes.items():  # self.num_layers, self.num_blocks, ...
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"PagedKVCache: {name} must be a positive int; got {value!r}")
            setattr(self, name, value)
        self.dtype = normalize_dtype(dtype)
        shape = [num_blocks, block_size, num_kv_heads, head_dim]
        self._k = [paddle.zeros(shape, self.dtype, device=place) for _ in range(num_layers)]
        self._v = [paddle.zeros(shape, self.dtype, device=place) for _ in range(num_layers)]
        logger.debug("PagedKVCache: %d layers x %s %s, %.1f MiB", num_layers, shape, self.dtype,
                     self.bytes_allocated / 2**20)

    @classmethod
    def for_handle(cls, handle, num_blocks: int, block_size: int) -> PagedKVCache:
        """A cache sized for a patched model (``handle`` from ``patch_model``).

        Reads ``handle.num_layers``, ``num_kv_heads``, ``head_dim`` and ``dtype``
        (``None`` means float32).
        """
        return cls(handle.num_layers, num_blocks, block_size, handle.num_kv_heads,
                   handle.head_dim, dtype=handle.dtype)

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                        dtype="float32") -> int:
        """Bytes one block costs across all layers, K and V together."""
        itemsize = _ITEMSIZE[normalize_dtype(dtype)]
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    @staticmethod
    def num_blocks_for_budget(budget_bytes: int, num_layers: int, num_kv_heads: int,
                              head_dim: int, block_size: int, dtype="float32") -> int:
        """How many blocks fit in ``budget_bytes`` (all layers, K and V); raise if none does."""
        per_block = PagedKVCache.bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, dtype)
        num_blocks = int(budget_bytes) // per_block
        if num_blocks < 1:
            raise ValueError(
                f"KV cache budget of {budget_bytes} bytes fits no block: one block of {block_size} "
                f"tokens costs {per_block} bytes ({num_layers} layers x K+V x {num_kv_heads} heads "
                f"x {head_dim} dims x {normalize_dtype(dtype)})"
            )
        return num_blocks

    @property
    def bytes_allocated(self) -> int:
        """Bytes held by all K and V tensors."""
        return self.num_blocks * self.bytes_per_block(
            self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, self.dtype)

    def key_cache(self, layer_id: int) -> paddle.Tensor:
        """Layer ``layer_id``'s K cache ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
        return self._k[self._check_layer(layer_id)]

    def value_cache(self, layer_id: int) -> paddle.Tensor:
        """Layer ``layer_id``'s V cache ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
        return self._v[self._check_layer(layer_id)]

    def write(self, layer_id: int, key: paddle.Tensor, value: paddle.Tensor,
              slot_mapping: paddle.Tensor, slot_index: tuple | None = None) -> None:
        """Store a step's K/V in their slots, in place.

        Args:
          layer_id: 0-based layer.
          key, value: ``[T, num_kv_heads, head_dim]`` (cast to the cache dtype).
          slot_mapping: int ``[T]``; token ``t`` goes to slot ``slot_mapping[t]``; ``-1`` skips it.
            Slots must be distinct and ``< num_blocks * block_size`` (not checked: that would
            cost a device sync per layer).
          slot_index: ``(block, offset)``, int64 ``[T]`` each, the slots already split, none of
            them -1 (``AttentionMetadata.slot_index``, made on the host once per step): the
            write is then one scatter per tensor, with no device op to plan it.
        """
        layer_id = self._check_layer(layer_id)
        t, h, d = key.shape[0], self.num_kv_heads, self.head_dim
        shapes = {"key": (key, [t, h, d]), "value": (value, [t, h, d]), "slot_mapping": (slot_mapping, [t])}
        wrong = [name for name, (x, want) in shapes.items() if list(x.shape) != want]
        if wrong:  # the one check at this public entry (notebooks call it directly)
            raise ValueError(f"PagedKVCache.write: key {list(key.shape)}, value {list(value.shape)} and "
                             f"slot_mapping {list(slot_mapping.shape)} must be [T, {h}, {d}], [T, {h}, {d}] "
                             f"and [T] (wrong: {', '.join(wrong)})")
        if key.shape[0] == 0:
            return
        if slot_index is not None:
            for cache, new in ((self._k[layer_id], key), (self._v[layer_id], value)):
                paddle.index_put_(cache, slot_index, new.astype(self.dtype))
            return
        target, source = _skip_plan(slot_mapping.astype("int64"))
        block, offset = target // self.block_size, target % self.block_size
        for cache, new in ((self._k[layer_id], key), (self._v[layer_id], value)):
            # Row T of the stacked source is slot 0's current content (see _skip_plan).
            rows = paddle.concat([new.astype(self.dtype), cache[:1, 0]])
            paddle.index_put_(cache, (block, offset), gather_rows(rows, source))

    def copy_plan(self, copies) -> CopyPlan | None:
        """A step's :class:`~fleetlab.kv.copies.BlockCopy` s as device indices (None for none): slots
        ``[0, num_tokens)`` of each ``src_block`` to the same slots of its ``dst_block``, in order."""
        if not copies:
            return None
        src, dst = copy_slots(copies, self.block_size)
        bs = self.block_size
        return CopyPlan(upload(np.stack([src // bs, src % bs], axis=1)), upload(dst // bs), upload(dst % bs),
                        tuple(copies))

    def apply_copies(self, layer_id: int, plan: CopyPlan | None) -> None:
        """Apply ``plan`` to layer ``layer_id``'s K and V: one gather and one indexed write each
        (a copy reads its source as it is now: after the layer's write, in the engine's step)."""
        if plan is not None:
            for cache in (self._k[layer_id], self._v[layer_id]):
                paddle.index_put_(cache, (plan.block, plan.offset), _gather_slots(cache, plan.read))

    def copy_blocks(self, copies) -> None:
        """Apply ``copies`` to every layer at once (outside a step: tests, benchmarks, a notebook);
        with tensor parallelism each rank copies its own heads."""
        plan = self.copy_plan(copies)
        for layer_id in range(self.num_layers):
            self.apply_copies(layer_id, plan)

    def _check_layer(self, layer_id) -> int:
        if not (hasattr(layer_id, "__index__") and 0 <= operator.index(layer_id) < self.num_layers):
            raise ValueError(f"layer_id {layer_id!r} out of range: the cache has {self.num_layers} layers")
        return operator.index(layer_id)


def _gather_slots(cache: paddle.Tensor, index: paddle.Tensor) -> paddle.Tensor:
    """``cache[index[:, 0], index[:, 1]]`` (``[n, heads, head_dim]``) for every cache dtype (Paddle's
    CPU ``gather_nd`` has no float16 kernel: those rows move as their int16 bits)."""
    if cache.dtype == paddle.float16:
        return paddle.gather_nd(cache.view(paddle.int16), index).view(paddle.float16)
    return paddle.gather_nd(cache, index)


def _skip_plan(slots: paddle.Tensor):
    """Where each token writes and what, honouring ``slot == -1`` without a device sync.

    Dropping the skipped tokens would need their count on the host (a sync per layer on a
    GPU). Instead each one rewrites a value that is written anyway: the K/V of the token
    with the largest slot, to that slot (identical duplicates, so any write order is right),
    or, when every slot is -1, row ``T`` of the source (slot 0's current content) to slot 0.
    Returns ``(target [T], source [T])``: token ``t`` writes source row ``source[t]`` to
    slot ``target[t]``.
    """
    num_tokens = slots.shape[0]
    last = paddle.argmax(slots, keepdim=True)  # the token with the largest slot
    last_slot = paddle.gather(slots, last)
    keep = slots >= 0
    target = paddle.where(keep, slots, last_slot.clip(min=0))
    fallback = paddle.where(last_slot >= 0, last, paddle.full_like(last, num_tokens))
    source = paddle.where(keep, paddle.arange(num_tokens, dtype="int64"), fallback)
    return target, source
