"""``BlockCopy``: a step's copy of the first tokens of one cached block into a request's own block.

A prefix-cache match that ends inside a block (the radix tree matches token by token) shares
the blocks matched whole and *copies* the matched head of the next one into the request's
first new block, instead of recomputing those tokens. The KV manager plans the copy when it
admits the request and hands it to the first step that schedules the request
(``SchedulerOutput.kv_copies``); the model runner turns the step's copies into one
:class:`CopyPlan` (device indices) carried by the step's attention metadata, and every layer
applies it right after writing the step's K/V and before attending
(:meth:`fleetlab.PagedKVCache.apply_copies`): the request's first chunk attends over the copied
K/V, and a block that another request of the *same* step fills can be copied from, as it can be
shared whole (every layer writes before it reads). Same token ids at the same positions after
the same prefix: the same K/V, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


class BlockCopy(NamedTuple):
    """Copy slots ``[0, num_tokens)`` of block ``src_block`` to the same slots of ``dst_block``
    (``0 < num_tokens < block_size``); ``req_id``: the request whose block ``dst_block`` is."""

    req_id: str
    src_block: int
    dst_block: int
    num_tokens: int


def copy_slots(copies, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The slots the copies read and write: int64 ``(src [n], dst [n])``, ``n`` the tokens copied,
    in the copies' order (a later copy into the same slot wins)."""
    if not copies:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    offsets = np.concatenate([np.arange(c.num_tokens) for c in copies])
    src = np.repeat([c.src_block for c in copies], [c.num_tokens for c in copies]) * block_size + offsets
    dst = np.repeat([c.dst_block for c in copies], [c.num_tokens for c in copies]) * block_size + offsets
    return src.astype(np.int64), dst.astype(np.int64)


@dataclass(slots=True, frozen=True)
class CopyPlan:
    """A step's copies as device indices: ``read`` int64 ``[n, 2]`` (block, offset) of each source
    slot, ``block`` and ``offset`` int64 ``[n]`` of each destination slot; ``copies`` as planned."""

    read: object
    block: object
    offset: object
    copies: tuple
