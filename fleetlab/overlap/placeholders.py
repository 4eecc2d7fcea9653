"""Placeholders: the tokens step N+1 reads before step N has sampled them.

The scheduler plans step N+1 while step N runs, so a request that samples in step N is
scheduled in step N+1 one position past its known tokens (``Request.num_placeholders``; the
runner gives its row a placeholder token there: ``ModelRunner._mark_placeholders``). On the
model thread, as soon as step N is done and before step N+1's forward, :func:`fill` writes
each of step N's tokens where step N+1 reads it: into the prepared step's frozen rows (its
penalties read those) and into the packed input ids its forward reads (uploaded again, once;
on a GPU this would be a device-side scatter from the sampled tokens). The live batch needs no
write: the next step's message carries the token, and the runner puts it over the placeholder.
A request step N finished or failed has no token to give: its slot in N+1 reads a harmless id
and its result is dropped when N+1 is committed.
"""

from __future__ import annotations

import numpy as np

from fleetlab.device import upload


def fill(prepared, result) -> int:
    """Write step N's sampled tokens (``result``, a ``ModelRunnerOutput``) into step N+1's
    placeholders (``prepared``, a ``PreparedStep`` frozen by :func:`fleetlab.overlap.frozen.freeze`);
    returns how many were filled. The input ids are packed again from the frozen rows (the host
    copy the forward's ids came from), so no device tensor is read back."""
    if not prepared.placeholders:
        return 0
    md = prepared.inputs.metadata
    frozen = md.batch
    by_request: dict[str, list] = {}
    for slot in prepared.placeholders:
        by_request.setdefault(slot[0], []).append(slot)
    filled = 0
    for req_id, slots in by_request.items():
        tokens = result.sampled_token_ids.get(req_id) or []  # none: finished or failed in step N
        for (_, row, position, _), token in zip(slots, tokens[-len(slots):]):
            frozen.token_ids[row, position] = token
            filled += 1
    ids = frozen.token_ids[md.token_rows_host, md.positions_host].reshape(1, -1)
    prepared.inputs.input_ids = upload(ids, np.int64)
    return filled
