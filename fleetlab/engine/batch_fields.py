"""The one place where every per-request buffer of the :class:`InputBatch` is declared.

A production engine's persistent batch keeps 50-70 per-request buffers; when they are
listed by hand in ``swap``, ``condense`` and ``reorder``, one forgotten buffer silently
pairs a request with another request's block table or sampling state. Here each buffer
is a :class:`Field` in a :class:`FieldRegistry`; the batch allocates, swaps, condenses
and reorders *whatever the registry holds*, so a new field needs no other change.

A field's buffer has shape ``[max_num_seqs, *per_row_shape]``. Entries of
``per_row_shape`` are ints or the names of the batch's size parameters
(``"max_model_len"``, ``"max_blocks_per_seq"``, ``"max_stop_ids"``), resolved when the
batch is built.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from fleetlab.errors import FieldTypeError, refuse

HOMES = ("host", "device")
DEVICE_DTYPES = ("bool", "int8", "uint8", "int16", "int32", "int64", "float16", "float32", "float64")


@dataclass(frozen=True, slots=True)
class Field:
    """One per-request buffer of the batch.

    Attributes:
      name: buffer name; also the attribute name on the batch (``batch.token_ids``).
      per_row_shape: shape of one row; ints or size-parameter names. ``()`` is a scalar.
      dtype: numpy dtype string (``"int64"``, ``"float32"``, ``"bool"``) or ``"object"``.
      home: ``"host"`` (numpy only, host bookkeeping) or ``"device"`` (numpy plus a Paddle
        mirror on the current device, for what attention and sampling read).
      fill: value of the row while it is empty (after removal, before the next add).
      doc: what the field means, for readers.
    """

    name: str
    per_row_shape: tuple[int | str, ...] = ()
    dtype: str = "int32"
    home: str = "host"
    fill: object = 0
    doc: str = ""

    def __post_init__(self) -> None:
        try:
            dtype_ok = self.dtype == "object" or bool(np.dtype(self.dtype))
        except TypeError:
            dtype_ok = False
        refuse([  # (is it broken, what to say after "field <name>: ")
            (not self.name.isidentifier() or self.name.startswith("_"), "must be a public Python identifier"),
            (self.home not in HOMES, f"home must be one of {HOMES}, got {self.home!r}"),
            (not dtype_ok, f"unknown dtype {self.dtype!r}"),
            (dtype_ok and self.home == "device" and np.dtype(self.dtype).name not in DEVICE_DTYPES,  # 'object' too
             f"dtype {self.dtype!r} cannot live on the device: {DEVICE_DTYPES}"),
            (not isinstance(self.per_row_shape, tuple), "per_row_shape must be a tuple"),
        ], prefix=f"field {self.name!r}: ")

    def resolve_shape(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        """``per_row_shape`` with size-parameter names replaced by their values."""
        shape = tuple(sizes.get(dim, dim) if isinstance(dim, str) else dim for dim in self.per_row_shape)
        if not all(isinstance(dim, (int, np.integer)) and dim >= 0 for dim in shape):
            raise ValueError(f"field {self.name!r}: per-row shape {self.per_row_shape} must hold ints >= 0 or "
                             f"known size parameters {sorted(sizes)} (an unknown size parameter?)")
        return tuple(int(dim) for dim in shape)


class FieldRegistry:
    """An ordered set of :class:`Field` s, looked up by name.

    Iteration yields fields in registration order. ``copy()`` gives an independent
    registry, so a notebook or test can add fields without touching ``DEFAULT_FIELDS``.
    A batch's own registry is frozen: its buffers are allocated once, from the fields it
    was built with.
    """

    def __init__(self, fields: tuple[Field, ...] | list[Field] = (), *, frozen: bool = False,
                 owners: Mapping[str, str] | None = None, owner: str = "") -> None:
        """``owners``: who declared each field (by name), else ``owner`` for all of them."""
        self._fields: dict[str, Field] = {}
        self._owners: dict[str, str] = {}  # field name -> who registered it, for the duplicate's message
        for field in fields:
            self.register(field, owner=(owners or {}).get(field.name, owner))
        self.frozen = frozen

    def register(self, field: Field, owner: str = "") -> None:
        """Add ``field`` (``owner``: who declares it, named if another declares it again); a second
        field with the same name is an error."""
        refuse([  # a TypeError (not a Field) and a ValueError (the rest) at once
            (getattr(self, "frozen", False), f"cannot add field {getattr(field, 'name', field)!r}: a batch's fields "
             "are fixed once it is built; register it on a copy and pass it as InputBatch(..., fields=...) "
             "(or LLM(..., batch_fields=[...]))"),
            (not isinstance(field, Field), f"expected a Field, got {type(field).__name__}"),
            (getattr(field, "name", None) in self._fields,
             f"field {getattr(field, 'name', '')!r}{' of ' + owner if owner else ''} is already registered by "
             f"{self._owners.get(getattr(field, 'name', None)) or 'an earlier registration'}"),
        ], FieldTypeError)
        self._fields[field.name] = field
        self._owners[field.name] = owner

    def copy(self, *, frozen: bool = False) -> FieldRegistry:
        """An independent registry with the same fields (unfrozen unless asked)."""
        return FieldRegistry(tuple(self._fields.values()), frozen=frozen, owners=self._owners)

    def names(self) -> list[str]:
        return list(self._fields)

    def __getitem__(self, name: str) -> Field:
        return self._fields[name]

    def __contains__(self, name: object) -> bool:
        return name in self._fields

    def __iter__(self) -> Iterator[Field]:
        return iter(self._fields.values())

    def __len__(self) -> int:
        return len(self._fields)


# The per-request state of one running request. Device fields are what the sampler reads
# every step (and the block table, which attention reads); the rest is host bookkeeping
# that the runner turns into AttentionMetadata itself.
DEFAULT_FIELDS = FieldRegistry(owner="the engine (fleetlab DEFAULT_FIELDS)", fields=[
    Field("req_id", (), "object", "host", None, "request id; None marks an empty row"),
    Field("token_ids", ("max_model_len",), "int64", "host", 0, "prompt then output tokens"),
    Field("num_tokens", (), "int32", "host", 0, "valid entries of token_ids (prompt + output)"),
    Field("num_prompt_tokens", (), "int32", "host", 0, "prompt length"),
    Field("num_computed_tokens", (), "int32", "host", 0, "tokens whose K/V is already in the cache"),
    Field("num_scheduled_tokens", (), "int32", "host", 0, "tokens this step computes (query length)"),
    Field("num_spec_tokens", (), "int32", "host", 0,
          "draft tokens verified this step, written in token_ids after num_tokens"),
    Field("num_placeholders", (), "int32", "host", 0,
          "trailing tokens of num_tokens the step before has not sampled yet (the overlapped loop's)"),
    Field("block_table", ("max_blocks_per_seq",), "int32", "device", -1, "physical block ids, -1 unused"),
    Field("num_blocks", (), "int32", "host", 0, "valid entries of block_table"),
    Field("temperature", (), "float32", "device", 1.0, "sampling temperature; 0 = greedy"),
    Field("top_k", (), "int32", "device", 0, "keep the k most likely tokens; 0 = all"),
    Field("top_p", (), "float32", "device", 1.0, "nucleus mass; 1 = all"),
    Field("seed", (), "int64", "device", 0,
          "per-request seed of the sampler; (seed, output index) is the request's random state"),
    Field("max_tokens", (), "int32", "host", 0, "stop after this many output tokens"),
    Field("min_tokens", (), "int32", "host", 0, "ignore stop tokens before this many outputs"),
    Field("ignore_eos", (), "bool", "host", False, "keep going past eos"),
    Field("stop_token_ids", ("max_stop_ids",), "int64", "host", -1, "extra stop tokens, -1 unused"),
    Field("eos_token_id", (), "int64", "host", -1, "end-of-sequence token; -1 = none"),
    Field("num_logprobs", (), "int32", "host", -1, "top log-probabilities returned per sampled token; -1 = none"),
    Field("num_prompt_logprobs", (), "int32", "host", -1,
          "top log-probabilities returned per prompt token; -1 = none"),
    Field("prompt_embeds", (), "object", "host", None,
          "side data bound to the request: (positions, embeddings) replacing prompt token embeddings"),
])


class FieldView:
    """``batch.<name>``: an InputBatch's writable numpy view of default field ``name``, rows
    ``[0, num_rows)`` (``batch.np(name)``), declared on the class where a reader and an IDE find it."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name
        self.__doc__ = DEFAULT_FIELDS[name].doc

    def __get__(self, batch, owner=None) -> np.ndarray:
        return self if batch is None else batch.np(self.name)


