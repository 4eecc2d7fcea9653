"""fleetlab.lab.viz.spec on the Agg backend: what each speculative-decoding drawing puts on its
figure, checked on hand-built traces and batches and on a real engine run."""

import numpy as np
import pytest
from matplotlib.colors import to_hex
from matplotlib.figure import Figure

from fleetlab import LLM, InputBatch, SamplingParams, viz
from fleetlab.engine.batch_fields import DEFAULT_FIELDS
from fleetlab.inspect.recorder import RowTrace, StepTrace
from fleetlab.lab.viz._style import ALERT_COLOR
from fleetlab.lab.viz.spec import TOKEN_KINDS
from fleetlab.spec_decode.proposer_batch import NAMES, ProposerInputBatch, proposer_fields


def by_gid(artists, prefix):
    return {a.get_gid(): a for a in artists if a.get_gid() and a.get_gid().startswith(prefix)}


def step(n, rows):
    return StepTrace(step=n, rows=rows, order_before=[r.request_id for r in rows],
                     order_after=[r.request_id for r in rows], num_decodes=0, reordered=False,
                     tokens={r.request_id: r.token_ids for r in rows}, preempted=[], finished=[], num_free_blocks=0,
                     num_blocks=8, num_batched_tokens=sum(r.num_scheduled_tokens for r in rows))


def row(rid, phase, drafts=(), accepted=0, kept=(), scheduled=None):
    drafts = list(drafts)
    return RowTrace(rid, phase, scheduled or len(drafts) + 1, 0, 4, [0], draft_token_ids=drafts,
                    num_accepted_tokens=accepted, token_ids=list(kept))


@pytest.fixture()
def spec_traces():
    """Request a: prefill (token 10), all 3 drafts accepted + bonus, then 1 of 3 accepted +
    recovered, then drafts accepted past a stop (EOS 2). Request b: two prompt chunks, the
    first keeping nothing, then a decode with no drafts."""
    return [
        step(0, [row("a", "prefill", kept=[10], scheduled=4), row("b", "prefill", scheduled=3)]),
        step(1, [row("a", "decode", [11, 12, 13], 3, [11, 12, 13, 14]), row("b", "prefill", kept=[20], scheduled=2)]),
        step(2, [row("a", "decode", [15, 16, 17], 1, [15, 30]), row("b", "decode", kept=[21])]),
        step(3, [row("a", "decode", [2, 40, 41], 3, [2])]),
    ]


def test_verify_rows_classify_every_draft_and_the_targets_token(spec_traces):
    rows = viz.verify_rows(spec_traces)
    a = [r for r in rows if r.request_id == "a"]
    assert [[k for _, k in r.cells] for r in a] == [
        ["sampled"], ["accepted"] * 3 + ["bonus"], ["accepted", "rejected", "rejected", "recovered"],
        ["accepted", "dropped", "dropped"]]
    assert a[2].cells[-1] == (30, "recovered") and a[2].num_drafts == 3 and a[2].num_accepted == 1
    assert [r.start for r in a] == [0, 1, 5, 7] and a[3].previous == [10, 11, 12, 13, 14, 15, 30]
    b = [r for r in rows if r.request_id == "b"]
    assert [r.step for r in b] == [1, 2]  # the chunk that kept nothing is skipped
    assert viz.verify_rows(spec_traces, request_ids=["b"]) == b


def test_request_forwards_count_every_scheduled_step(spec_traces):
    costs = viz.request_forwards(spec_traces)
    assert (costs["a"].num_forwards, costs["a"].num_tokens) == (4, 8)
    assert (costs["b"].num_forwards, costs["b"].num_tokens) == (3, 2)
    assert costs["a"].forwards_per_token == pytest.approx(0.5)


