"""fleetlab.lab.viz on the Agg backend: what each drawing puts on its figure, and widgets driven
by setting their values (as a reader dragging a slider would)."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from matplotlib.colors import to_hex
from matplotlib.figure import Figure

from fleetlab import LLM, BlockPool, InputBatch, SamplingParams, viz
from fleetlab.engine.outputs import RequestOutput
from fleetlab.inspect.batch import batch_snapshot
from fleetlab.inspect.pool import pool_snapshot
from fleetlab.inspect.recorder import RowTrace, StepTrace
from fleetlab.lab.viz._style import CACHED_FREE_COLOR, FREE_COLOR, PALETTE
from fleetlab.prefix_cache.hash_chain import HashChainCache


def by_gid(artists, prefix):
    """``{gid: artist}`` of the artists whose gid starts with ``prefix``."""
    return {a.get_gid(): a for a in artists if a.get_gid() and a.get_gid().startswith(prefix)}


def face(patch):
    return to_hex(patch.get_facecolor())


# ----------------------------------------------------------------- colours
def test_request_colors_are_stable_and_distinct_for_the_first_requests():
    colors = [viz.request_color(str(i)) for i in range(len(PALETTE))]
    assert len(set(colors)) == len(PALETTE)
    assert viz.request_color("3") == viz.request_color(3)
    assert len({viz.request_color(c) for c in "abcdefghijklmnop"[:len(PALETTE)]}) == len(PALETTE)
    assert viz.request_color("req-a") == viz.request_color("req-a")
    assert set(viz.PHASE_COLORS.values()).isdisjoint(PALETTE)
    with pytest.raises(ValueError, match="phase"):
        viz.phase_color("decoding")


# ----------------------------------------------------------------- blocks
@pytest.fixture()
def shared_pool():
    """Request a fills 3 blocks (cached); b hits a's first 2 and allocates 1; c came and went."""
    cache = HashChainCache(4)
    pool = BlockPool(10, 4, cache)
    prompt_a = list(range(10, 22))
    a = pool.allocate(3)
    cache.cache_blocks(prompt_a, a, 0, 3)
    hits = cache.lookup(prompt_a[:8] + [90, 91])
    pool.touch(hits)
    b = hits + pool.allocate(1)
    c = pool.allocate(2)
    cache.cache_blocks(list(range(50, 58)), c, 0, 2)
    pool.free(c)
    return pool, {"a": a, "b": b}, c


def test_block_grid_colours_each_block_by_owner_share_and_cache_state(shared_pool):
    pool, tables, freed = shared_pool
    fig = viz.draw_block_pool(pool, tables, ncols=5)
    assert isinstance(fig, Figure)
    cells = by_gid(fig.axes[0].patches, "block:")
    assert len(cells) == pool.num_blocks
    a, b = tables["a"], tables["b"]
    shared, only_a, only_b = a[:2], a[2], b[2]
    for block in shared:
        assert face(cells[f"block:{block}"]) == viz.request_color("a")  # first owner's colour
        assert cells[f"block:{block}"].get_hatch() == "xx"
    assert face(cells[f"block:{only_a}"]) == viz.request_color("a")
    assert face(cells[f"block:{only_b}"]) == viz.request_color("b")
    assert cells[f"block:{only_b}"].get_hatch() is None
    for block in freed:  # free but still holding a cached prefix
        assert face(cells[f"block:{block}"]) == CACHED_FREE_COLOR
    never_used = set(range(pool.num_blocks)) - set(a) - set(b) - set(freed)
    assert {face(cells[f"block:{blk}"]) for blk in never_used} == {FREE_COLOR}
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts.count("x2") == 2
    # A freed cached block is numbered in eviction order among the cached ones (1 = first): the
    # white free blocks ahead of them in the queue go first, so the numbers start at 1.
    queue = {info.block_id: info.lru_position for info in pool_snapshot(pool)}
    ranks = viz.eviction_ranks(pool_snapshot(pool))
    assert sorted(ranks) == sorted(freed) and sorted(ranks.values()) == [1, 2]
    assert [b for b in sorted(freed, key=queue.get)] == sorted(ranks, key=ranks.get)
    labels = sorted(t.get_text() for t in fig.axes[0].texts if t.get_bbox_patch() is not None)  # not the block ids
    assert labels == ["1", "2", "x2", "x2"]


def test_block_grid_accepts_a_snapshot_and_marks_unknown_owners_grey():
    pool = BlockPool(4, 2)
    pool.allocate(1)
    fig = viz.draw_block_pool(pool_snapshot(pool), ncols=2)
    cells = by_gid(fig.axes[0].patches, "block:")
    assert face(cells["block:0"]) == "#7f7f7f" and face(cells["block:1"]) == FREE_COLOR


def test_block_tables_shade_the_filled_part_of_each_block():
    fig = viz.draw_block_tables({"a": [7, 2], "b": [5]}, {"a": 6, "b": 1}, block_size=4)
    ax = fig.axes[0]
    assert set(by_gid(ax.patches, "table:")) == {"table:a:0", "table:a:1", "table:b:0"}
    fills = {gid: p.get_width() for gid, p in by_gid(ax.patches, "fill:").items()}
    assert fills == pytest.approx({"fill:a:0": 0.92, "fill:a:1": 0.46, "fill:b:0": 0.23})
    assert [t.get_text() for t in ax.texts] == ["7", "2", "5"]
    with pytest.raises(ValueError, match="block_size"):
        viz.draw_block_tables({"a": [1]}, {"a": 1})


def test_memory_waste_counts_and_bars():
    waste = viz.memory_waste([5, 8, 1], block_size=4, max_model_len=16)
    assert (waste.tokens, waste.paged, waste.padded, waste.reserved) == (14, 20, 24, 48)
    assert waste.wasted_fraction("paged") == pytest.approx(6 / 20)
    fig = viz.draw_memory_waste([5, 8, 1], 4, 16)
    bars = by_gid(fig.axes[0].patches, "waste:")
    assert bars["waste:paged:used"].get_height() == 14
    assert bars["waste:paged:wasted"].get_height() == 6
    assert bars["waste:reserved:wasted"].get_height() == 34
    with pytest.raises(ValueError, match="max_model_len"):
        viz.memory_waste([20], 4, max_model_len=8)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=12), st.integers(1, 64))