def check_field_value(field, where: str, value, sizes: Mapping[str, int]):
    """``value`` as one row of batch ``field``: a numpy value of its dtype and exactly its row's
    shape (``sizes`` resolves named dimensions; a scalar is never broadcast over a row); an object
    field takes anything. Otherwise ``ValueError`` naming the field: a value of another kind (text
    for a number, a float for an int) or out of the dtype's range is never coerced."""
    if field.dtype == "object":
        return value
    try:
        raw = np.asarray(value)
    except ValueError:  # a ragged nesting ([None, []]) is no array: it fits no field
        raw = np.empty((), object)
    kinds = {"b": "b", "i": "iu", "u": "iu", "f": "iuf"}.get(np.dtype(field.dtype).kind, "")
    with np.errstate(over="ignore", invalid="ignore"):
        cast = raw.astype(field.dtype) if raw.dtype.kind in kinds else None
    # A float may round (to float32), but never overflow; an int must stay the same int.
    same = cast is not None and (np.isfinite(cast) | ~np.isfinite(raw) if cast.dtype.kind == "f"
                                 else cast == raw).all()
    if not same or raw.ndim != len(field.per_row_shape):
        raise ValueError(f"{where} {field.name}={value!r:.60} does not fit the field: {field.dtype} values of "
                         f"shape {field.per_row_shape} per row")
    shape = field.resolve_shape(sizes)
    if tuple(cast.shape) != shape:
        raise ValueError(f"{where} {field.name} has shape {list(cast.shape)}; the field holds "
                         f"{field.dtype} values of shape {list(shape)} per row")
    return cast
