"""Looking inside an engine without a line in its core: observers of its steps and its figures.

- :mod:`~fleetlab.inspect.recorder`: :class:`StepRecorder` (``record_traces=True``), a
  :class:`StepTrace` of every step, with its rows and the time each part took;
- :mod:`~fleetlab.inspect.spec_stats`: :class:`SpecDecodingStats`, the drafts verified and
  accepted, counted from the steps' messages;
- :mod:`~fleetlab.inspect.stats`: :func:`engine_stats`, what ``LLM.stats()`` returns;
- :mod:`~fleetlab.inspect.pool`: a block pool's per-block state (:func:`pool_snapshot`, for drawing)
  and its consistency checks (:func:`check_pool`, :func:`check_kv_manager`; tests and debugging).

Each observer plugs in at the engine's named hooks (:class:`~fleetlab.engine.hooks.StepHooks`).
The pool's checks and snapshot are importable from here: ``from fleetlab.inspect import check_pool``.
"""

from fleetlab.inspect.pool import BlockInfo, BlockPoolStats, check_kv_manager, check_pool, pool_snapshot, pool_stats

__all__ = ["BlockInfo", "BlockPoolStats", "check_kv_manager", "check_pool", "pool_snapshot", "pool_stats"]
