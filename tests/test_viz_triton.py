"""The Triton benchmark's launch-cost figure, drawn from a results dict of the benchmark's layout."""

from fleetlab.lab.viz.triton import draw_launch_costs

ROW = {"batch": 4, "context": 4096, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128}
RESULTS = {
    "environment": {"device": "NVIDIA H200"},
    "decode_issue_shapes": [ROW | {"triton_host_us": 21.8, "layer_host_us": 28.9, "sdpa_host_us": 40.4,
                                   "before_host_us": 85.4},
                            ROW | {"batch": 1, "context": 3000, "triton_host_us": 15.0, "layer_host_us": "error"}],
    "decode_step": [ROW | {"prefill_chunk": 0, "num_layers": 32, "eager_step_ms": 1.04, "graph_step_ms": 0.91},
                    ROW | {"prefill_chunk": 512, "num_layers": 32, "eager_step_ms": 4.2, "graph_step_ms": 4.0}],
}


def _gids(fig):
    return {p.get_gid() for ax in fig.axes for p in ax.patches if p.get_gid()}


def test_launch_costs_draw_every_clock_a_row_has_and_both_step_clocks():
    fig = draw_launch_costs(RESULTS)
    gids = _gids(fig)
    assert {"host:4×4k 32/8 d128:triton_host_us", "host:4×4k 32/8 d128:sdpa_host_us",
            "host:4×4k 32/8 d128:before_host_us", "host:1×3000 32/8 d128:triton_host_us"} <= gids
    assert not any(g.startswith("host:1×3000") and g.endswith("layer_host_us") for g in gids)  # not a number
    assert {"step:4×4k:eager", "step:4×4k:graph", "step:4×4k+512:eager"} <= gids
    heights = {p.get_gid(): p.get_height() for ax in fig.axes for p in ax.patches}
    assert heights["step:4×4k:graph"] == 0.91 and heights["host:4×4k 32/8 d128:layer_host_us"] == 28.9


def test_launch_costs_skip_results_without_their_sections():
    assert draw_launch_costs({"decode_bandwidth": []}) is None