def test_step_lines_draw_one_cell_per_token_and_strike_rejections(spec_traces):
    fig = viz.draw_spec_steps(spec_traces, prompts={"a": "hi"}, title="t")
    ax_a, ax_b = fig.axes[:2]
    cells = by_gid(ax_a.patches, "cell:a:")
    assert len(by_gid(ax_a.patches, "cell:a:2:")) == 5 + 4  # 5 earlier tokens, then 1 + 2 rejected + recovered
    assert to_hex(cells["cell:a:2:5:accepted"].get_facecolor()) == TOKEN_KINDS["accepted"]
    # the recovered token takes the first rejected draft's slot (6), drawn under that draft
    recovered, rejected = cells["cell:a:2:6:recovered"], cells["cell:a:2:6:rejected"]
    assert to_hex(recovered.get_facecolor()) == TOKEN_KINDS["recovered"]
    assert recovered.get_x() == rejected.get_x() and recovered.get_y() < rejected.get_y()
    assert "cell:a:2:7:rejected" in cells and not any(g.startswith("cell:a:2:8:") for g in cells)
    assert cells["cell:a:3:8:dropped"].get_hatch() == "///"
    assert len([ln for ln in ax_a.lines]) == 2  # one strike per rejected draft
    assert ax_a.get_title(loc="left").startswith("request a: 'hi' -> 8 tokens in 4 target forwards")
    assert [t.get_text() for t in ax_b.get_yticklabels()] == ["step 1", "step 2"]
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert len(legend) == 6 and fig._suptitle.get_text() == "t"
    short = viz.draw_spec_steps(spec_traces, request_ids=["a"], max_previous=2)
    assert len(by_gid(short.axes[0].patches, "cell:a:3:")) == 2 + 3
    with pytest.raises(ValueError, match="no step"):
        viz.draw_spec_steps([step(0, [row("c", "prefill", scheduled=3)])])


def test_token_labels():
    from fleetlab.models.tokenizer import CharTokenizer

    tok = CharTokenizer()
    assert [viz.token_label(t, tok) for t in tok.encode(" a", add_bos=False) + [2]] == ["␣", "a", "eos"]
    assert viz.token_label(7) == "7"


# ----------------------------------------------------------------- lockstep
def lockstep_batches(k=2):
    fields = DEFAULT_FIELDS.copy()
    for field in proposer_fields(k):
        fields.register(field)
    batch = InputBatch(max_num_seqs=5, max_model_len=32, max_blocks_per_seq=8, fields=fields)
    follower = ProposerInputBatch(batch)
    for rid, n, generated in (("a", 5, 2), ("b", 6, 0), ("c", 4, 1), ("d", 3, 2)):
        r = batch.add_request(rid, range(3, 3 + n), output_token_ids=[9] * generated,
                              num_computed_tokens=n + generated - 1 if generated else 0, block_ids=[0, 1, 2])
        if generated:
            batch.set_spec_tokens(rid, [7] * k)
            follower.set_drafts(r, [7] * k)
            follower.num_computed_tokens[r] = n + generated + k - 1
    batch.remove_request("c")
    batch.set_num_scheduled({"a": k + 1, "b": 6, "d": k + 1})
    return batch, follower


def test_lockstep_rows_pair_both_batches_and_the_drawing_shows_the_moves():
    batch, follower = lockstep_batches()
    before = viz.lockstep_rows(batch, follower, decode_threshold=3)
    assert [(r.req_id, r.proposer_req_id, r.phase) for r in before] == [
        ("a", "a", "decode"), ("b", "b", "prefill"), (None, None, "empty"), ("d", "d", "decode")]
    assert (before[0].num_spec_tokens, before[0].draft_num_computed_tokens, before[0].draft_token_ids) == (2, 8, [7, 7])
    batch.condense()
    _, num_decodes = batch.reorder_split_prefill_and_decode(3)
    after = viz.lockstep_rows(batch, follower, decode_threshold=3)
    assert [r.req_id for r in after] == ["a", "d", "b"] and all(r.in_step for r in after)
    fig = viz.draw_lockstep(before, after, num_decodes=num_decodes)
    assert set(by_gid(fig.artists, "move:")) == {"move:main:d", "move:main:b", "move:proposer:d", "move:proposer:b"}
    assert "2 rows moved" in fig.axes[1].get_title() and "2 rows moved" in fig.axes[3].get_title()
    moved = by_gid(fig.axes[3].patches, "proposer-after:")
    assert to_hex(moved["proposer-after:1"].get_edgecolor()) == ALERT_COLOR
    assert "req d  draft KV 6  drafts [7,7]" in [t.get_text() for t in fig.axes[3].texts]