def test_paging_wastes_less_than_one_block_per_request(lengths, block_size):
    waste = viz.memory_waste(lengths, block_size)
    assert waste.tokens <= waste.paged <= waste.tokens + (block_size - 1) * len(lengths)
    assert waste.paged % block_size == 0
    assert waste.tokens <= waste.padded <= waste.reserved


# ----------------------------------------------------------------- widgets
def test_live_figure_redraws_when_a_slider_moves():
    sliders = viz.int_sliders(block_size=(1, 32, 1, 4), length=(1, 64, 1, 10))
    live = viz.LiveFigure(lambda block_size, length: viz.draw_memory_waste([length, 3], block_size), sliders)
    assert live.num_draws == 1
    assert by_gid(live.figure.axes[0].patches, "waste:")["waste:paged:used"].get_height() == 13
    sliders["block_size"].value = 16
    bars = by_gid(live.figure.axes[0].patches, "waste:")
    assert live.num_draws == 2
    assert bars["waste:paged:wasted"].get_height() == 32 - 13
    sliders["length"].value = 20
    assert by_gid(live.figure.axes[0].patches, "waste:")["waste:paged:used"].get_height() == 23
    assert live.values() == {"block_size": 16, "length": 20}
    with pytest.raises(ValueError, match="outside"):
        viz.int_sliders(x=(0, 3, 1, 9))


def test_player_links_play_and_slider():
    drawn = []

    def draw(index):
        drawn.append(index)
        fig = Figure()
        fig.add_subplot().bar([0], [index], gid="frame")
        return fig

    live = viz.player(draw, 5, start=1)
    live.play.value = 3  # what pressing play does, tick by tick
    assert live.slider.value == 3 and drawn == [1, 3]
    live.slider.value = 4
    assert live.play.value == 4
    assert by_gid(live.figure.axes[0].patches, "frame")["frame"].get_height() == 4
    with pytest.raises(ValueError, match="frame"):
        viz.player(draw, 0)


# ----------------------------------------------------------------- batch
def make_batch():
    """Rows 0..5 = requests 0..5; 2 finishes (a hole); 1 and 3 prefill, the rest decode."""
    batch = InputBatch(max_num_seqs=6, max_model_len=32, max_blocks_per_seq=4)
    for i, (n, computed) in enumerate([(5, 4), (6, 0), (4, 3), (7, 0), (3, 2), (8, 7)]):
        batch.add_request(str(i), list(range(1, n + 1)), num_computed_tokens=computed, block_ids=[i])
    batch.remove_request("2")
    batch.set_num_scheduled({"0": 1, "1": 6, "3": 7, "4": 1, "5": 1})
    return batch


def test_reorder_frames_step_condense_then_each_swap():
    frames = viz.reorder_frames(batch := make_batch())
    assert [r.req_id for r in frames[0].records] == ["0", "1", None, "3", "4", "5"]
    assert [r.req_id for r in frames[1].records] == ["0", "1", "3", "4", "5"]
    assert frames[1].moved == (2, 3, 4)
    swaps = frames[2:]
    assert [f.moved for f in swaps] == [(1, 4), (2, 3)]
    last = [r.phase for r in frames[-1].records]
    assert last == ["decode"] * 3 + ["prefill"] * 2 and frames[-1].num_decodes == 3
    # The same rows the engine's one-shot reorder produces.
    reference = make_batch()
    reference.condense()
    reference.reorder_split_prefill_and_decode()
    assert batch.req_ids == reference.req_ids
    fig = viz.draw_reorder_frame(frames, 2)
    rows = by_gid(fig.axes[1].patches, "row:")
    outlined = sorted(int(g.split(":")[1]) for g, p in rows.items() if p.get_linewidth() > 2)
    assert outlined == [1, 4]
    with pytest.raises(ValueError, match="out of range"):
        viz.draw_reorder_frame(frames, len(frames))


def test_draw_reorder_draws_one_arrow_per_moved_request():
    frames = viz.reorder_frames(make_batch())
    fig = viz.draw_reorder(frames[1].records, frames[-1].records, num_decodes=3)
    arrows = by_gid(fig.artists, "move:")
    assert set(arrows) == {"move:1", "move:3", "move:4", "move:5"}
    phases = [face(p) for p in by_gid(fig.axes[1].patches, "row:").values()]
    assert phases == [viz.phase_color("decode")] * 3 + [viz.phase_color("prefill")] * 2


def test_gather_map_moves_no_row_and_points_slots_at_rows():
    batch = make_batch()
    batch.condense()
    before = batch.req_ids
    from fleetlab.lab.lessons.reorder import decode_first_order

    order, num_decodes = decode_first_order(batch)
    fig = viz.draw_gather_map(batch_snapshot(batch), order, num_decodes)
    assert batch.req_ids == before
    expected = {f"gather:{k}" for k, i in enumerate(order) if k != i}
    assert set(by_gid(fig.artists, "gather:")) == expected and expected
    labels = [t.get_text() for t in fig.axes[1].get_yticklabels()]
    assert labels[0] == f"slot 0 <- row {order[0]}"


# ----------------------------------------------------------------- timeline (synthetic traces)
def trace(step, rows, preempted=(), finished=(), free=6):
    return StepTrace(step=step, rows=[RowTrace(r, ph, n, 0, 4, list(b)) for r, ph, n, b in rows],
                     order_before=[r[0] for r in rows], order_after=[r[0] for r in rows], num_decodes=0,
                     reordered=False, tokens={}, preempted=list(preempted), finished=list(finished),
                     num_free_blocks=free, num_blocks=8, num_batched_tokens=sum(r[2] for r in rows))


@pytest.fixture()
def traces():
    return [
        trace(0, [("a", "prefill", 4, [0]), ("b", "prefill", 3, [1])]),
        trace(1, [("a", "decode", 1, [0, 2]), ("b", "decode", 1, [1]), ("c", "prefill", 5, [0, 3])]),
        trace(2, [("a", "decode", 1, [0, 2])], preempted=["c"], finished=["a"]),
    ]


