"""The paged KV cache, in three layers that only import downward.

- :mod:`fleetlab.kv.block_pool`: block ids, reference counts, the LRU free queue and the
  prefix cache (no tensors, no requests);
- :mod:`fleetlab.kv.paged_cache`: the per-layer K/V tensors addressed by slot;
- :mod:`fleetlab.kv.manager`: the scheduler's request-level view of the pool
  (``KVCacheManager.allocate_slots``), the only way the scheduler reaches the pool.
"""