def test_a_broken_lockstep_is_drawn_in_red():
    batch, follower = lockstep_batches()
    batch.condense()
    apart = {name: follower.np(name).copy() for name in NAMES}  # a proposer state kept in buffers of its own
    apart["req_id"][0] = "zz"  # what a forgotten move would do to them
    rows = viz.lockstep_rows(batch, type("Apart", (), {"np": lambda self, name: apart[name],
                                                            "reach": lambda self: apart["num_computed_tokens"]})())
    assert not rows[0].in_step
    fig = viz.draw_lockstep(None, rows, title="live")
    assert len(fig.axes) == 2 and "OUT OF STEP at rows [0]" in fig.axes[1].get_title()
    assert to_hex(by_gid(fig.axes[0].patches, "main-after:")["main-after:0"].get_edgecolor()) == ALERT_COLOR


# ----------------------------------------------------------------- k sweep, histograms, benchmark figure
def sweep_runs():
    return [{"k": k, "acceptance_rate": 1 - 0.1 * k, "acceptance_by_position": [1 - 0.1 * i for i in range(k)],
             "forwards_per_token": 1 / (1 + k)} for k in (1, 2, 3)]


def test_sweep_highlights_the_chosen_k_and_draws_the_baseline():
    fig = viz.draw_spec_sweep(sweep_runs(), {"forwards_per_token": 1.0}, k=2)
    ax_pos, ax_acc, ax_fwd = fig.axes
    assert len(by_gid(ax_pos.patches, "position:")) == 2
    sizes = {ln.get_gid(): ln.get_markersize() for ln in ax_fwd.lines if ln.get_gid()}
    assert sizes["forwards:2"] > sizes["forwards:1"] == sizes["forwards:3"]
    lines = by_gid(ax_fwd.lines, "")
    assert lines["baseline"].get_ydata()[0] == 1.0 and lines["half"].get_ydata()[0] == 0.5
    assert set(by_gid(ax_acc.lines, "acceptance:")) == {"acceptance:1", "acceptance:2", "acceptance:3"}
    with pytest.raises(ValueError, match="k=9"):
        viz.draw_spec_sweep(sweep_runs(), k=9)


def test_token_histogram_counts_pools_and_tests():
    p = np.array([0.5, 0.3, 0.195, 0.005])
    rng = np.random.default_rng(0)
    good = rng.choice(4, size=4000, p=p).tolist()
    bad = [0] * 4000
    hist = viz.token_histogram({"good": good, "bad": bad}, p)
    assert hist.token_ids == [0, 1, 2, -1]
    assert hist.counts["good"].sum() == 4000 and hist.counts["bad"].tolist() == [4000, 0, 0, 0]
    stat, dof, crit = hist.chi_square["good"]
    assert stat < crit and dof == 3  # four categories: the pooled one expects 20 samples, enough to keep
    assert hist.chi_square["bad"][0] > 100 * hist.chi_square["bad"][2]
    fig = viz.draw_token_histogram(hist)
    bars = by_gid(fig.axes[0].patches, "bar:")
    assert len(bars) == 3 * 4 and bars["bar:target:0"].get_height() == pytest.approx(0.5)
    assert bars["bar:bad:0"].get_height() == 1.0
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()][-1] == "other"


def bench_result():
    def run(method, k, fpt, steps, speedup, acc=0.0):
        return {"name": "off" if method == "off" else f"{method} k={k}", "method": method, "k": k,
                "forwards_per_token": fpt, "forwards_per_token_by_request": [fpt, fpt], "num_steps": steps,
                "speedup": speedup, "acceptance_rate": acc}
    return {"config": {"headline_k": 2}, "workloads": {
        "trained": {"runs": [run("off", 0, 1.0, 20, 1.0), run("draft", 1, 0.6, 12, 0.9, 0.9),
                             run("draft", 2, 0.4, 9, 0.8, 0.8), run("ngram", 2, 0.9, 18, 1.05, 0.1)]},
        "repetitive": {"runs": [run("off", 0, 1.0, 30, 1.0), run("ngram", 2, 0.6, 20, 1.2, 0.6)]}}}