def test_timeline_boxes_markers_and_upto(traces):
    fig = viz.draw_timeline(traces)
    ax = fig.axes[0]
    boxes = by_gid(ax.patches, "")
    assert {g for g in boxes if g.startswith("prefill")} == {"prefill:a:0", "prefill:b:0", "prefill:c:1"}
    assert len([g for g in boxes if g.startswith("decode")]) == 3
    assert face(boxes["decode:a:1"]) == viz.phase_color("decode")
    assert to_hex(boxes["decode:a:1"].get_edgecolor()) == viz.request_color("a")
    assert set(by_gid(ax.lines, "")) == {"preempted:c:2", "finished:a:2"}
    assert [t.get_text() for t in ax.get_yticklabels()] == ["req a", "req b", "req c"]
    upto = viz.draw_timeline(traces, upto=0).axes[0]
    assert len(by_gid(upto.patches, "")) == 2 and not by_gid(upto.lines, "preempted")
    assert upto.get_xlim() == ax.get_xlim()  # frames of a player keep the same axes


def test_kv_occupancy_counts_shared_blocks_once(traces):
    assert viz.blocks_by_request(traces[1]) == {"a": 2, "b": 1, "c": 1}  # block 0 is a's
    bars = by_gid(viz.draw_kv_occupancy(traces).axes[0].patches, "kv:")
    assert bars["kv:c:1"].get_height() == 1 and bars["kv:c:1"].get_y() == 3
    assert sum(b.get_height() for g, b in bars.items() if g.endswith(":1")) == 4


def test_step_tokens_bars_and_engine_step_figure(traces):
    bars = by_gid(viz.draw_step_tokens(traces, budget=8).axes[0].patches, "tokens:")
    assert bars["tokens:prefill:1"].get_height() == 5 and bars["tokens:decode:1"].get_height() == 2
    assert bars["tokens:prefill:1"].get_y() == 2
    fig = viz.draw_engine_step(traces, 1, budget=8)
    assert len(fig.axes) == 3
    assert "step 1" in fig._suptitle.get_text()
    assert not by_gid(fig.axes[0].patches, "decode:a:2")
    with pytest.raises(ValueError, match="no trace"):
        viz.draw_engine_step(traces, 9)


def test_step_timings_stack_in_milliseconds(traces):
    traces[1].timings = {"schedule": 0.001, "forward": 0.004, "ignored": 9.0}
    bars = by_gid(viz.draw_step_timings(traces).axes[0].patches, "timing:")
    assert len(bars) == len(viz.TIMING_PARTS) * len(traces)
    assert bars["timing:forward:1"].get_height() == pytest.approx(4.0)
    assert bars["timing:forward:1"].get_y() == pytest.approx(1.0)  # schedule (1 ms) sits below
    assert bars["timing:forward:0"].get_height() == 0.0


# ----------------------------------------------------------------- timeline (a real engine run)
@pytest.fixture(scope="module")
def engine_traces(fleet_model):
    """A run tight enough on blocks to preempt, with decode-first reorder on."""
    llm = LLM(fleet_model, block_size=4, num_blocks=12, max_num_batched_tokens=16, max_model_len=40,
              max_num_seqs=4, record_traces=True, reorder=True)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 100, size=n)] for n in (9, 2, 5, 12, 7)]
    try:
        llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=9, ignore_eos=True),
                     use_tqdm=False)
    finally:
        llm.handle.unpatch()  # the traces are plain data; the shared model must go back as it was
    return llm.traces, llm.stats()


def test_timeline_of_a_real_run_matches_its_traces(engine_traces):
    traces, stats = engine_traces
    ax = viz.draw_timeline(traces).axes[0]
    boxes = by_gid(ax.patches, "")
    rows = [(r.phase, r.request_id, t.step) for t in traces for r in t.rows]
    assert sorted(boxes) == sorted(f"{p}:{r}:{s}" for p, r, s in rows)
    assert len(by_gid(ax.lines, "preempted")) == stats["num_preemptions"] > 0
    assert len(by_gid(ax.lines, "finished")) == 5


def test_player_over_engine_steps_shows_only_steps_so_far(engine_traces):
    traces, _ = engine_traces
    live = viz.player(lambda i: viz.draw_engine_step(traces, traces[i].step, budget=16), len(traces))
    live.slider.value = 3
    shown = by_gid(live.figure.axes[0].patches, "")
    assert shown and max(int(g.rsplit(":", 1)[1]) for g in shown) == traces[3].step


# ----------------------------------------------------------------- parity
def test_logits_parity_report_and_bars():
    rng = np.random.default_rng(0)
    ref = [rng.normal(size=(3, 10)), rng.normal(size=(2, 10))]
    new = [a.copy() for a in ref]
    new[1][1, 4] += 0.5
    new[0][2] = 0.0
    new[0][2, int(ref[0][2].argmax())] = 100.0  # huge change, same greedy token
    report = viz.logits_parity(ref, new)
    assert report.max_abs_diff == pytest.approx(np.abs(ref[0][2] - new[0][2]).max())
    assert report.per_step[0][:2].tolist() == [0.0, 0.0]
    flip = new[1][1].argmax() != ref[1][1].argmax()
    assert report.argmax_agreement == pytest.approx(1 - flip / 5)
    fig = viz.draw_logits_parity(ref, new, max_points=20)
    points = by_gid(fig.axes[1].lines, "diff:")
    assert len(points) == 5
    assert points["diff:1:1"].get_ydata()[0] == pytest.approx(0.5)
    # a zero sits on the axis' bottom edge, hollow: no bar rising from an arbitrary floor
    bottom = fig.axes[1].get_ylim()[0]
    zero = points["diff:0:0"]
    assert zero.get_ydata()[0] == pytest.approx(bottom) and zero.get_markerfacecolor() == "none"
    assert points["diff:1:1"].get_markerfacecolor() != "none"
    assert fig.axes[0].collections[0].get_offsets().shape == (20, 2)
    with pytest.raises(ValueError, match="shapes"):
        viz.logits_parity(ref, ref[:1])


def test_greedy_table_marks_differences():
    text = viz.greedy_table([[1, 2], [3]], [[1, 2], [4]], decode=lambda ids: "".join(map(str, ids)))
    assert text.splitlines() == ["req 0: '12' == '12'", "req 1: '3' != '4'"]


