"""Pictures of what the engine does: drawing functions and widgets for notebooks (and beyond).

Every drawing function returns a ``matplotlib.figure.Figure`` (not a pyplot figure: a
notebook shows it when a cell returns it, a script can ``fig.savefig(...)``); pass
``ax=`` where offered to draw into your own axes. Widgets are ``ipywidgets`` that keep
their latest figure in ``.figure``. A request has the same colour in every picture
(:func:`request_color`).

Modules:
  cost     -- why a KV cache: attention over a growing sequence, work and time per token, prefill vs decode
  blocks   -- the block pool as a grid, block tables, memory wasted by paging vs padding
  forks    -- parallel sampling: children sharing a prompt's blocks, beside copy-on-write forks
  batch    -- InputBatch rows, condense and decode-first reorder swap by swap, gather maps
  timeline -- the decode loop from engine traces: who ran when, KV occupancy, tokens per step
  replay   -- the block pool step by step: a light frame for a player, key steps as a static strip
  waiting  -- who waited in the queue, when, and what kept them out (rows, budget, pool)
  radix    -- the prefix cache as the tree it holds: the radix tree's nodes, the hash chain's blocks
  parity   -- oracle vs patched logits
  mask     -- the attention mask of a packed step: block-diagonal over rows, causal, cached prefixes
  overlap  -- the host's and the model's timelines, synchronous and overlapped (engine timestamps)
  latency  -- TTFT / TPOT percentiles of several runs (e.g. scheduling policies)
  layers   -- which attention layer writes which cache layer after patching
  results  -- stored benchmark results (benchmarks/results/*.json)
  perf     -- runs measured on the spot, side by side
  spec     -- speculative decoding: drafts accepted / rejected / bonus per step, the proposer's
              batch beside the main batch, acceptance against k, sampled-token histograms
  widgets  -- LiveFigure (controls + figure), int_sliders, player (play button + slider)
"""

from fleetlab.lab.viz._style import PHASE_COLORS, phase_color, request_color
from fleetlab.lab.viz.batch import (
    ReorderFrame,
    TokenSplit,
    draw_batch,
    draw_gather_map,
    draw_reorder,
    draw_reorder_frame,
    draw_reorder_strip,
    draw_token_axis,
    reorder_frames,
    token_split,
)
from fleetlab.lab.viz.blocks import (
    MemoryWaste,
    PoolFrame,
    block_owners,
    draw_block_mapping,
    draw_block_pool,
    draw_block_tables,
    draw_memory_waste,
    eviction_ranks,
    memory_waste,
    pool_frame,
    pool_legend,
)
from fleetlab.lab.viz.cost import draw_attention_pattern, draw_cache_cost, draw_pass_cost
from fleetlab.lab.viz.forks import draw_parallel_sampling, fork_tables
from fleetlab.lab.viz.kv_transfer import (  # noqa: F401 (notebook 13)
    draw_connector_calls,
    draw_handshake,
    draw_pool_use,
    draw_request_paths,
)
from fleetlab.lab.viz.latency import draw_latency
from fleetlab.lab.viz.layers import PatchedLayer, draw_layer_map, format_patch_table, patch_table
from fleetlab.lab.viz.mask import PackedMask, draw_packed_mask, packed_mask
from fleetlab.lab.viz.overlap import draw_overlap
from fleetlab.lab.viz.parity import ParityReport, draw_logits_parity, greedy_table, logits_parity
from fleetlab.lab.viz.perf import RunRecord, draw_run_comparison, fastest_runs, run_record
from fleetlab.lab.viz.radix import TreeNode, draw_prefix_tree, hash_chain_nodes, radix_nodes
from fleetlab.lab.viz.replay import draw_pool_step, draw_pool_strip, step_story
from fleetlab.lab.viz.results import (
    draw_bench_summary,
    draw_decode_bandwidth,
    draw_result_bars,
    load_results,
    model_label,
    result_records,
    results_dir,
)
from fleetlab.lab.viz.source import SourceExcerpt, show_source, source_excerpt
from fleetlab.lab.viz.spec import (
    TOKEN_KINDS,
    LockstepRow,
    RequestCost,
    TokenHistogram,
    VerifyRow,
    draft_state,
    draw_lockstep,
    draw_spec_benchmark,
    draw_spec_steps,
    draw_spec_sweep,
    draw_token_histogram,
    lockstep_rows,
    request_forwards,
    token_histogram,
    token_label,
    verify_rows,
)
from fleetlab.lab.viz.timeline import (
    TIMING_PARTS,
    Admission,
    admissions,
    blocks_by_request,
    describe_pool_change,
    describe_step,
    draw_batching_comparison,
    draw_engine_step,
    draw_kv_occupancy,
    draw_row_usage,
    draw_step_timings,
    draw_step_tokens,
    draw_timeline,
    idle_row_steps,
    request_order,
    row_lanes,
)
from fleetlab.lab.viz.waiting import WAIT_REASONS, Wait, blocked_by, queue_before, queue_waits
from fleetlab.lab.viz.widgets import LiveFigure, figure_png, int_sliders, player, time_frames