def test_benchmark_figure_draws_the_headline_k_and_the_curves():
    fig = viz.draw_spec_benchmark(bench_result())
    ax_fwd, ax_acc, ax_steps, ax_speed = fig.axes
    bars = by_gid(ax_fwd.patches, "forwards:")
    assert set(bars) == {"forwards:trained:off", "forwards:trained:draft k=2", "forwards:trained:ngram k=2",
                         "forwards:repetitive:off", "forwards:repetitive:ngram k=2"}
    assert bars["forwards:trained:draft k=2"].get_height() == 0.4
    goal = by_gid(ax_fwd.collections, "goal:")
    assert set(goal) == {"goal:trained", "goal:repetitive"}
    assert goal["goal:trained"].get_segments()[0][0][1] == 0.5
    draft = by_gid(ax_acc.lines, "acceptance:draft, trained")["acceptance:draft, trained"]
    assert list(draft.get_xdata()) == [1, 2] and list(draft.get_ydata()) == [0.9, 0.8]
    assert set(by_gid(ax_steps.lines, "steps-off:")) == {"steps-off:trained", "steps-off:repetitive"}
    assert len(by_gid(ax_speed.lines, "speedup:")) == 3


# ----------------------------------------------------------------- a real run
def test_drawn_steps_of_a_real_ngram_run_add_up_to_its_outputs(fleet_model):
    prompts = [[5, 9, 14, 5, 9, 14, 5, 9], [30, 31, 30, 31, 30]]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    with LLM(fleet_model, block_size=4, record_traces=True, speculative_config=spec) as llm:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=12, ignore_eos=True),
                            use_tqdm=False)
        stats = llm.stats()
    rows = viz.verify_rows(llm.traces)
    for out in outs:
        mine = [r for r in rows if r.request_id == out.request_id]
        kept = [t for r in mine for t, k in r.cells if k in ("sampled", "accepted", "recovered", "bonus")]
        assert kept == out.token_ids == mine[-1].previous + mine[-1].kept
    assert sum(r.num_drafts for r in rows) == stats["num_draft_tokens"] > 0
    assert sum(r.num_accepted for r in rows) == stats["num_accepted_tokens"]
    costs = viz.request_forwards(llm.traces)
    assert sum(c.num_tokens for c in costs.values()) == sum(len(o.token_ids) for o in outs)
    assert len(viz.draw_spec_steps(llm.traces).axes) == 2


def test_lockstep_rows_can_show_the_proposer_as_the_step_began():
    """After a step the main batch holds its counts as the step began; the proposer's state
    taken before the step puts its half of each row at the same moment, by request."""
    batch, follower = lockstep_batches()
    began = viz.draft_state(follower)
    assert began == {"a": (8, [7, 7]), "b": (0, []), "d": (6, [7, 7])}
    follower.set_drafts(0, [5, 5])  # what drafting in the step would write
    follower.num_computed_tokens[0] = 11
    batch.condense()
    batch.reorder_split_prefill_and_decode(3)
    now = {r.req_id: (r.draft_num_computed_tokens, r.draft_token_ids) for r in viz.lockstep_rows(batch, follower, 3)}
    assert now["a"] == (11, [5, 5])
    rows = viz.lockstep_rows(batch, follower, 3, proposer_state=began)
    assert [(r.req_id, r.draft_num_computed_tokens, r.draft_token_ids) for r in rows] == [
        ("a", 8, [7, 7]), ("d", 6, [7, 7]), ("b", 0, [])]
    strip = Figure(figsize=(13, 4), layout="constrained")
    panels = strip.subfigures(2, 1)
    for panel in panels:
        assert viz.draw_lockstep(None, rows, fig=panel, title="frame") is panel
    assert len(strip.axes) == 4