# ----------------------------------------------------------------- layers
def test_fleet_layer_map_shows_zero_based_ids_and_the_one_based_trap(fleet_model):
    from fleetlab import patch_model

    with patch_model(fleet_model) as handle:
        table = viz.patch_table(handle)
        assert [(r.layer_id, r.layer_number) for r in table] == [(0, 1), (1, 2), (2, 3)]
        assert "core_attention" in viz.format_patch_table(handle).splitlines()[1]
        fig = viz.draw_layer_map(handle)
    ax = fig.axes[0]
    assert set(by_gid(ax.patches, "layer:")) == {"layer:0", "layer:1", "layer:2"}
    assert set(by_gid(ax.patches, "one_based:")) == {"one_based:1", "one_based:2", "one_based:3"}
    assert "no such\nlayer" in [t.get_text() for t in ax.texts]


def test_paddleformers_layer_map_has_no_one_based_arrows(family_models):
    from fleetlab import patch_model

    with patch_model(family_models("llama")) as handle:
        table = viz.patch_table(handle)
        fig = viz.draw_layer_map(handle)
    assert [r.layer_number for r in table] == [None] * 3 and [r.layer_id for r in table] == [0, 1, 2]
    assert not by_gid(fig.axes[0].patches, "one_based:")


# ----------------------------------------------------------------- perf
def test_result_records_flatten_common_layouts():
    assert viz.result_records([{"name": "x", "tok_s": 3.0, "note": "n"}]) == [{"name": "x", "tok_s": 3.0}]
    nested = {"bench": {"results": {"fleetlab": {"tok_s": 5, "ok": True}, "static": {"tok_s": 2}}}}
    assert viz.result_records(nested) == [{"name": "bench/results/fleetlab", "tok_s": 5.0},
                                          {"name": "bench/results/static", "tok_s": 2.0}]
    mixed = {"system": "s", "tok_s": 1, "runs": [{"engine": "e", "ms": 2}]}
    assert viz.result_records(mixed) == [{"name": "s", "tok_s": 1.0}, {"name": "e", "ms": 2.0}]
    assert viz.result_records({"x": float("nan"), "y": "text"}) == []


def test_load_results_skips_bad_files_and_bars_are_drawn(tmp_path):
    assert viz.load_results(tmp_path / "missing") == {}
    (tmp_path / "bench.json").write_text(json.dumps([{"name": "a", "tok_s": 4}, {"name": "b", "tok_s": 8}]))
    (tmp_path / "broken.json").write_text("{not json")
    results = viz.load_results(tmp_path)
    assert list(results) == ["bench"]
    fig = viz.draw_result_bars(viz.result_records(results))
    bars = by_gid(fig.axes[0].patches, "result:")
    assert bars["result:tok_s:b"].get_width() == 8
    with pytest.raises(ValueError, match="no records"):
        viz.draw_result_bars([])


def test_run_records_and_comparison():
    outs = [RequestOutput("0", [1], [5, 6, 7], metrics={"finish_time": 11.0}),
            RequestOutput("1", [1], [5], metrics={"finish_time": 10.5})]
    run = viz.run_record("continuous", outs, start=10.0, end=12.0)
    assert run.finish_times == [0.5, 1.0] and run.tokens_per_s == 2.0
    assert run.mean_latency_s == pytest.approx(0.75)
    fig = viz.draw_run_comparison([run, viz.run_record("static", outs, 10.0, 14.0)])
    assert len(fig.axes) == 2  # steps unknown: no steps panel
    bars = by_gid(fig.axes[0].patches, "throughput:")
    assert bars["throughput:static"].get_height() == 1.0
    line = by_gid(fig.axes[1].lines, "completed:")["completed:continuous"]
    assert list(line.get_ydata()) == [0, 1, 2]
    fig = viz.draw_run_comparison([viz.run_record("a", outs, 10.0, 12.0, num_steps=7),
                                   viz.run_record("b", outs, 10.0, 12.0, num_steps=9)])
    assert by_gid(fig.axes[1].patches, "steps:")["steps:b"].get_height() == 9
    with pytest.raises(ValueError, match="before start"):
        viz.run_record("x", outs, start=5.0, end=1.0)


BENCH = {
    "throughput": {"models": [{"size": "small", "paddleformers": {"tokens_per_s": 500.0},
                               "fleetlab": {"tokens_per_s": 2000.0}},
                              {"size": "base", "fleetlab": {"tokens_per_s": 600.0}}]},
    "kv_memory": {"paged": {"token_fill": 0.97}, "padded": {"token_fill": 0.63}, "reserved": {}},
    "prefix_caching": {"off": {"seconds": 5.0}, "on": {"seconds": 1.5}},
    "step_breakdown": [{"batch_size": 4, "ms_per_step": {"forward": 13.0, "sample": 0.5, "total": 13.5}}],
}


def test_bench_summary_draws_the_sections_it_finds():
    fig = viz.draw_bench_summary(BENCH)
    assert len(fig.axes) == 4
    bars = {g: p for ax in fig.axes for g, p in by_gid(ax.patches, "").items()}
    assert bars["throughput:small:fleetlab LLM"].get_height() == 2000.0
    assert "throughput:base:PaddleFormers generate" not in bars  # missing numbers are skipped
    assert bars["kv_memory:paged"].get_height() == pytest.approx(97.0)
    assert "kv_memory:reserved" not in bars
    assert bars["prefix_caching:on"].get_height() == 1.5
    assert bars["step_breakdown:batch 4:sample"].get_y() == 13.0  # stacked on forward; total dropped
    assert "step_breakdown:batch 4:total" not in bars
    only = viz.draw_bench_summary({"prefix_caching": BENCH["prefix_caching"], "other": [1, 2]})
    assert len(only.axes) == 1
    assert viz.draw_bench_summary({"schema_version": 2, "results": []}) is None


def test_decode_bandwidth_lines_per_batch_and_implementation():
    rows = [{"batch": b, "context": c, "triton_tbps": b * c / 1e4, "sdpa_tbps": 0.5, "dtype": "bf16"}
            for b in (1, 16) for c in (512, 2048)]
    fig = viz.draw_decode_bandwidth({"decode_bandwidth": rows, "ceilings": {"read_sum_tbps": 4.2}})
    assert len(fig.axes) == 2
    lines = by_gid(fig.axes[1].lines, "bandwidth:")
    assert set(lines) == {"bandwidth:16:triton", "bandwidth:16:sdpa"}
    assert list(lines["bandwidth:16:triton"].get_ydata()) == pytest.approx([16 * 512 / 1e4, 16 * 2048 / 1e4])
    assert viz.draw_decode_bandwidth({"decode_bandwidth": []}) is None