__all__ = [
    "Admission",
    "LockstepRow",
    "RequestCost",
    "TOKEN_KINDS",
    "TokenHistogram",
    "VerifyRow",
    "PHASE_COLORS",
    "TIMING_PARTS",
    "LiveFigure",
    "MemoryWaste",
    "ParityReport",
    "PatchedLayer",
    "PoolFrame",
    "ReorderFrame",
    "RunRecord",
    "TokenSplit",
    "block_owners",
    "admissions",
    "blocks_by_request",
    "describe_pool_change",
    "describe_step",
    "draw_batch",
    "draw_batching_comparison",
    "draw_bench_summary",
    "draw_block_mapping",
    "draw_block_pool",
    "draw_block_tables",
    "draw_decode_bandwidth",
    "draw_engine_step",
    "draw_gather_map",
    "draw_kv_occupancy",
    "draw_latency",
    "draw_layer_map",
    "draw_logits_parity",
    "draw_memory_waste",
    "draw_reorder",
    "draw_reorder_frame",
    "draw_result_bars",
    "draw_row_usage",
    "draw_run_comparison",
    "draw_step_timings",
    "draw_step_tokens",
    "draw_timeline",
    "draw_token_axis",
    "format_patch_table",
    "greedy_table",
    "idle_row_steps",
    "int_sliders",
    "load_results",
    "logits_parity",
    "memory_waste",
    "model_label",
    "patch_table",
    "phase_color",
    "player",
    "pool_frame",
    "reorder_frames",
    "request_color",
    "request_order",
    "result_records",
    "results_dir",
    "row_lanes",
    "run_record",
    "token_split",
    "draw_lockstep",
    "draw_spec_benchmark",
    "draw_spec_steps",
    "draw_spec_sweep",
    "draw_token_histogram",
    "lockstep_rows",
    "request_forwards",
    "token_histogram",
    "token_label",
    "verify_rows",
    "WAIT_REASONS",
    "Wait",
    "blocked_by",
    "queue_before",
    "queue_waits",
    "figure_png",
    "time_frames",
    "draw_reorder_strip",
    "draw_pool_step",
    "draw_pool_strip",
    "step_story",
    "eviction_ranks",
    "pool_legend",
    "draft_state",
    "fastest_runs",
    "draw_attention_pattern",
    "draw_cache_cost",
    "draw_pass_cost",
    "SourceExcerpt",
    "show_source",
    "source_excerpt",
    "draw_parallel_sampling",
    "fork_tables",
    "PackedMask",
    "packed_mask",
    "draw_packed_mask",
    "draw_overlap",
    "TreeNode",
    "draw_prefix_tree",
    "hash_chain_nodes",
    "radix_nodes",
]
