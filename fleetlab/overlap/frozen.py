"""``freeze``: a prepared step's own copy of the batch state its run reads.

In the overlapped loop the host applies step N+1's plan to the live ``InputBatch`` (rows added,
removed, moved; device mirrors rewritten in place) while the model thread still runs step N.
So step N's run must read none of it: :func:`freeze` gives the prepared step a
:class:`FrozenBatch` (host copies of every field's rows, what logits processors read) and its
own copies of the device tensors it points at (the block tables attention reads, the sampling
settings). The synchronous loop needs none of this: nothing changes the batch during its run.
"""

from __future__ import annotations

import paddle

from fleetlab.device import upload


class FrozenBatch:
    """A read-only copy of an ``InputBatch``'s rows ``[0, num_rows)`` as one step was prepared.

    It answers what logits processors and attention backends ask a batch: ``np(name)``,
    ``buffer(name)``, ``dev(name)`` (uploaded from the copy on first use), ``token_ids`` and the
    other default fields as attributes, ``req_ids``, ``num_reqs``, ``sizes``, ``fields``.
    """

    def __init__(self, batch):
        self._np = {f.name: batch.np(f.name).copy() for f in batch.fields}
        self._dev: dict[str, paddle.Tensor] = {}
        self.fields, self.sizes = batch.fields, batch.sizes
        self.req_ids, self.num_reqs, self.num_rows = batch.req_ids, batch.num_reqs, batch.num_rows

    def np(self, name: str):
        return self._np[name]

    buffer = np  # a processor's scratch rows (a grammar's bitmask): its own copy, never the live one

    def dev(self, name: str) -> paddle.Tensor:
        if name not in self._dev:
            self._dev[name] = upload(self._np[name])
        return self._dev[name]

    def __getattr__(self, name: str):
        fields = self.__dict__.get("_np", {})
        if name in fields:
            return fields[name]
        raise AttributeError(name)


def freeze(prepared, batch) -> None:
    """Point ``prepared`` (a :class:`~fleetlab.engine.model_runner.PreparedStep`) at copies of
    the batch state it reads, so the host may change ``batch`` while it runs."""
    frozen = FrozenBatch(batch)
    md = prepared.inputs.metadata
    md.block_tables = md.block_tables.clone()  # a view of the mirror the next sync rewrites
    md.batch = frozen
    st = prepared.sampling
    if st is not None:
        st.temperature, st.top_k, st.top_p = st.temperature.clone(), st.top_k.clone(), st.top_p.clone()
        st.batch = frozen