def test_decode_bandwidth_colours_follow_the_implementation_not_the_file():
    """The notebook's prose names the lines by colour: another series in the file (``before``)
    must not shift them."""
    from matplotlib.colors import to_hex

    from fleetlab.lab.viz.results import IMPLEMENTATION_COLORS

    def colours(impls):
        rows = [{"batch": 1, "context": 512, **{f"{i}_tbps": 1.0 for i in impls}}]
        lines = by_gid(viz.draw_decode_bandwidth({"decode_bandwidth": rows}).axes[0].lines, "bandwidth:")
        return {gid.rsplit(":", 1)[1]: to_hex(line.get_color()) for gid, line in lines.items()}

    alone = colours(["triton", "sdpa", "gather_sdpa"])
    assert alone == {k: to_hex(IMPLEMENTATION_COLORS[k]) for k in alone}
    assert {k: v for k, v in colours(["triton", "sdpa", "gather_sdpa", "before"]).items() if k != "before"} == alone


def test_decode_bandwidth_draws_one_clock_and_names_every_line():
    """The eager columns of the kernel benchmark (``<impl>_eager_tbps``) are a clock, not more
    implementations: the graph figure leaves them out, the eager one draws them under the same names."""
    from fleetlab.lab.viz.results import IMPLEMENTATION_NAMES

    rows = [{"batch": 1, "context": c, "triton_tbps": 3.0, "triton_eager_tbps": 1.0, "sdpa_tbps": 2.0,
             "sdpa_eager_tbps": 0.5, "before_eager_tbps": 0.2} for c in (512, 2048)]
    graph = viz.draw_decode_bandwidth({"decode_bandwidth": rows})
    assert set(by_gid(graph.axes[0].lines, "bandwidth:")) == {"bandwidth:1:triton", "bandwidth:1:sdpa"}
    eager = viz.draw_decode_bandwidth({"decode_bandwidth": rows}, clock="eager")
    lines = by_gid(eager.axes[0].lines, "bandwidth:")
    assert set(lines) == {"bandwidth:1:triton", "bandwidth:1:sdpa", "bandwidth:1:before"}
    assert list(lines["bandwidth:1:sdpa"].get_ydata()) == [0.5, 0.5]
    labels = {t.get_text() for t in eager.legends[0].get_texts()}
    assert {IMPLEMENTATION_NAMES[i] for i in ("triton", "sdpa", "before")} <= labels
    assert not any("eager" in label for label in labels)
    assert "graph replay" in graph._suptitle.get_text() and "from Python" in eager._suptitle.get_text()
    assert viz.draw_decode_bandwidth({"decode_bandwidth": [{"batch": 1, "context": 8, "x_eager_tbps": 1.0}]}) is None
    with pytest.raises(ValueError, match="clock"):
        viz.draw_decode_bandwidth({"decode_bandwidth": rows}, clock="wall")


# ----------------------------------------------------------------- the pictures issue #18 asked for
def test_block_mapping_draws_one_arrow_per_table_entry_and_hatches_shared_blocks(shared_pool):
    pool, tables, freed = shared_pool
    fig = viz.draw_block_mapping(tables, pool, num_tokens={"a": 12, "b": 10}, block_size=4)
    ax = fig.axes[0]
    arrows = by_gid(ax.patches, "map:")
    assert set(arrows) == {f"map:{r}:{j}" for r, blocks in tables.items() for j in range(len(blocks))}
    physical = by_gid(ax.patches, "physical:")
    assert len(physical) == pool.num_blocks
    shared = set(tables["a"]) & set(tables["b"])
    assert {int(g.split(":")[1]) for g, p in physical.items() if p.get_hatch() == "xx"} == shared
    assert {face(physical[f"physical:{b}"]) for b in freed} == {CACHED_FREE_COLOR}
    assert "block 3  slots 12-15" in [t.get_text() for t in ax.texts]
    with pytest.raises(ValueError, match="outside the pool"):
        viz.draw_block_mapping({"a": [99]}, 8)


def test_pool_frame_captures_the_running_requests_and_revived_blocks_are_outlined(fleet_model):
    llm = LLM(fleet_model, block_size=4, num_blocks=16, max_num_batched_tokens=32, max_num_seqs=4,
              max_model_len=40, record_traces=True)
    try:
        llm.add_request(prompt_token_ids=list(range(3, 15)), sampling_params=SamplingParams(max_tokens=6,
                                                                                            ignore_eos=True))
        llm.step()
        llm.add_request(prompt_token_ids=list(range(3, 15)) + [40], sampling_params=SamplingParams(max_tokens=6,
                                                                                                   ignore_eos=True))
        llm.step()
        frame = viz.pool_frame(llm)
    finally:
        llm.handle.unpatch()
    assert frame.step == llm.traces[-1].step and frame.block_size == 4 and set(frame.block_tables) == {"0", "1"}
    hit = viz.admissions(llm.traces, block_size=4)[-1]
    assert hit.request_id == "1" and hit.num_cached_tokens == 12
    assert hit.cached_block_ids == frame.block_tables["0"][:3] == frame.block_tables["1"][:3]
    fig = viz.draw_engine_step(llm.traces, frame.step, pool_frames=[frame])
    outlined = {g for ax in fig.axes for g in by_gid(ax.patches, "revived:")}
    assert outlined == {f"revived:{b}" for b in hit.cached_block_ids}
    assert "took blocks" in fig.axes[-1].get_title()
    texts = [t for t in fig.axes[0].texts if t.get_gid() == f"cached:1:{frame.step}"]
    assert [t.get_text() for t in texts] == ["12"]


def test_admissions_follow_a_preempted_request_back(engine_traces):
    traces, stats = engine_traces
    back = [a for a in viz.admissions(traces) if a.resumed]
    assert len(back) >= 1 and all(a.request_id in {r for t in traces for r in t.preempted} for a in back)
    for a in back:
        assert a.num_cached_tokens >= 0
        assert a.describe().startswith(f"req {a.request_id} came back in step {a.step}")


