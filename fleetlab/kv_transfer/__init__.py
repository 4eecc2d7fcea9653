"""KV beyond one engine: the KV-connector API and its connectors.

- :class:`KVConnector` (``base.py``): the calls the scheduler and the attention layers make
  (the base is the null connector); :data:`KV_CONNECTORS`, :func:`register_kv_connector`.
- :class:`KVTransferConfig` (``config.py``): ``LLM(kv_transfer_config={"connector": NAME,
  "role": "producer" | "consumer" | "both", ...})``, checked at the edge.
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

__all__ = ["KV_CONNECTORS", "NULL_CONNECTOR", "KVCacheSpec", "KVConnector", "KVConnectorStats", "KVTransferConfig",
           "check_kv_transfer_config", "make_kv_connector", "register_kv_connector"]
