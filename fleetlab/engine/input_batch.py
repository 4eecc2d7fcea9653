"""The persistent batch: per-request state of every running request, one row each.

The runner keeps an :class:`InputBatch` across steps instead of rebuilding its arrays:
a request joins with :meth:`InputBatch.add_request`, gains tokens and blocks as it runs,
and leaves with :meth:`InputBatch.remove_request`. Each step the runner then

1. ``condense()``s the rows (removals leave holes) so rows ``[0, num_reqs)`` are live;
2. if the attention backend ``requires_reorder``, calls
   ``reorder_split_prefill_and_decode()`` so decode rows come first;
3. calls ``sync_to_device()`` once, and builds the step's inputs from the rows.

Every buffer is declared once in a :class:`~fleetlab.engine.batch_fields.FieldRegistry`;
row moves (``swap``, ``condense``, ``reorder``) loop over the registry, so no field can be
forgotten. Access: ``batch.token_ids`` (a typed accessor for each default field) or
``batch.np("token_ids")`` (any field, extra ones too) is the numpy view of rows
``[0, num_rows)`` (writable, the source of truth); ``batch.buffer(name)`` is the whole
``[max_num_seqs, ...]`` buffer; ``batch.dev(name)`` is the Paddle mirror of a device field
as of the last ``sync_to_device()``. Row order is internal: results go back to request
ids through ``by_request`` / ``unpermute``.

Followers (a speculative proposer's ``ProposerInputBatch``) attach with ``add_follower``:
every row move, clear and add of this batch is replayed on them, so their rows stay the
same requests as this batch's rows by construction (the lockstep invariant).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import paddle

from fleetlab import device
from fleetlab.engine.batch_fields import DEFAULT_FIELDS, FieldRegistry

logger = logging.getLogger(__name__)

_SAMPLING_ATTRS = ("temperature", "top_k", "top_p", "seed", "max_tokens", "min_tokens", "ignore_eos", "num_logprobs",
                   "num_prompt_logprobs")


@dataclass(slots=True)
class RowRecord:
    """One row of :meth:`InputBatch.snapshot`, for drawing the batch.

    ``phase`` is ``"decode"``, ``"prefill"`` or ``"empty"``; ``block_table`` lists the
    row's allocated block ids (no -1 padding).
    """

    row: int
    req_id: object
    phase: str
    num_prompt_tokens: int
    num_tokens: int
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_table: list[int]


def invert_permutation(perm) -> np.ndarray:
    """``inv`` with ``inv[perm[i]] = i``: for ``perm[new_row] = old_row``, ``inv[old_row] = new_row``."""
    perm = np.asarray(perm, dtype=np.int64)
    inv = np.empty_like(perm)
    inv[perm] = np.arange(len(perm), dtype=np.int64)
    return inv


def unpermute(values_new, perm) -> np.ndarray:
    """Put per-row ``values_new`` (new row order) back into the order before ``perm``.

    ``perm[new_row] = old_row`` as returned by ``reorder_split_prefill_and_decode``.
    """
    return np.asarray(values_new)[invert_permutation(perm)]


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


class FieldView:
    """Typed accessor of one default field: ``batch.token_ids`` is ``batch.np("token_ids")``.

    Declared on the class (not resolved by ``__getattr__``) so fields show in IDEs."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, batch, owner=None) -> np.ndarray:
        if batch is None:
            return self
        return batch.np(self.name)


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
      seed: seeds the draw of a per-request seed for requests that give none.

    Rows ``[0, num_rows)`` are in use; removed rows leave holes (``req_id`` None) until
    ``condense()``. Numpy buffers are the source of truth: row moves act on numpy only,
    because moving rows of device tensors would launch one kernel per buffer per swap;
    ``sync_to_device()`` copies rows ``[0, num_reqs)`` of each device field once per step.
    """

    token_ids = FieldView()
    num_tokens = FieldView()
    num_prompt_tokens = FieldView()
    num_computed_tokens = FieldView()
    num_scheduled_tokens = FieldView()
    num_spec_tokens = FieldView()
    block_table = FieldView()
    num_blocks = FieldView()
    temperature = FieldView()
    top_k = FieldView()
    top_p = FieldView()
    seed = FieldView()
    num_output_tokens = FieldView()
    max_tokens = FieldView()
    min_tokens = FieldView()
    ignore_eos = FieldView()
    stop_token_ids = FieldView()
    eos_token_id = FieldView()
    num_logprobs = FieldView()
    num_prompt_logprobs = FieldView()
    prompt_embeds = FieldView()

    def __init__(
        self,
        max_num_seqs: int,
        max_model_len: int,
        max_blocks_per_seq: int,
        *,
        max_stop_ids: int = 8,
        fields: FieldRegistry | None = None,
        place=None,
        seed: int = 0,
    ) -> None:
        self.max_num_seqs = _positive("max_num_seqs", max_num_seqs)
        self.sizes = {
            "max_model_len": _positive("max_model_len", max_model_len),
            "max_blocks_per_seq": _positive("max_blocks_per_seq", max_blocks_per_seq),
            "max_stop_ids": _positive("max_stop_ids", max_stop_ids, minimum=0),
        }
        self._fields = (fields if fields is not None else DEFAULT_FIELDS).copy(frozen=True)
        self._check_registry()
        self._place = place
        self._rng = np.random.default_rng(seed)
        self._np: dict[str, np.ndarray] = {}
        self._dev: dict[str, paddle.Tensor] = {}
        self._mirrored: dict[str, np.ndarray] = {}  # what each device mirror holds (a host copy)
        for field in self._fields:
            shape = (self.max_num_seqs, *field.resolve_shape(self.sizes))
            self._np[field.name] = np.full(shape, field.fill, dtype=field.dtype)
            if field.home == "device":
                self._dev[field.name] = paddle.to_tensor(self._np[field.name], place=place)
                self._mirrored[field.name] = self._np[field.name].copy()
        self._req_id_to_row: dict[object, int] = {}
        self._num_rows = 0
        self._synced_rows: int | None = None  # rows mirrored by the last sync; None = stale
        self._followers: list = []

    def _check_registry(self) -> None:
        missing = [name for name in DEFAULT_FIELDS.names() if name not in self._fields]
        if missing:
            raise ValueError(f"field registry lacks fields the InputBatch needs: {missing}")
        if self._fields["req_id"].dtype != "object":
            raise ValueError("field 'req_id' must have dtype 'object'")
        for field in self._fields:
            attr = getattr(type(self), field.name, None)
            if attr is not None and not isinstance(attr, FieldView):
                raise ValueError(f"field name {field.name!r} clashes with an InputBatch attribute")

    # ------------------------------------------------------------------ access
    @property
    def fields(self) -> FieldRegistry:
        """The batch's own copy of its field registry."""
        return self._fields

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
        return self._np[self._fields[name].name][: self._num_rows]

    def buffer(self, name: str) -> np.ndarray:
        """The whole numpy buffer ``[max_num_seqs, *per_row_shape]`` of field ``name``."""
        return self._np[self._fields[name].name]

    def dev(self, name: str) -> paddle.Tensor:
        """Paddle mirror of device field ``name``, rows ``[0, num_reqs)`` at the last sync."""
        if self._fields[name].home != "device":
            raise ValueError(f"field {name!r} lives on the host; use batch.np({name!r})")
        if self._synced_rows is None:
            raise RuntimeError(f"device mirror of {name!r} is stale: call sync_to_device() first")
        return self._dev[name][: self._synced_rows]

    def add_follower(self, follower) -> None:
        """Replay every row move, clear and add of this batch on ``follower`` (anything with
        ``move_rows(dst, src)``, ``clear_rows(rows)`` and ``on_add(batch, row, req_id)``)."""
        if self._num_rows:
            raise RuntimeError("attach followers to an empty batch, so that they start in step")
        self._followers.append(follower)

    def row_of(self, req_id) -> int:
        """The row holding ``req_id``; ValueError if the request is not in the batch."""
        if req_id not in self._req_id_to_row:
            raise ValueError(f"unknown request {req_id!r}: it is not in the batch (field 'req_id')")
        return self._req_id_to_row[req_id]

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        req_id,
        prompt_token_ids: Iterable[int],
        output_token_ids: Iterable[int] = (),
        num_computed_tokens: int = 0,
        block_ids: Iterable[int] = (),
        sampling=None,
        eos_token_id: int | None = None,
        extra: Mapping[str, object] | None = None,
    ) -> int:
        """Put a request into the lowest free row and return that row.

        ``sampling`` is any object with ``temperature, top_k, top_p, seed, max_tokens,
        min_tokens, ignore_eos, stop_token_ids`` (missing or None: the field's fill; seed
        None: drawn from the batch's generator; max_tokens None: up to ``max_model_len``).
        ``extra`` sets fields of an extended registry by name.
        """
        prompt = np.asarray(list(prompt_token_ids), dtype=np.int64)
        output = np.asarray(list(output_token_ids), dtype=np.int64)
        blocks = np.asarray(list(block_ids), dtype=np.int64)
        stop = list(getattr(sampling, "stop_token_ids", None) or ())
        extra = self._check_new_request(req_id, prompt, output, num_computed_tokens, blocks, stop, extra or {})
        row = self._free_row()
        self._clear_rows(np.array([row]))
        num_tokens = len(prompt) + len(output)
        set_ = self._set_row
        set_(row, "req_id", req_id)
        self._np["token_ids"][row, :num_tokens] = np.concatenate([prompt, output])
        set_(row, "num_tokens", num_tokens)
        set_(row, "num_prompt_tokens", len(prompt))
        set_(row, "num_computed_tokens", num_computed_tokens)
        set_(row, "num_output_tokens", len(output))
        self._np["block_table"][row, : len(blocks)] = blocks
        set_(row, "num_blocks", len(blocks))
        set_(row, "eos_token_id", -1 if eos_token_id is None else eos_token_id)
        self._np["stop_token_ids"][row, : len(stop)] = stop
        self._set_sampling(row, sampling, len(prompt))
        for name, value in extra.items():
            set_(row, name, value)
        self._req_id_to_row[req_id] = row
        self._num_rows = max(self._num_rows, row + 1)
        for follower in self._followers:
            follower.on_add(self, row, req_id)
        self._synced_rows = None
        return row

    def _check_new_request(self, req_id, prompt, output, num_computed, blocks, stop, extra) -> dict:
        """The batch's one check at its public entry (learners call ``add_request`` directly; the
        engine's requests passed ``fleetlab.validation`` already). It runs before the row is touched,
        so a rejected add leaves no trace; returns the ``extra`` values as their fields hold them."""
        sizes, num_tokens = self.sizes, len(prompt) + len(output)
        unknown = [name for name in extra if name not in self._fields or name == "req_id"]
        broken = [  # (is it broken, what to say after "request <id>: ")
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
        ]
        for is_broken, what in broken:
            if is_broken:
                raise ValueError(f"request {req_id!r}: {what}")
        return {name: self._fields[name].check_value(f"request {req_id!r}: extra field", value)
                for name, value in extra.items()}

    def _set_sampling(self, row: int, sampling, num_prompt: int) -> None:
        values = {name: getattr(sampling, name, None) for name in _SAMPLING_ATTRS}
        if values["seed"] is None:
            values["seed"] = int(self._rng.integers(0, 2**31 - 1))
        if values["max_tokens"] is None:
            values["max_tokens"] = self.sizes["max_model_len"] - num_prompt
        if values["top_k"] is not None and values["top_k"] < 0:
            values["top_k"] = 0  # "all tokens" is spelled 0 in the batch
        for name, value in values.items():
            if value is not None:
                self._set_row(row, name, value)

    def _set_row(self, row: int, name: str, value) -> None:
        self._np[name][row] = value

    def _free_row(self) -> int:
        holes = np.flatnonzero(np.equal(self._np["req_id"][: self._num_rows], None))
        return int(holes[0]) if len(holes) else self._num_rows

    def remove_request(self, req_id, *, missing_ok: bool = False) -> int | None:
        """Empty the request's row and return it; the hole stays until ``condense()``.

        An unknown ``req_id`` raises ``ValueError``, or returns None with ``missing_ok``.
        """
        if req_id not in self._req_id_to_row:
            if missing_ok:
                return None
            raise ValueError(f"cannot remove request {req_id!r}: not in the batch (field 'req_id')")
        row = self._req_id_to_row.pop(req_id)
        self._clear_rows(np.array([row]))
        self._trim()
        self._synced_rows = None
        return row

    def append_token(self, row: int, token: int) -> None:
        """Append one output token to the row's ``token_ids``."""
        self.append_tokens(row, [token])

    def append_tokens(self, row: int, tokens: Iterable[int]) -> None:
        """Append output tokens to the row's ``token_ids`` (drafts written after the old end
        are overwritten: a row's tokens past ``num_tokens`` are scratch)."""
        req_id, tokens = self._live_req(row), list(tokens)
        if int(self._np["num_tokens"][row]) + len(tokens) > self.sizes["max_model_len"]:
            raise ValueError(
                f"request {req_id!r}: field 'token_ids' is full (max_model_len={self.sizes['max_model_len']})"
            )
        self._np["num_output_tokens"][row] += self._append(np.array([row]), [tokens], "token_ids", "num_tokens")[0]
        self._np["num_spec_tokens"][row] = 0
        self._synced_rows = None

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
        self._np["num_output_tokens"][rows] += self._append(rows, new_token_ids, "token_ids", "num_tokens")
        self._append(rows, new_block_ids, "block_table", "num_blocks")
        self._np["num_computed_tokens"][rows] = num_computed_tokens
        self._np["num_spec_tokens"][rows] = 0
        self._synced_rows = None

    def _append(self, rows: np.ndarray, values, buffer: str, count: str) -> np.ndarray:
        """Append ``values[i]`` to row ``rows[i]`` of ``buffer`` after its ``count`` entries
        (one fancy-indexed write for all rows); returns how many each row got."""
        lens = np.fromiter(map(len, values), np.int64, len(values))
        if lens.any():
            starts = np.repeat(self._np[count][rows] - np.cumsum(lens) + lens, lens)
            flat = np.fromiter(itertools.chain.from_iterable(values), np.int64, int(lens.sum()))
            self._np[buffer][np.repeat(rows, lens), starts + np.arange(len(flat))] = flat
            self._np[count][rows] += lens
        return lens

    def set_spec_tokens(self, req_id, draft_token_ids: Iterable[int]) -> None:
        """Write the drafts a row verifies this step after its known tokens (``token_ids``
        past ``num_tokens``; ``num_spec_tokens`` counts them)."""
        row = self.row_of(req_id)
        drafts = np.asarray(list(draft_token_ids), dtype=np.int64)
        n = int(self._np["num_tokens"][row])
        if n + len(drafts) > self.sizes["max_model_len"]:
            raise ValueError(f"request {req_id!r}: {len(drafts)} draft tokens after {n} tokens exceed field "
                             f"'token_ids' (max_model_len={self.sizes['max_model_len']})")
        self._np["token_ids"][row, n : n + len(drafts)] = drafts
        self._np["num_spec_tokens"][row] = len(drafts)

    def append_block_ids(self, row: int, block_ids: Iterable[int]) -> None:
        """Append newly allocated block ids to the row's ``block_table``."""
        req_id, ids = self._live_req(row), list(block_ids)
        start = int(self._np["num_blocks"][row])
        if start + len(ids) > self.sizes["max_blocks_per_seq"]:
            raise ValueError(
                f"request {req_id!r}: {start} + {len(ids)} block ids exceed field 'block_table' "
                f"(max_blocks_per_seq={self.sizes['max_blocks_per_seq']})"
            )
        self._append(np.array([row]), [ids], "block_table", "num_blocks")
        self._synced_rows = None

    def set_num_scheduled(self, num_scheduled: Mapping[object, int]) -> None:
        """Set this step's query length per request id (known tokens plus drafts); requests
        left out get 0."""
        rows = np.fromiter((self.row_of(r) for r in num_scheduled), np.int64, len(num_scheduled))
        n = np.fromiter(num_scheduled.values(), np.int64, len(num_scheduled))
        room = (self._np["num_tokens"][rows] + self._np["num_spec_tokens"][rows]
                - self._np["num_computed_tokens"][rows])
        bad = np.flatnonzero((n < 0) | (n > room))  # check everything before writing anything
        if len(bad):
            req_id, i = list(num_scheduled)[bad[0]], bad[0]
            raise ValueError(f"request {req_id!r}: field 'num_scheduled_tokens'={n[i]} must be in [0, {room[i]}] "
                             "(num_tokens + num_spec_tokens - num_computed_tokens)")
        sched = self._np["num_scheduled_tokens"]
        sched[: self._num_rows] = 0
        sched[rows] = n

    def _live_req(self, row: int):
        if not 0 <= row < self._num_rows or self._np["req_id"][row] is None:
            raise ValueError(f"row {row} holds no request (num_rows={self._num_rows})")
        return self._np["req_id"][row]

    # ------------------------------------------------------------------ row moves
    def _move_rows(self, dst: np.ndarray, src: np.ndarray) -> None:
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
        self._synced_rows = None
        for follower in self._followers:
            follower.move_rows(dst, src)

    def _clear_rows(self, rows: np.ndarray) -> None:
        """Reset ``rows`` of every field to the field's fill (the map is the caller's job)."""
        for field in self._fields:
            self._np[field.name][rows] = field.fill
        for follower in self._followers:
            follower.clear_rows(rows)

    def _trim(self) -> None:
        """Drop trailing holes from ``num_rows``."""
        live = np.flatnonzero(np.not_equal(self._np["req_id"][: self._num_rows], None))
        self._num_rows = int(live[-1]) + 1 if len(live) else 0

    def swap(self, i: int, j: int) -> None:
        """Exchange rows ``i`` and ``j`` (either may be a hole) in every field."""
        for row in (i, j):
            if not 0 <= row < self._num_rows:
                raise ValueError(f"swap: row {row} is outside the rows in use [0, {self._num_rows})")
        if i != j:
            self._move_rows(np.array([i, j]), np.array([j, i]))
            self._trim()

    def condense(self) -> np.ndarray:
        """Move live rows to the front, keeping their relative order (stable compaction).

        Returns ``moved`` with ``moved[new_row] = old_row`` for the ``num_reqs`` live rows.
        """
        if not self.has_holes:  # O(1): the common step with no removals
            return np.arange(self._num_rows)
        live = np.flatnonzero(np.not_equal(self._np["req_id"][: self._num_rows], None))
        n = len(live)
        self._move_rows(np.arange(n), live)
        self._clear_rows(np.arange(n, self._num_rows))
        self._num_rows = n
        return live

    def is_decode(self, decode_threshold: int = 1) -> np.ndarray:
        """Bool ``[num_rows]``: the row is a decode this step (holes: False).

        A row scheduling ``1..decode_threshold`` tokens is a decode and one scheduling more
        is a prefill (as ``AttentionMetadata`` counts them). A row that schedules nothing
        this step is classed by where it stands: a decode once past its prompt.
        """
        sched = self.np("num_scheduled_tokens")
        past_prompt = self.np("num_computed_tokens") >= self.np("num_prompt_tokens")
        live = np.not_equal(self.np("req_id"), None) if self.has_holes else True
        return live & np.where(sched > 0, sched <= decode_threshold, past_prompt)

    def reorder_split_prefill_and_decode(self, decode_threshold: int = 1) -> tuple[np.ndarray, int]:
        """Move decode rows to ``[0, num_decodes)``; return ``(perm, num_decodes)``.

        ``perm[new_row] = old_row`` over rows ``[0, num_reqs)``; undo with ``unpermute``.
        The two-pointer scan (:func:`two_pointer_swaps`): the fewest swaps, NOT stable
        within the decode or prefill group (``fleetlab.lessons.reorder`` shows the stable
        partition and the no-move gather map beside it). Call ``condense()`` first: a batch
        with holes is refused.
        """
        if self.has_holes:
            raise RuntimeError("reorder needs a dense batch: call condense() first")
        mask = self.is_decode(decode_threshold)
        lefts, rights = two_pointer_swaps(mask)
        dst, src = np.concatenate([lefts, rights]), np.concatenate([rights, lefts])
        perm = np.arange(self._num_rows, dtype=np.int64)
        perm[dst] = src
        self._move_rows(dst, src)
        logger.debug("reorder: %d rows moved, %d decodes of %d", len(dst), int(mask.sum()), self._num_rows)
        return perm, int(mask.sum())

    def permute(self, perm) -> None:
        """Reorder the rows of a dense batch: new row ``i`` takes old row ``perm[i]``."""
        if self.has_holes:
            raise RuntimeError("permute needs a dense batch: call condense() first")
        perm = np.asarray(perm, dtype=np.int64)
        if sorted(perm.tolist()) != list(range(self._num_rows)):
            raise ValueError(f"perm must be a permutation of rows [0, {self._num_rows}); got {perm.tolist()}")
        moved = np.flatnonzero(perm != np.arange(self._num_rows))
        self._move_rows(moved, perm[moved])

    # ------------------------------------------------------------------ results and device
    def by_request(self, values) -> dict:
        """``{req_id: values[row]}`` for the live rows; ``values`` is indexed by row."""
        return {req_id: values[row] for req_id, row in self._req_id_to_row.items()}

    def sync_to_device(self) -> None:
        """Copy every device field to its Paddle mirror (rows ``[0, num_reqs)`` are then read).

        Called once per step after condense and reorder: at most one host-to-device copy per
        device field no matter how many rows moved, and none for a field whose buffer equals
        what its mirror holds (a decode step changes block tables, not sampling settings:
        comparing on the host costs far less than a copy). :func:`~fleetlab.device.fill`
        writes the mirror in place, so its address stays fixed across steps (what a captured
        CUDA graph needs); it copies the whole ``[max_num_seqs, ...]`` buffer, rows past
        ``num_reqs`` included (they are never read), which costs less than staging a slice.
        """
        if self.has_holes:
            raise RuntimeError("sync_to_device needs a dense batch: call condense() first")
        for name, mirror in self._dev.items():
            if not np.array_equal(self._np[name], self._mirrored[name]):
                device.fill(mirror, self._np[name])  # in place: the mirror keeps its address
                self._mirrored[name][...] = self._np[name]
        self._synced_rows = self._num_rows

    # ------------------------------------------------------------------ inspection
    def snapshot(self, decode_threshold: int = 1, *, include_free: bool = False) -> list[RowRecord]:
        """One :class:`RowRecord` per row ``[0, num_rows)`` (all rows with ``include_free``)."""
        decode = self.is_decode(decode_threshold)
        num_rows = self.max_num_seqs if include_free else self._num_rows
        records = []
        for row in range(num_rows):
            req_id = self._np["req_id"][row]
            phase = "empty" if req_id is None else ("decode" if decode[row] else "prefill")
            blocks = self._np["block_table"][row]
            records.append(
                RowRecord(
                    row=row,
                    req_id=req_id,
                    phase=phase,
                    num_prompt_tokens=int(self._np["num_prompt_tokens"][row]),
                    num_tokens=int(self._np["num_tokens"][row]),
                    num_computed_tokens=int(self._np["num_computed_tokens"][row]),
                    num_scheduled_tokens=int(self._np["num_scheduled_tokens"][row]),
                    block_table=blocks[blocks >= 0].tolist(),
                )
            )
        return records

    def check_invariants(self) -> None:
        """Raise RuntimeError if the id <-> row maps, ``num_rows`` or empty rows disagree."""
        req_ids = self._np["req_id"]
        derived = {req_ids[r]: r for r in range(self.max_num_seqs) if req_ids[r] is not None}
        if derived != self._req_id_to_row:
            raise RuntimeError(f"req_id_to_row {self._req_id_to_row} != rows' req_id {derived}")
        if derived and max(derived.values()) + 1 != self._num_rows:
            raise RuntimeError(f"num_rows={self._num_rows} but last live row is {max(derived.values())}")
        empty = np.flatnonzero(np.equal(req_ids, None))
        for field in self._fields:
            rows = self._np[field.name][empty]
            if rows.size and not _all_fill(rows, field.fill):
                raise RuntimeError(f"field {field.name!r} holds data in an empty row")

    def __repr__(self) -> str:
        return (
            f"InputBatch(num_reqs={self.num_reqs}, num_rows={self._num_rows}, "
            f"max_num_seqs={self.max_num_seqs}, fields={len(self._fields)})"
        )


def _all_fill(rows: np.ndarray, fill) -> bool:
    """Every entry equals ``fill`` (NaN fills compare equal to NaN; objects by identity or ==)."""
    if rows.dtype == object:
        return all(x is fill or x == fill for x in rows.reshape(-1))
    fill = np.asarray(fill, dtype=rows.dtype)
    if np.issubdtype(rows.dtype, np.floating) and np.isnan(fill):
        return bool(np.isnan(rows).all())
    return bool(np.all(rows == fill))


def _positive(name: str, value, minimum: int = 1) -> int:
    if not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)