def test_token_split_matches_attention_metadata_before_and_after_reorder():
    from fleetlab import AttentionMetadata

    batch = make_batch()
    batch.condense()
    rows = batch_snapshot(batch)
    batch.reorder_split_prefill_and_decode()
    for records in (rows, batch_snapshot(batch)):
        split = viz.token_split(records)
        md = AttentionMetadata.build([r.num_scheduled_tokens for r in records],
                                     [r.num_computed_tokens for r in records],
                                     [list(range(16))] * len(records), 4)  # any allocated blocks will do
        assert (split.num_decodes, split.num_decode_tokens, split.num_tokens) == (
            md.num_decodes, md.num_decode_tokens, md.num_tokens)
    assert not viz.token_split(batch_snapshot(batch)).stranded
    fig = viz.draw_token_axis(rows, batch_snapshot(batch))
    hatched = {g.split(":")[2] for g, p in by_gid(fig.axes[0].patches, "token:before:").items() if p.get_hatch()}
    assert hatched == set(viz.token_split(rows).stranded) and hatched


def test_reorder_arrows_start_and_end_clear_of_the_row_labels():
    frames = viz.reorder_frames(make_batch())
    fig = viz.draw_reorder(frames[1].records, frames[-1].records)
    right = fig.axes[1]
    assert right.yaxis.get_ticks_position() == "right"  # labels stand on the far side of the arrows


def test_row_usage_counts_idle_rows_and_keeps_a_request_in_its_row(traces):
    lanes = viz.row_lanes(traces, 3)
    assert lanes[0] == {0: "a", 1: "b"} and lanes[1] == {0: "a", 1: "b", 2: "c"} and lanes[2] == {0: "a"}
    assert viz.idle_row_steps(traces, 3) == 1 + 0 + 2
    fig = viz.draw_row_usage(traces, 3)
    assert len(by_gid(fig.axes[0].patches, "idle:")) == 3 and len(by_gid(fig.axes[0].patches, "busy:")) == 6
    both = viz.draw_batching_comparison({"x": traces, "y": traces[:2]}, 3)
    assert len(both.axes) == 2 and both.axes[0].get_xlim() == both.axes[1].get_xlim()


def test_kv_occupancy_fits_the_peak_and_names_each_request(traces):
    ax = viz.draw_kv_occupancy(traces).axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"req a", "req b", "req c"} <= set(labels)
    roomy = [trace(t.step, [(r.request_id, r.phase, r.num_scheduled_tokens, r.block_ids) for r in t.rows])
             for t in traces]
    for t in roomy:
        t.num_blocks, t.num_free_blocks = 100, 96
    ax = viz.draw_kv_occupancy(roomy).axes[0]
    assert ax.get_ylim()[1] < 20 and "pool: 100 blocks" in ax.get_title()
    assert all(float(x).is_integer() for x in ax.get_xticks())


def test_live_figure_draws_the_error_instead_of_a_stale_picture():
    def draw(n):
        if n == 3:
            raise RuntimeError("no room for 3")
        fig = Figure()
        fig.add_subplot().set_title(f"n={n}")
        return fig

    live = viz.LiveFigure(draw, viz.int_sliders(n=(1, 5, 1, 1)))
    live.controls["n"].value = 3
    assert isinstance(live.error, RuntimeError)
    message = live.figure.axes[0].texts[0].get_text()
    assert "no room for 3" in message and "n=3" in message
    live.controls["n"].value = 4
    assert live.error is None and live.figure.axes[0].get_title() == "n=4"


def test_results_are_found_from_the_package_and_models_named_as_in_readme(tmp_path, monkeypatch):
    from pathlib import Path

    import fleetlab

    repo = Path(fleetlab.__file__).resolve().parents[1]
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FLEETLAB_RESULTS", raising=False)
    assert viz.results_dir() == repo / "benchmarks" / "results"
    assert "bench" in viz.load_results()
    monkeypatch.setenv("FLEETLAB_RESULTS", str(tmp_path))
    assert viz.load_results() == {}
    assert viz.model_label({"size": "small", "num_params": 1049728}, "0") == "Llama 1.0M params"
    bench = json.loads((repo / "benchmarks" / "results" / "bench.json").read_text())
    fig = viz.draw_bench_summary(bench)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["Llama 1.0M params", "Llama 3.4M params"]
    assert by_gid(fig.axes[2].patches, "prefix_caching:")["prefix_caching:on"].get_height() == pytest.approx(
        bench["prefix_caching"]["on"]["tokens_per_s"])


def test_bandwidth_legend_names_implementations_in_words_and_explains_reference_lines():
    rows = [{"batch": b, "context": c, "triton_tbps": 4.4, "gather_sdpa_tbps": 1.3} for b in (1, 16, 64, 256)
            for c in (512, 2048)]
    fig = viz.draw_decode_bandwidth({"decode_bandwidth": rows, "ceilings": {"read_sum_tbps": 4.2},
                                     "environment": {"device": "NVIDIA H200"}})
    assert sum(ax.get_visible() for ax in fig.axes) == 4 and len(fig.axes) == 6  # two rows of three
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    from fleetlab.lab.viz.results import IMPLEMENTATION_NAMES

    assert IMPLEMENTATION_NAMES["triton"] in labels
    assert any("spec-sheet peak, 4.8 TB/s" in t for t in labels)
    assert any("not a limit" in t for t in labels)


# ----------------------------------------------------------------- waiting (a real engine run)
def serve_recording_queue(llm, arrivals):
    """Add ``{step: [prompt token ids]}`` at their steps, run to the end; returns the arrival
    step of each request and the engine's own count of waiting requests before each step."""
    arrival_steps, waiting_before, step = {}, {}, 0
    while llm.has_unfinished_requests() or step <= max(arrivals):
        for ids in arrivals.get(step, []):
            rid = llm.add_request(prompt_token_ids=ids, sampling_params=SamplingParams(max_tokens=6, ignore_eos=True))
            arrival_steps[rid] = step
        waiting_before[step] = llm.stats()["num_requests_waiting"]
        llm.step()
        step += 1
    return arrival_steps, waiting_before


