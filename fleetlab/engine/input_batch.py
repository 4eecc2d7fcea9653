"""The persistent batch: per-request state of every running request, one row each.

The runner keeps an :class:`InputBatch` across steps instead of rebuilding its arrays:
a request joins with :meth:`InputBatch.add_request`, gains tokens and blocks as it runs,
and leaves with :meth:`InputBatch.remove_request`. Each step the runner then

1. ``condense()``s the rows (removals leave holes) so rows ``[0, num_reqs)`` are live;
2. if the attention backend ``requires_reorder``, calls
   ``reorder_split_prefill_and_decode()`` so decode rows come first;
3. calls ``sync_to_device()`` once, and builds the step's inputs from the rows.

Every buffer is declared once in a :class:`~fleetlab.engine.batch_fields.FieldRegistry`;
row moves (``move_rows``, under ``condense`` and ``reorder``) loop over the registry, so no
field can be forgotten. Access: ``batch.token_ids`` (a typed accessor for each default field) or
``batch.np("token_ids")`` (any field, extra ones too) is the numpy view of rows
``[0, num_rows)`` (writable, the source of truth); ``batch.buffer(name)`` is the whole
``[max_num_seqs, ...]`` buffer; ``batch.dev(name)`` is the Paddle mirror of a device field
as of the last ``sync_to_device()``. Row order is internal: results leave keyed by request
id. Drawing and checking a batch (``batch_snapshot``, ``check_batch``) and moving its rows by
hand (``swap_rows``, ``permute_rows``) live beside it, in :mod:`fleetlab.inspect.batch` and
:mod:`fleetlab.lab.lessons.row_moves`.

A speculative proposer's state (its ``ProposerInputBatch``) is a group of fields in this
registry, so it moves with the rows like every other field.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Mapping
from types import MappingProxyType

import numpy as np
import paddle

from fleetlab import device
from fleetlab.attention.metadata import is_decode_row
from fleetlab.engine.batch_fields import DEFAULT_FIELDS, FieldRegistry, FieldView
from fleetlab.errors import refuse

logger = logging.getLogger(__name__)

# The batch field each setting of a request's sampling object fills (SamplingParams' names).
SAMPLING_SETTINGS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "max_tokens": "max_tokens",
                     "min_tokens": "min_tokens", "ignore_eos": "ignore_eos", "num_logprobs": "logprobs",
                     "num_prompt_logprobs": "prompt_logprobs"}


def two_pointer_swaps(is_decode: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The swaps of the two-pointer decode-first partition, as ``(lefts, rights)``.

    The classic scan moves a left pointer to the next prefill row and a right pointer to
    the previous decode row and swaps them while ``left < right``. The i-th swap thus pairs
    the i-th prefill row inside ``[0, num_decodes)`` with the i-th decode row (from the
    right) inside ``[num_decodes, n)``; this computes those pairs without a Python loop.
    It makes the fewest swaps (each misplaced prefill row must move once), but it is not
    stable: the order within each group changes.
    """
    is_decode = np.asarray(is_decode, dtype=bool)
    num_decodes = int(is_decode.sum())
    lefts = np.flatnonzero(~is_decode[:num_decodes])
    rights = np.flatnonzero(is_decode[num_decodes:])[::-1] + num_decodes
    return lefts, rights


