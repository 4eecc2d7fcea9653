"""``engine_stats``: an engine's pool, cache and scheduling figures, as ``LLM.stats()`` returns them."""

from __future__ import annotations

from fleetlab.inspect.pool import pool_stats


def engine_stats(llm) -> dict:
    """Pool and cache figures: blocks, free blocks, hit rate, preemptions, utilization, steps,
    generated tokens, the requests running and waiting now, and with speculation the drafts
    verified and accepted (see :class:`~fleetlab.inspect.spec_stats.SpecDecodingStats`)."""
    pool, scheduler = llm.pool, llm.scheduler
    s = pool_stats(pool)
    tokens_held = sum(r.num_computed_tokens for r in scheduler.running)
    stats = {
        "num_blocks": s.num_blocks,
        "kv_bytes_per_block": llm.kv_sizing.bytes_per_block,
        "num_free_blocks": s.num_free_blocks,
        **{f"prefix_cache_{name}": getattr(s, name) for name in ("hit_rate", "queries", "query_tokens", "hit_tokens")},
        "num_preemptions": scheduler.num_preemptions,
        "kv_cache_utilization": s.num_used_blocks / s.num_blocks,
        "kv_token_fill": tokens_held / max(1, s.num_used_blocks * pool.block_size),
        "num_generated_tokens": scheduler.num_generated_tokens,
        "num_steps": scheduler.step_count,
        "num_requests_running": len(scheduler.running),
        "num_requests_waiting": len(scheduler.waiting),
    }
    return stats if llm.spec_stats is None else {**stats, **llm.spec_stats.as_dict()}
