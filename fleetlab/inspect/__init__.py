"""Looking inside an engine without a line in its core.

- :mod:`~fleetlab.inspect.pool`: a block pool's per-block state (:func:`pool_snapshot`, for
  drawing) and its consistency checks (:func:`check_pool`, for tests and debugging).
"""