@pytest.mark.parametrize("config, arrivals, reason", [
    (dict(max_num_seqs=1), {0: [[5] * 6, [6] * 6]}, "rows"),                         # one row for two requests
    (dict(max_num_batched_tokens=8), {0: [list(range(3, 23))], 1: [[7] * 4]}, "budget"),  # a 20-token prompt, 8 a step
    (dict(num_blocks=7), {0: [list(range(3, 22))], 1: [list(range(30, 40))]}, "pool"),  # 5 of 7 blocks taken
], ids=["rows", "budget", "pool"])
def test_waits_name_what_kept_a_request_out_and_match_the_engines_queue(fleet_model, config, arrivals, reason):
    engine = {**dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=64, record_traces=True), **config}
    llm = LLM(fleet_model, **engine)
    try:
        arrival_steps, waiting_before = serve_recording_queue(llm, arrivals)
        waits = viz.queue_waits(llm.traces, arrival_steps, llm.config)
    finally:
        llm.handle.unpatch()
    for step, count in waiting_before.items():  # the queue the waits describe is the engine's own
        assert len(viz.queue_before(waits, step)) == count, (step, viz.queue_before(waits, step), count)
    second = next(w for w in waits if w.request_id == "1")
    assert second.reasons and set(second.reasons.values()) == {reason}, second
    first_run = min(t.step for t in llm.traces for r in t.rows if r.request_id == "1")
    assert second.end == first_run and second.steps == list(range(second.start, first_run))
    assert reason in second.describe() or viz.WAIT_REASONS[reason] in second.describe()
    fig = viz.draw_timeline(llm.traces, waits=waits)
    bars = by_gid(fig.axes[0].patches, "wait:1:")
    assert {g.rsplit(":", 1)[1] for g in bars} == {reason} and len(bars) == len(second.reasons)
    assert by_gid(fig.axes[0].lines, "arrived:1:")


def test_a_preempting_step_admits_nobody_and_waits_say_so(engine_traces):
    traces, _ = engine_traces
    preempting = [t for t in traces if t.preempted]
    assert preempting
    config = type("Config", (), dict(max_num_seqs=4, max_num_batched_tokens=16, enable_chunked_prefill=True))
    assert all(viz.blocked_by(t, config) == "preemption" for t in preempting)
    waits = viz.queue_waits(traces, {}, config)  # no arrivals given: only stays after preemptions
    preemption_steps = sorted(t.step for t in preempting for _ in t.preempted)
    assert [w.start for w in waits] == [p + 1 for p in preemption_steps] and all(w.after_preemption for w in waits)


# ----------------------------------------------------------------- static strips and player frames
def test_reorder_strip_shows_every_frame_with_its_moves():
    batch = InputBatch(max_num_seqs=5, max_model_len=32, max_blocks_per_seq=4)
    for rid, n, generated in (("a", 3, 0), ("b", 4, 1), ("c", 2, 0), ("d", 5, 2), ("e", 3, 1)):
        batch.add_request(rid, range(3, 3 + n), output_token_ids=[9] * generated,
                          num_computed_tokens=n + generated - 1 if generated else 0, block_ids=[0])
    batch.remove_request("c")
    batch.set_num_scheduled({"a": 3, "b": 1, "d": 1, "e": 1})
    frames = viz.reorder_frames(batch)
    fig = viz.draw_reorder_strip(frames)
    assert len(fig.axes) == len(frames) >= 3
    for i, frame in enumerate(frames):
        cells = by_gid(fig.axes[i].patches, f"strip:{i}:")
        assert len(cells) == len(frame.records)
        assert {int(g.rsplit(":", 1)[1]) for g, p in cells.items() if p.get_linewidth() > 2} == set(frame.moved)
    assert "a p3" in [t.get_text() for t in fig.axes[0].texts]
    assert len(viz.draw_reorder_strip(frames, [0, len(frames) - 1]).axes) == 2
    with pytest.raises(ValueError, match="outside"):
        viz.draw_reorder_strip(frames, [len(frames)])


def test_pool_strip_and_step_frames_tell_each_steps_story(fleet_model):
    llm = LLM(fleet_model, block_size=4, num_blocks=10, max_num_batched_tokens=16, max_num_seqs=3,
              record_traces=True)
    prompts = [[5] * 9, [5] * 9 + [6, 7], list(range(10, 19))]
    frames = []
    try:
        for ids in prompts:
            llm.add_request(prompt_token_ids=ids, sampling_params=SamplingParams(max_tokens=8, ignore_eos=True))
        while llm.has_unfinished_requests():
            llm.step()
            frames.append(viz.pool_frame(llm))
    finally:
        llm.handle.unpatch()
    traces = llm.traces
    waits = viz.queue_waits(traces, {"0": 0, "1": 0, "2": 0}, llm.config)
    shared = next(a for a in viz.admissions(traces, 4) if a.cached_block_ids)
    steps = [t.step for t in traces][:4]
    fig = viz.draw_pool_strip(traces, steps, frames, waits=waits, per_row=2)
    assert [ax.get_gid() for ax in fig.axes if ax.get_visible()] == [f"pool-step:{s}" for s in steps]
    one = viz.draw_pool_step(traces, shared.step, frames, waits=waits)
    assert {p.get_gid() for p in one.axes[0].patches if (p.get_gid() or "").startswith("revived:")} == {
        f"revived:{b}" for b in shared.cached_block_ids}
    story = viz.step_story(traces, shared.step, block_size=4, waits=waits)
    assert story[0] == viz.describe_step(traces[shared.step]) and "prefix cache" in " ".join(story)
    assert one.get_layout_engine() is None  # a player frame is drawn once, without a layout engine
    with pytest.raises(ValueError, match="no pool frame"):
        viz.draw_pool_step(traces, traces[-1].step, frames[:1])