class InputBatch:
    """Persistent per-request batch state with room for ``max_num_seqs`` rows.

    Args:
      max_num_seqs: rows (requests running at once).
      max_model_len: capacity of a row's ``token_ids`` (prompt + output).
      max_blocks_per_seq: capacity of a row's ``block_table``.
      max_stop_ids: capacity of a row's ``stop_token_ids``.
      fields: the field registry (default ``DEFAULT_FIELDS``); a copy with extra fields
        works unchanged, extra fields are carried by every row move.
      place: Paddle place of the device mirrors (default: Paddle's current device).

    Rows ``[0, num_rows)`` are in use; removed rows leave holes (``req_id`` None) until
    ``condense()``. Numpy buffers are the source of truth: row moves act on numpy only,
    because moving rows of device tensors would launch one kernel per buffer per swap;
    ``sync_to_device()`` copies rows ``[0, num_reqs)`` of each device field once per step.
    """

    # One typed accessor per default field: ``batch.token_ids`` is ``batch.np("token_ids")`` (the field's doc).
    req_id = FieldView()
    token_ids = FieldView()
    num_tokens = FieldView()
    num_prompt_tokens = FieldView()
    num_computed_tokens = FieldView()
    num_scheduled_tokens = FieldView()
    num_spec_tokens = FieldView()
    num_placeholders = FieldView()
    block_table = FieldView()
    num_blocks = FieldView()
    temperature = FieldView()
    top_k = FieldView()
    top_p = FieldView()
    seed = FieldView()
    max_tokens = FieldView()
    min_tokens = FieldView()
    ignore_eos = FieldView()
    stop_token_ids = FieldView()
    eos_token_id = FieldView()
    num_logprobs = FieldView()
    num_prompt_logprobs = FieldView()
    prompt_embeds = FieldView()


    def __init__(self, max_num_seqs: int, max_model_len: int, max_blocks_per_seq: int, *, max_stop_ids: int = 8,
                 fields: FieldRegistry | None = None, place=None) -> None:
        self.fields = (fields if fields is not None else DEFAULT_FIELDS).copy(frozen=True)  # the batch's own copy
        self.sizes = {"max_model_len": max_model_len, "max_blocks_per_seq": max_blocks_per_seq,
                      "max_stop_ids": max_stop_ids}
        _check_layout(max_num_seqs, self.sizes, self.fields)
        self.max_num_seqs = int(max_num_seqs)
        self._np: dict[str, np.ndarray] = {}
        self._dev: dict[str, paddle.Tensor] = {}
        self._mirrored: dict[str, np.ndarray] = {}  # what each device mirror holds (a host copy)
        for field in self.fields:
            shape = (self.max_num_seqs, *field.resolve_shape(self.sizes))
            self._np[field.name] = np.full(shape, field.fill, dtype=field.dtype)
            if field.home == "device":
                self._dev[field.name] = paddle.to_tensor(self._np[field.name], place=place)
                self._mirrored[field.name] = self._np[field.name].copy()
        self._req_id_to_row: dict[object, int] = {}
        self._num_rows = 0
        self._synced_rows: int | None = None  # rows mirrored by the last sync; None = stale

    def __repr__(self) -> str:
        """One line for the batch, one per row in use: its request, prompt, tokens, computed and
        scheduled tokens, blocks (``print(batch)`` in a notebook)."""
        holes = self._holes()
        head = (f"InputBatch({self.num_reqs} requests in rows [0, {self._num_rows}) of {self.max_num_seqs}"
                f"{f', holes at rows {holes}' if holes else ''}; {len(self.fields)} fields)")
        lines = [head]
        for row, rid in enumerate(self.req_ids):
            if rid is None:
                lines.append(f"  row {row}: (hole)")
                continue
            n = {name: int(self._np[name][row]) for name in
                 ("num_prompt_tokens", "num_tokens", "num_computed_tokens", "num_scheduled_tokens", "num_blocks")}
            lines.append(f"  row {row}: {rid!r} prompt {n['num_prompt_tokens']}, tokens {n['num_tokens']}, computed "
                         f"{n['num_computed_tokens']}, scheduled {n['num_scheduled_tokens']}, "
                         f"blocks {self._np['block_table'][row][: n['num_blocks']].tolist()}")
        return "\n".join(lines)

    # ------------------------------------------------------------------ access
    @property
    def num_reqs(self) -> int:
        """Live requests (rows ``[0, num_reqs)`` once condensed)."""
        return len(self._req_id_to_row)

    @property
    def num_rows(self) -> int:
        """One past the last row in use; ``> num_reqs`` while holes remain."""
        return self._num_rows

    @property
    def has_holes(self) -> bool:
        """Removed rows wait below ``num_rows``; ``condense()`` closes them."""
        return self._num_rows != len(self._req_id_to_row)

    @property
    def req_ids(self) -> list:
        """Request id of each row ``[0, num_rows)`` in row order (None for holes)."""
        return list(self._np["req_id"][: self._num_rows])

    @property
    def req_id_to_row(self) -> Mapping[object, int]:
        """Read-only map request id -> row, kept in step with the ``req_id`` field."""
        return MappingProxyType(self._req_id_to_row)

    def np(self, name: str) -> np.ndarray:
        """Writable numpy view of field ``name``, rows ``[0, num_rows)``."""
        return self._np[self.fields[name].name][: self._num_rows]

    def buffer(self, name: str) -> np.ndarray:
        """The whole numpy buffer ``[max_num_seqs, *per_row_shape]`` of field ``name``."""
        return self._np[self.fields[name].name]

    def dev(self, name: str) -> paddle.Tensor:
        """Paddle mirror of device field ``name``, rows ``[0, num_reqs)`` at the last sync."""
        if self.fields[name].home != "device":
            raise ValueError(f"field {name!r} lives on the host: use batch.np({name!r})")
        if self._synced_rows is None:
            raise RuntimeError(f"the device mirror of {name!r} is stale: call sync_to_device() first")
        return self._dev[name][: self._synced_rows]

    def _holes(self) -> list[int]:
        return [row for row, rid in enumerate(self.req_ids) if rid is None]

    def row_of(self, req_id) -> int:
        """The row holding ``req_id``; ValueError if the request is not in the batch."""
        if req_id not in self._req_id_to_row:
            raise ValueError(f"request {req_id!r}: it is not in the batch (field 'req_id')")
        return self._req_id_to_row[req_id]

    # ------------------------------------------------------------------ requests
    def add_request(self, req_id, prompt_token_ids: Iterable[int], output_token_ids: Iterable[int] = (),
                    num_computed_tokens: int = 0, block_ids: Iterable[int] = (), sampling=None, seed: int | None = None,
                    eos_token_id: int | None = None, extra: Mapping[str, object] | None = None) -> int:
        """Put a request into the lowest free row and return that row.

        ``sampling``: a :class:`~fleetlab.SamplingParams` as the edge resolved it (or any object
        with its attribute names, :data:`SAMPLING_SETTINGS`); a setting it lacks or leaves None
        keeps the field's fill. ``seed`` (default: ``sampling.seed``) is the request's own.
        ``extra`` sets fields of an extended registry by name.
        """
        prompt, output = list(prompt_token_ids), list(output_token_ids)
        blocks, stop = list(block_ids), list(getattr(sampling, "stop_token_ids", None) or ())
        self._check_new_request(req_id, prompt, output, num_computed_tokens, blocks, stop, extra or {})
        row = int(np.argmax(np.equal(self._np["req_id"], None)))  # the lowest free row (all past num_rows are)
        self._clear_rows(np.array([row]))
        values = {"req_id": req_id, "num_tokens": len(prompt) + len(output), "num_prompt_tokens": len(prompt),
                  "num_computed_tokens": num_computed_tokens, "num_blocks": len(blocks), "eos_token_id": eos_token_id,
                  "seed": getattr(sampling, "seed", None) if seed is None else seed,
                  **{name: getattr(sampling, attr, None) for name, attr in SAMPLING_SETTINGS.items()}, **(extra or {})}
        for name, value in values.items():
            if value is not None:
                self._np[name][row] = value
        for name, ids in (("token_ids", prompt + output), ("block_table", blocks), ("stop_token_ids", stop)):
            self._np[name][row, : len(ids)] = ids
        self._req_id_to_row[req_id] = row
        self._num_rows = max(self._num_rows, row + 1)
        self._synced_rows = None
        return row

    def _check_new_request(self, req_id, prompt, output, num_computed, blocks, stop, extra) -> None:
        """The batch's one check at its public entry (learners call ``add_request`` directly; the
        engine's requests passed the edge, ``fleetlab.edge``, already). It runs before the row is touched,
        so a rejected add leaves no trace."""
        sizes, num_tokens = self.sizes, len(prompt) + len(output)
        unknown = [name for name in extra if name not in self.fields or name == "req_id"]
        unfit = [name for name, value in extra.items() if name not in unknown and not _fits(self.fields[name], value)]
        refuse([  # (is it broken, what to say after "request <id>: ")
            (req_id is None, "req_id None is reserved for empty rows (field 'req_id')"),
            (req_id in self._req_id_to_row, "already in the batch (field 'req_id')"),
            (self.num_reqs >= self.max_num_seqs, f"batch is full (max_num_seqs={self.max_num_seqs})"),
            (len(prompt) == 0, "empty prompt (field 'token_ids')"),
            (num_tokens > sizes["max_model_len"], f"prompt ({len(prompt)}) + output ({len(output)}) tokens "
             f"exceed field 'token_ids' (max_model_len={sizes['max_model_len']})"),
            (not 0 <= num_computed <= num_tokens, f"num_computed_tokens={num_computed} out of range"),
            (len(blocks) > sizes["max_blocks_per_seq"], f"{len(blocks)} block ids exceed field 'block_table' "
             f"(max_blocks_per_seq={sizes['max_blocks_per_seq']})"),
            (len(stop) > sizes["max_stop_ids"], f"{len(stop)} stop ids exceed field 'stop_token_ids' "
             f"(max_stop_ids={sizes['max_stop_ids']})"),
            (bool(unknown), f"extra values for unknown fields {unknown}"),
            (bool(unfit), f"extra values for fields {unfit} do not fit their dtype and shape"),
        ], prefix=f"request {req_id!r}: ")

    def remove_request(self, req_id) -> int:
        """Empty the request's row and return it; the hole stays until ``condense()``. An unknown
        ``req_id`` raises ``ValueError``."""
        row = self.row_of(req_id)
        del self._req_id_to_row[req_id]
        self._clear_rows(np.array([row]))
        self._trim()
        self._synced_rows = None
        return row

    def update_requests(self, req_ids, new_token_ids, new_block_ids, num_computed_tokens, num_blocks) -> None:
        """Apply one step's diffs to requests the batch holds (one entry per request in each
        list, as ``CachedRequestData`` carries them): tokens and block ids appended, each block
        table first cut to ``num_blocks - len(new_block_ids)`` entries (blocks past rejected
        drafts were freed), ``num_computed_tokens`` set. The scheduler's diffs always fit: the
        batch was sized for its ``max_model_len``, and nothing here re-checks them."""
        if not len(req_ids):
            return
        rows = np.fromiter((self._req_id_to_row[r] for r in req_ids), np.int64, len(req_ids))
        keep = np.asarray(num_blocks, dtype=np.int64) - [len(b) for b in new_block_ids]
        table, width = self._np["block_table"], self.sizes["max_blocks_per_seq"]
        cut = keep < self._np["num_blocks"][rows]
        if cut.any():  # the tables of rows that lost blocks: -1 past what they keep
            table[rows[cut]] = np.where(np.arange(width) < keep[cut, None], table[rows[cut]], -1)
        self._np["num_blocks"][rows] = keep
        self.append(rows, new_token_ids, new_block_ids)
        self._np["num_computed_tokens"][rows] = num_computed_tokens

    def append(self, rows: np.ndarray, new_token_ids, new_block_ids=None) -> None:
        """Append output tokens (and block ids) to ``rows``; the rows' drafts are dropped (a row's
        tokens past ``num_tokens`` are scratch). The caller makes sure they fit."""
        self._append(rows, new_token_ids, "token_ids", "num_tokens")
        if new_block_ids is not None:
            self._append(rows, new_block_ids, "block_table", "num_blocks")
        self._np["num_spec_tokens"][rows] = 0
        self._synced_rows = None

    def _append(self, rows: np.ndarray, values, buffer: str, count: str) -> None:
        """Append ``values[i]`` to row ``rows[i]`` of ``buffer`` after its ``count`` entries
        (one fancy-indexed write for all rows)."""
        lens = np.fromiter(map(len, values), np.int64, len(values))
        if lens.any():
            starts = np.repeat(self._np[count][rows] - np.cumsum(lens) + lens, lens)
            flat = np.fromiter(itertools.chain.from_iterable(values), np.int64, int(lens.sum()))
            self._np[buffer][np.repeat(rows, lens), starts + np.arange(len(flat))] = flat
            self._np[count][rows] += lens

    def set_spec_tokens(self, req_id, draft_token_ids: Iterable[int]) -> None:
        """Write the drafts a row verifies this step after its known tokens (``token_ids``
        past ``num_tokens``; ``num_spec_tokens`` counts them; the scheduler made room for them)."""
        row, drafts = self._req_id_to_row[req_id], list(draft_token_ids)
        n = int(self._np["num_tokens"][row])
        self._np["token_ids"][row, n : n + len(drafts)] = drafts
        self._np["num_spec_tokens"][row] = len(drafts)

    def set_num_scheduled(self, num_scheduled: Mapping[object, int]) -> None:
        """Set this step's query length per request id (known tokens plus drafts); requests
        left out get 0."""
        rows = np.fromiter((self.row_of(r) for r in num_scheduled), np.int64, len(num_scheduled))
        n = np.fromiter(num_scheduled.values(), np.int64, len(num_scheduled))
        room = (self._np["num_tokens"][rows] + self._np["num_spec_tokens"][rows]
                - self._np["num_computed_tokens"][rows])
        bad = np.flatnonzero((n < 0) | (n > room))  # check everything before writing anything
        refuse([(len(bad), lambda: f"request {list(num_scheduled)[bad[0]]!r}: field 'num_scheduled_tokens'={n[bad[0]]} "
                 f"must be in [0, {room[bad[0]]}] (num_tokens + num_spec_tokens - num_computed_tokens)")])
        sched = self._np["num_scheduled_tokens"]
        sched[: self._num_rows] = 0
        sched[rows] = n

    # ------------------------------------------------------------------ row moves
    def move_rows(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Row ``dst[k]`` of every field takes the old contents of row ``src[k]``.

        The single place rows move: one fancy-indexed copy per field (the right-hand side
        is gathered before it is written, so swaps and cycles are safe), then the
        request id -> row map is refreshed from the moved ``req_id`` entries.
        """
        if len(dst) == 0:
            return
        for buf in self._np.values():
            buf[dst] = buf[src]
        req_ids = self._np["req_id"]
        for row in dst.tolist():
            if req_ids[row] is not None:
                self._req_id_to_row[req_ids[row]] = row
        if req_ids[self._num_rows - 1] is None:  # a hole moved to the end (a hand-made swap)
            self._trim()
        self._synced_rows = None

    def _clear_rows(self, rows: np.ndarray) -> None:
        """Reset ``rows`` of every field to the field's fill (the map is the caller's job)."""
        for field in self.fields:
            self._np[field.name][rows] = field.fill

    def _trim(self) -> None:
        """Drop trailing holes from ``num_rows``."""
        live = np.flatnonzero(np.not_equal(self._np["req_id"][: self._num_rows], None))
        self._num_rows = int(live[-1]) + 1 if len(live) else 0

    def condense(self) -> np.ndarray:
        """Move live rows to the front, keeping their relative order (stable compaction).

        Returns ``moved`` with ``moved[new_row] = old_row`` for the ``num_reqs`` live rows.
        """
        if not self.has_holes:  # O(1): the common step with no removals
            return np.arange(self._num_rows)
        live = np.flatnonzero(np.not_equal(self._np["req_id"][: self._num_rows], None))
        n, num_rows = len(live), self._num_rows
        self.move_rows(np.arange(n), live)
        self._clear_rows(np.arange(n, num_rows))
        self._num_rows = n
        return live

    def is_decode(self, decode_threshold: int = 1) -> np.ndarray:
        """Bool ``[num_rows]``: the row is a decode this step (holes: False), as
        :func:`~fleetlab.attention.metadata.is_decode_row` counts them. A row that schedules
        nothing this step is classed by where it stands: a decode once past its prompt.
        """
        sched = self.np("num_scheduled_tokens")
        past_prompt = self.np("num_computed_tokens") >= self.np("num_prompt_tokens")
        live = np.not_equal(self.np("req_id"), None) if self.has_holes else True
        return live & np.where(sched > 0, is_decode_row(sched, decode_threshold), past_prompt)

    def reorder_split_prefill_and_decode(self, decode_threshold: int = 1) -> tuple[np.ndarray, int]:
        """Move decode rows to ``[0, num_decodes)``; return ``(perm, num_decodes)``.

        ``perm[new_row] = old_row`` over rows ``[0, num_reqs)``. The two-pointer scan
        (:func:`two_pointer_swaps`): the fewest swaps, NOT stable within the decode or
        prefill group (``fleetlab.lab.lessons.reorder`` shows the stable partition and the
        no-move gather map beside it). The batch must be condensed first: a batch with holes
        is refused (RuntimeError naming them), with or without ``python -O``.
        """
        if self.has_holes:  # a check, not an assert: ``python -O`` would reorder around the holes
            raise RuntimeError(f"reorder_split_prefill_and_decode needs a dense batch: rows {self._holes()} are "
                               "holes (removed requests); call condense() first")
        mask = self.is_decode(decode_threshold)
        lefts, rights = two_pointer_swaps(mask)
        dst, src = np.concatenate([lefts, rights]), np.concatenate([rights, lefts])
        perm = np.arange(self._num_rows, dtype=np.int64)
        perm[dst] = src
        self.move_rows(dst, src)
        logger.debug("reorder: %d rows moved, %d decodes of %d", len(dst), int(mask.sum()), self._num_rows)
        return perm, int(mask.sum())

    # ------------------------------------------------------------------ device
    def sync_to_device(self) -> None:
        """Copy every device field to its Paddle mirror (rows ``[0, num_reqs)`` are then read).

        Called once per step after condense and reorder: at most one host-to-device copy per
        device field no matter how many rows moved, and none for a field whose buffer equals
        what its mirror holds (a decode step changes block tables, not sampling settings).
        :func:`~fleetlab.device.fill` writes the mirror in place, so its address stays fixed
        across steps (what a captured CUDA graph needs); it copies the whole
        ``[max_num_seqs, ...]`` buffer, rows past ``num_reqs`` included (they are never read).
        """
        if self.has_holes:
            raise RuntimeError(f"sync_to_device needs a dense batch: rows {self._holes()} are holes (removed "
                               "requests); call condense() first")
        for name, mirror in self._dev.items():
            if not np.array_equal(self._np[name], self._mirrored[name]):
                device.fill(mirror, self._np[name])  # in place: the mirror keeps its address
                self._mirrored[name][...] = self._np[name]
        self._synced_rows = self._num_rows



def _fits(field, value) -> bool:
    """Whether ``value`` can be written to one row of ``field`` (so that a write cannot fail halfway;
    what a value means is the edge's to check, :func:`fleetlab.engine.batch_fields.check_field_value`)."""
    try:
        return field.dtype == "object" or np.asarray(value, dtype=field.dtype).ndim == len(field.per_row_shape)
    except (TypeError, ValueError, OverflowError):
        return False


def _check_layout(max_num_seqs, sizes: Mapping[str, int], fields: FieldRegistry) -> None:
    """The batch's one check of how it is built (learners build batches in notebooks)."""
    small = {name: v for name, v in {"max_num_seqs": max_num_seqs, **sizes}.items()
             if not isinstance(v, (int, np.integer)) or v < (0 if name == "max_stop_ids" else 1)}
    missing = [name for name in DEFAULT_FIELDS.names() if name not in fields]
    clash = [f.name for f in fields if f.name not in DEFAULT_FIELDS and hasattr(InputBatch, f.name)]
    refuse([
        (small, f"sizes {small} must be ints >= 1 (max_stop_ids >= 0)"),
        (missing, f"field registry lacks fields the InputBatch needs: {missing}"),
        ("req_id" in fields and fields["req_id"].dtype != "object", "field 'req_id' must have dtype 'object'"),
        (clash, f"field names {clash} clash with InputBatch attributes (clashes)"),
    ])
