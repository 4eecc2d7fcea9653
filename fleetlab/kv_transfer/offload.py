"""``offload``: a host-memory tier under the block pool, LRU within a capacity in bytes.

The pool keeps a freed block's K/V until it is allocated again (lazy eviction); once it is
evicted, a later request with that prefix would have to recompute it. This tier keeps a copy
on the host: each full block of known tokens is copied out, layer by layer, as it is computed
(write-through, as SGLang's HiCache can; an eviction then costs nothing), and a prefix hit
past the pool's own hits copies it back into freshly allocated blocks, layer by layer, before
each layer attends. Entries over ``capacity_bytes`` go least recently used first; a block is
used when saved or loaded. A step's writes join the tier only once its forward is done, so
nothing a step is loading can be evicted under it.

In vLLM: ``OffloadingConnector`` (``offloading_connector.py``, CPU backend); SGLang:
``HiRadixCache`` with a host ``MHATokenToKVPoolHost``.

Options: ``capacity_bytes`` (at least one block: ``2 x layers x block_size x kv_heads x
head_dim x dtype bytes``).
"""

from __future__ import annotations

from collections import OrderedDict

from fleetlab.fields import int_field
from fleetlab.kv_transfer.block_store import BlockStoreConnector, LoadError


class OffloadConnector(BlockStoreConnector):
    """Blocks in host memory, at most ``options["capacity_bytes"]``, LRU."""

    name = "offload"
    options = {"capacity_bytes": None}

    @classmethod
    def check_options(cls, options: dict) -> dict:
        return {"capacity_bytes": int_field("field", "capacity_bytes", options.get("capacity_bytes"), 1, 2**63 - 1)}

    def __init__(self, config=None, spec=None):
        super().__init__(config, spec)
        self.capacity_bytes = config.options["capacity_bytes"]
        if self.capacity_bytes < spec.bytes_per_block:
            raise ValueError(f"engine config: kv_transfer_config field capacity_bytes={self.capacity_bytes} fits "
                             f"no block: one block costs {spec.bytes_per_block} bytes")
        self._blocks: OrderedDict[str, tuple] = OrderedDict()  # key -> (token_ids, [(k, v) per layer])
        self._staged: dict[str, tuple] = {}
        self.bytes_used = 0
        self.stats.extra["evicted_blocks"] = 0

    @property
    def num_blocks_held(self) -> int:
        return len(self._blocks)

    def has(self, key: str) -> bool:
        return key in self._blocks

    def read(self, key: str, layer_id: int):
        entry = self._blocks.get(key)
        if entry is None:
            raise LoadError(f"block {key} left the host tier")
        self._blocks.move_to_end(key)
        k, v = entry[1][layer_id]
        return k, v, entry[0]

    def write(self, key: str, layer_id: int, k, v, token_ids) -> None:
        entry = self._staged.setdefault(key, (list(token_ids), [None] * self.spec.num_layers))
        entry[1][layer_id] = (k.copy(), v.copy())

    def flush(self) -> None:
        for key, entry in self._staged.items():
            if key in self._blocks or any(layer is None for layer in entry[1]):
                continue  # already held, or the step stopped before its last layer
            self._blocks[key] = entry
            self.bytes_used += self.spec.bytes_per_block
        self._staged = {}
        while self.bytes_used > self.capacity_bytes:
            self._blocks.popitem(last=False)
            self.bytes_used -= self.spec.bytes_per_block
            self.stats.extra["evicted_blocks"] += 1
