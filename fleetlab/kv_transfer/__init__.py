"""KV beyond one engine: the KV-connector API and its connectors.

- :class:`KVConnector` (``base.py``): the calls the scheduler and the attention layers make
  (the base is the null connector); :data:`KV_CONNECTORS`, :func:`register_kv_connector`.
- :class:`KVTransferConfig` (``config.py``): ``LLM(kv_transfer_config={"connector": NAME,
  "role": "producer" | "consumer" | "both", ...})``, checked at the edge.
- :class:`BlockStoreConnector` (``block_store.py``): the base of a connector over a store of whole
  blocks (subclass it with ``has`` / ``read`` / ``write``); a load that fails raises
  :class:`LoadError` inside it, and the scheduler recomputes that request. Both load Paddle when
  first named here (``from fleetlab.kv_transfer import BlockStoreConnector``).
- ``shared_storage`` (``shared_storage.py``): blocks in safetensors files under a directory;
  ``offload`` (``offload.py``): a host tier, LRU within a byte capacity (both over
  ``block_store.py``); ``paddle_distributed`` (``paddle_distributed.py``): a prefill rank
  sending blocks layer by layer to a decode rank with ``paddle.distributed`` send/recv, the
  decode side's request waiting for them outside its batch (``load_kv_async``).
- ``disagg.py`` / ``mixed.py``: two-rank runs checked against one engine (and measured);
  ``serving.py`` + ``proxy.py``: ``python -m fleetlab disagg``, the proxy that answers 503
  once a rank is gone.
"""

from fleetlab.kv_transfer.base import (
    KV_CONNECTORS,
    NULL_CONNECTOR,
    KVCacheSpec,
    KVConnector,
    KVConnectorStats,
    register_kv_connector,
)
from fleetlab.kv_transfer.config import KVTransferConfig, check_kv_transfer_config, make_kv_connector
from fleetlab.lazy import lazy_getattr

__all__ = ["KV_CONNECTORS", "NULL_CONNECTOR", "BlockStoreConnector", "KVCacheSpec", "KVConnector", "KVConnectorStats",
           "KVTransferConfig", "LoadError", "check_kv_transfer_config", "make_kv_connector", "register_kv_connector"]

_LAZY = {"BlockStoreConnector": "fleetlab.kv_transfer.block_store", "LoadError": "fleetlab.kv_transfer.block_store"}
# the block-store names, imported when first asked for (they load Paddle; the API above does not)
__getattr__ = lazy_getattr(__name__, _LAZY)