def test_time_frames_measures_each_frame_and_puts_the_slider_back():
    drawn = []

    def frame(i):
        drawn.append(i)
        fig = Figure(figsize=(2, 1))
        fig.add_subplot().plot([0, i])
        return fig

    live = viz.player(frame, 4, start=2)
    seconds = viz.time_frames(live, [0, 2, 3])
    assert len(seconds) == 3 and all(s > 0 for s in seconds)
    assert drawn[1:4] == [0, 2, 3] and live.slider.value == 2 and live.last_frame_s > 0
    assert viz.figure_png(live.figure)[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------- source excerpts
def test_source_excerpt_is_numbered_as_in_its_file():
    from pathlib import Path

    import fleetlab

    loop = viz.source_excerpt("_decode_kernel", "fleetlab.attention.triton_kernels", start="m = tl.full",
                              stop="_online_softmax(")
    lines = (Path(fleetlab.__file__).parents[1] / loop.path).read_text().splitlines()
    assert loop.path == "fleetlab/attention/triton_kernels.py"
    assert lines[loop.first_line - 1: loop.last_line] == loop.lines
    assert loop.lines[0].strip().startswith("m = tl.full") and "_online_softmax(" in loop.lines[-1]
    text = str(loop)
    assert text.splitlines()[0].startswith(f"# {loop.path}, lines {loop.first_line}-{loop.last_line}")
    assert text.splitlines()[1].lstrip().startswith(str(loop.first_line))
    body = viz.source_excerpt("_online_softmax", "fleetlab.attention.triton_kernels", body_only=True)
    assert '"""' not in str(body) and "def " not in str(body) and body.lines[-1].strip().startswith("return")
    with pytest.raises(ValueError, match="not found in _decode_kernel"):
        viz.source_excerpt("_decode_kernel", "fleetlab.attention.triton_kernels", start="no such line")
    with pytest.raises(ValueError, match="no function"):
        viz.source_excerpt("missing", "fleetlab.attention.naive")


# ----------------------------------------------------------------- why a KV cache (notebook 00)
def test_attention_pattern_and_cost_drawings():
    fig = viz.draw_attention_pattern(list("abcd"))
    cells = by_gid(fig.axes[0].patches, "attn:")
    assert len(cells) == 10 and "attn:0:1" not in cells  # causal: no query reads a later key
    assert face(cells["attn:3:3"]) != face(cells["attn:3:0"]) != face(cells["attn:2:0"])
    seconds = np.array([[0.010, 0.012, 0.020], [0.011, 0.013, 0.030]])
    passes = viz.draw_pass_cost([1, 8, 64], seconds)
    line = by_gid(passes.axes[0].lines, "pass")["pass"]
    assert list(line.get_ydata()) == pytest.approx([10, 12, 20])  # the fastest run, in ms
    per_token = by_gid(passes.axes[1].lines, "per-token")["per-token"]
    assert list(per_token.get_ydata()) == pytest.approx([10, 1.5, 20 / 64])
    cost = viz.draw_cache_cost([3, 4, 5], [3, 1, 1], [4, 8], seconds[:, :2], [5, 6], seconds[:, 1:])
    work = by_gid(cost.axes[0].lines, "work:")
    assert list(work["work:no-cache"].get_ydata()) == [3, 4, 5] and list(work["work:cached"].get_ydata()) == [3, 1, 1]
    assert set(by_gid(cost.axes[1].lines, "time:")) == {"time:no-cache", "time:cached"}


# ----------------------------------------------------------------- repeated runs
def test_latency_bars_over_repeated_runs_show_the_median_and_the_spread():
    from fleetlab.inspect.latency import LatencyStats, Percentiles

    def stats(ms, steps):
        p = Percentiles(ms, ms, ms, ms, 3)
        s = Percentiles(steps, steps, steps, steps, 3)
        return LatencyStats((), p, p, s, s)

    fig = viz.draw_latency({"a": [stats(0.010, 4.0), stats(0.030, 4.0), stats(0.020, 4.0)], "b": stats(0.005, 2.0)})
    bars = {g: p for ax in fig.axes for g, p in by_gid(ax.patches, "").items()}
    assert bars["ttft_s:a:p50"].get_height() == pytest.approx(20.0) and bars["ttft_steps:a:p50"].get_height() == 4
    spreads = {a.get_gid() for ax in fig.axes for a in ax.collections if a.get_gid()}  # whiskers
    assert "spread:ttft_s:a:p50" in spreads and not any(g.startswith("spread:ttft_steps") for g in spreads)
    assert not any(":b:" in g for g in spreads) and "median of 1/3 runs" in fig._suptitle.get_text()


def test_run_comparison_draws_each_configuration_at_its_best_run_with_the_range():
    def run(name, wall, cpu):
        return viz.RunRecord(name, wall, 100, [wall], 10, cpu)

    runs = [run("x", 2.0, 1.8), run("y", 1.0, 0.9), run("x", 1.0, 1.2), run("y", 2.0, 1.5)]
    assert {n: r.wall_s for n, r in viz.fastest_runs(runs).items()} == {"x": 1.0, "y": 1.0}
    fig = viz.draw_run_comparison(runs)
    assert len(fig.axes) == 4
    assert by_gid(fig.axes[0].patches, "throughput:")["throughput:x"].get_height() == pytest.approx(100.0)
    assert by_gid(fig.axes[1].patches, "cpu:")["cpu:y"].get_height() == pytest.approx(0.9)
    ranges = {a.get_gid() for ax in fig.axes for a in ax.collections if a.get_gid()}  # whiskers
    assert {"range:throughput:x", "range:cpu:x", "range:throughput:y", "range:cpu:y"} <= ranges


def test_row_usage_names_each_request_where_it_enters_its_row(traces):
    fig = viz.draw_row_usage(traces, 3)
    entered = {t.get_gid() for t in fig.axes[0].texts if (t.get_gid() or "").startswith("enters:")}
    assert entered == {"enters:a:0", "enters:b:0", "enters:c:1"}


def test_shard_plan_labels_every_band_of_a_replicated_kv_head_and_the_mlp_columns():
    from fleetlab.distributed import plan_shards
    from fleetlab.lab.viz import tp as tpviz

    plan = plan_shards(num_heads=8, num_kv_heads=2, head_dim=16, intermediate_size=128, tp_size=4)
    ax = tpviz.draw_shard_plan([plan]).axes[0]
    labels = {t.get_gid(): t for t in ax.texts if t.get_gid()}
    kv0 = [labels[f"label:KV heads (cached):0:{r}"] for r in (0, 1)]
    assert [t.get_text() for t in kv0] == ["0", "0"] and kv0[0].get_position()[1] != kv0[1].get_position()[1]
    assert labels["label:MLP columns (gate, up; down rows):7:3"].get_text() == "112-127"
    assert [labels[f"label:QKV columns [q | k | v]:9:{r}"].get_text() for r in (2, 3)] == ["k1", "k1"]
