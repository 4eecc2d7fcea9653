"""The per-step attention metadata that the runner builds and attention reads.

One engine step runs every scheduled token of every running request as one packed
sequence ``[1, T]``. Row ``i`` of the batch owns tokens
``[cu_seqlens_q[i], cu_seqlens_q[i + 1])`` of that sequence. After a decode-first
reorder, rows ``[0, num_decodes)`` are decodes and their tokens come first.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import paddle

from fleetlab.device import upload, upload_packed


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs to read and write the paged KV cache for one step.

    Device tensors (on the model's device):
      positions:     int64 ``[T]``  logical position of each packed token in its request.
      slot_mapping:  int64 ``[T]``  cache slot each token's K/V is written to (-1: don't write).
      cu_seqlens_q:  int32 ``[B + 1]`` prefix sums of the rows' query lengths.
      seq_lens_kv:   int32 ``[B]``  context length of each row after this step's writes
                     (``num_computed_tokens + num_scheduled_tokens``).
      block_tables:  int32 ``[B, max_blocks_per_seq]`` physical block ids, unused entries -1.
    Host copies (numpy) of ``cu_seqlens_q``, ``seq_lens_kv``, ``positions`` (with
    ``token_rows_host``, the batch row of each packed token) and ``block_tables`` let backends
    and the runner plan their work without a device-to-host sync.
    ``slot_index``: ``(block, offset)`` int64 device ``[T]`` each, ``slot_mapping`` split on the
    host (:meth:`build` makes it; every slot there is >= 0), so the cache writes each layer's
    K/V with no device op of its own; None: the cache splits ``slot_mapping`` itself, honouring -1.
    A backend that needs more (a plan of its kernels' work) builds it once per step in
    ``AttentionBackend.build_metadata``, as a subclass of this class (:meth:`extend`), and every
    layer of the step reads that.
    ``batch``: the engine's ``InputBatch`` when built :meth:`from_batch` (row ``i`` of the
    metadata is its row ``i``), so a backend can read any per-request field (its own
    prototype fields too); None otherwise.
    ``kv_copies``: the step's copies of partial prefix-cache hits (a :class:`~fleetlab.kv.copies.CopyPlan`,
    or None), applied by each layer right after it writes the step's K/V
    (:meth:`fleetlab.PagedKVCache.apply_copies`), so a block the same step fills can be copied from.
    """

    positions: paddle.Tensor
    slot_mapping: paddle.Tensor
    cu_seqlens_q: paddle.Tensor
    seq_lens_kv: paddle.Tensor
    block_tables: paddle.Tensor
    block_size: int
    num_decodes: int
    num_decode_tokens: int
    max_query_len: int
    max_seq_len: int
    cu_seqlens_q_host: np.ndarray
    seq_lens_kv_host: np.ndarray
    batch: object = None
    positions_host: np.ndarray | None = None
    token_rows_host: np.ndarray | None = None
    block_tables_host: np.ndarray | None = None
    slot_index: tuple | None = None
    kv_copies: object = None  # the step's partial prefix hits (a kv.copies.CopyPlan), copied after each layer's write

    def extend(self, cls, **extra):
        """This metadata as an instance of ``cls`` (a dataclass subclass of this class), with
        the subclass's own fields set from ``extra``: how a backend adds its per-step plan.

        A backend's ``build_metadata(metadata)`` runs once per step, before the forward; what it
        returns is what every layer's ``attend`` receives. To carry a plan of its own (tile
        boundaries, a split of the decode rows...), declare the fields in a subclass and fill
        them there; every common field is copied over (``fleetlab.TiledMetadata`` adds ``plans``):

        >>> @dataclass(slots=True)
        ... class SplitMetadata(AttentionMetadata):
        ...     split: int = 0  # the first prefill row
        >>> class SplitBackend(TiledBackend):
        ...     def build_metadata(self, metadata):
        ...         return metadata.extend(SplitMetadata, split=metadata.num_decodes)
        """
        return cls(**{f.name: getattr(self, f.name) for f in fields(AttentionMetadata)}, **extra)

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens_q_host[-1])

    @property
    def query_lens_host(self) -> np.ndarray:
        """``[num_reqs]`` query tokens of each row this step (what a backend's plan splits on)."""
        return np.diff(self.cu_seqlens_q_host)

    @classmethod
    def from_batch(cls, batch, block_size: int, decode_threshold: int = 1) -> AttentionMetadata:
        """The metadata of a step over the rows ``[0, num_reqs)`` of an ``InputBatch`` that is
        condensed, scheduled (``set_num_scheduled``) and synced (``sync_to_device``): query
        lengths from ``num_scheduled_tokens``, contexts from ``num_computed_tokens``, block
        tables from the device mirror of ``block_table``."""
        n = batch.num_reqs
        width = max(1, int(batch.num_blocks[:n].max(initial=0)))
        return cls.build(batch.num_scheduled_tokens[:n], batch.num_computed_tokens[:n], batch.block_table[:n, :width],
                         block_size, decode_threshold, block_tables_device=batch.dev("block_table")[:, :width],
                         batch=batch)

    @classmethod
    def build(cls, query_lens, num_computed_tokens, block_tables, block_size: int, decode_threshold: int = 1,
              block_tables_device=None, batch=None) -> AttentionMetadata:
        """Build the metadata from host arrays.

        Args:
          query_lens: ``[B]`` tokens each row schedules this step (>= 1).
          num_computed_tokens: ``[B]`` tokens of each row already in the cache.
          block_tables: ``[B, max_blocks_per_seq]`` int block ids, -1 where unused, or one
            list of block ids per row (ragged: padded with -1 here). Every position
            ``< num_computed + query_len`` must have its block allocated.
          block_size: tokens per block.
          decode_threshold: a row with at most this many query tokens is a decode;
            ``num_decodes`` counts the leading run of such rows.
          block_tables_device: the same block tables already on the device (the InputBatch's
            mirror); uploaded from ``block_tables`` when None.
          batch: the ``InputBatch`` whose rows these are (:meth:`from_batch` passes it), or None.
        Device tensors go to Paddle's current device (the step's arrays in one copy per dtype).
        """
        query_lens = np.asarray(query_lens, dtype=np.int64)
        num_computed = np.asarray(num_computed_tokens, dtype=np.int64)
        tables = _padded(block_tables)
        _check_build_args(query_lens, num_computed, tables)
        cu = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=cu[1:])
        row_of_token = np.repeat(np.arange(len(query_lens)), query_lens)
        positions = num_computed[row_of_token] + (np.arange(cu[-1]) - cu[:-1][row_of_token])
        slot_mapping = _slots(tables, row_of_token, positions, int(block_size))
        seq_lens = (num_computed + query_lens).astype(np.int32)
        is_decode = is_decode_row(query_lens, decode_threshold)  # the leading run of decodes (all, once reordered)
        num_decodes = int(np.argmin(is_decode)) if not is_decode.all() else len(is_decode)
        positions_d, slot_mapping_d, slot_block, slot_offset, cu_d, seq_lens_d = upload_packed(
            positions, slot_mapping, slot_mapping // block_size, slot_mapping % block_size, cu, seq_lens)
        return cls(positions_d, slot_mapping_d, cu_d, seq_lens_d,
                   block_tables=upload(tables) if block_tables_device is None else block_tables_device,
                   block_size=int(block_size), num_decodes=num_decodes, num_decode_tokens=int(cu[num_decodes]),
                   max_query_len=int(query_lens.max(initial=0)), max_seq_len=int(seq_lens.max(initial=0)),
                   cu_seqlens_q_host=cu, seq_lens_kv_host=seq_lens, positions_host=positions,
                   token_rows_host=row_of_token, batch=batch, block_tables_host=tables.copy(),
                   slot_index=(slot_block, slot_offset))


def is_decode_row(query_lens, decode_threshold: int = 1) -> np.ndarray:
    """The one definition of a decode row: it runs ``1..decode_threshold`` query tokens this step
    (one, or ``k + 1`` when verifying ``k`` drafts); more is a prefill (chunk)."""
    return (query_lens >= 1) & (query_lens <= decode_threshold)


def _slots(tables: np.ndarray, row_of_token: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """The cache slot of each token: its row's block holding its position, and the offset in it.
    The one check of ``build``'s inputs (learners call it directly; the engine's steps always fit)."""
    block_idx = positions // max(block_size, 1)
    if block_size < 1 or (block_idx >= tables.shape[1]).any():
        raise ValueError(f"block_size={block_size} must be >= 1 and every scheduled position must fall in its "
                         f"row's block table ({tables.shape[1]} blocks of {block_size} tokens): a position "
                         "falls beyond its row's block table")
    blocks = tables[row_of_token, block_idx] if len(positions) else np.zeros(0, np.int32)
    if (blocks < 0).any():
        row = int(row_of_token[np.argmax(blocks < 0)])
        raise ValueError(f"block_tables: row {row} has no block allocated for a scheduled position (its block "
                         "table holds -1 there)")
    return blocks.astype(np.int64) * block_size + positions % block_size


def _check_build_args(query_lens: np.ndarray, num_computed: np.ndarray, tables: np.ndarray) -> None:
    """``build``'s shapes (learners call it directly): ValueError naming the argument."""
    if query_lens.ndim != 1 or query_lens.shape != num_computed.shape:
        raise ValueError(f"query_lens {list(query_lens.shape)} and num_computed_tokens {list(num_computed.shape)} "
                         "must be 1-D, one entry per row")
    if tables.ndim != 2 or tables.shape[0] != query_lens.shape[0]:
        raise ValueError(f"block_tables {list(tables.shape)} must be [rows, blocks] with one row per query_len "
                         f"({query_lens.shape[0]})")
    if (query_lens < 1).any():
        raise ValueError(f"query_lens: every row schedules at least one token; got {query_lens.tolist()}")


def _padded(block_tables) -> np.ndarray:
    """Block tables as an int32 ``[B, width]`` array, ragged rows padded with -1."""
    if isinstance(block_tables, np.ndarray):
        return block_tables.astype(np.int32, copy=False)
    rows = [list(row) for row in block_tables]
    tables = np.full((len(rows), max(map(len, rows), default=0)), -1, dtype=np.int32)
    for i, row in enumerate(rows):
        tables[i, : len(row)] = row
    return tables
