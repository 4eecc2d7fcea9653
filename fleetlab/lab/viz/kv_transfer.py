"""KV beyond one engine: a connector's calls in a step, per layer; the prefill/decode handshake.

:func:`draw_connector_calls` draws the records a recording connector kept (a list of
``(call, layer, block_ids)``, one per call, in call order); :func:`draw_handshake` the messages
of the ``paddle_distributed`` connector between a decode rank and a prefill rank;
:func:`draw_pool_use` the blocks in use per step of several engines' traces.
"""

from __future__ import annotations

from matplotlib.figure import Figure

from fleetlab.lab.viz._style import request_color

CALL_ROWS = ["get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "start_load_kv",
             "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished", "request_finished"]


def draw_connector_calls(panels: dict[str, list[tuple]], num_layers: int) -> Figure:
    """One panel per engine: each call a mark at (call order, call name); a per-layer call that
    moved blocks is labelled with its layer and the block ids it moved (gid ``call:NAME:LAYER``)."""
    fig = Figure(figsize=(11, 2.6 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (title, records) in zip(axes, panels.items()):
        for i, (call, layer, blocks) in enumerate(records):
            y = CALL_ROWS.index(call)
            moved = bool(blocks)
            color = request_color(layer) if layer is not None else "0.4"
            (mark,) = ax.plot([i], [y], "s" if moved else "o", ms=9 if moved else 5,
                              color=color if moved else "0.6", mec="k" if moved else "none")
            mark.set_gid(f"call:{call}:{'' if layer is None else layer}")
            if moved:
                ax.annotate(f"L{layer}: {blocks}", (i, y), xytext=(0, 7), textcoords="offset points",
                            fontsize=7, ha="center")
        ax.set_yticks(range(len(CALL_ROWS)), CALL_ROWS, fontsize=8)
        ax.set_ylim(len(CALL_ROWS) - 0.5, -0.8)
        ax.set_title(title, fontsize=10, loc="left")
        ax.grid(axis="y", color="0.92")
    axes[-1].set_xlabel(f"call order (a square: a layer's blocks moved; {num_layers} layers, block ids shown)")
    return fig


def draw_handshake(num_layers: int, num_requests: int = 1) -> Figure:
    """The ``paddle_distributed`` messages of one handshake, the decode rank's link thread left,
    the prefill rank right (the decode steps go on meanwhile; the stop comes once, at shutdown)."""
    fig = Figure(figsize=(8, 1.2 + 0.55 * (num_layers + 3)), layout="constrained")
    ax = fig.subplots()
    msgs = [("decode", f"handshake [1, n]: {num_requests} request(s): token ids + decode block ids", "tab:blue")]
    msgs += [("prefill", f"layer {i}: [req, {i}, count, status] + slots + K/V [2, count, H, D]", request_color(i))
             for i in range(num_layers)]
    msgs += [("decode", "stop (kind 0), at shutdown", "0.3"),
             ("prefill", "prefill pool [num_free_blocks, num_blocks]", "0.3")]
    for i, (sender, text, color) in enumerate(msgs):
        y = -(i + 1)
        x0, x1 = (0, 1) if sender == "decode" else (1, 0)
        ax.annotate("", (x1, y - 0.3), (x0, y), arrowprops=dict(arrowstyle="->", color=color, lw=1.6), gid=f"msg:{i}")
        ax.text(0.5, y - 0.05, text, ha="center", va="bottom", fontsize=8, color=color)
    for x, name in ((0, "decode rank (consumer): its link thread\nsends the block ids, collects the K/V"),
                    (1, "prefill rank (producer)\nruns the prompt, sends K/V per layer")):
        ax.plot([x, x], [-(len(msgs) + 0.8), 0], color="0.5", lw=2)
        ax.text(x, 0.15, name, ha="center", va="bottom", fontsize=9)
    ax.set_xlim(-0.25, 1.25)
    ax.set_ylim(-(len(msgs) + 1), 1.1)
    ax.set_axis_off()
    return fig


def draw_pool_use(traces: dict[str, list]) -> Figure:
    """Blocks in use at each step of each engine's ``llm.traces`` (gid ``pool:NAME``)."""
    fig = Figure(figsize=(8, 3), layout="constrained")
    ax = fig.subplots()
    for i, (name, ts) in enumerate(traces.items()):
        used = [t.num_blocks - t.num_free_blocks for t in ts]
        ax.plot(range(len(used)), used, marker="os^"[i % 3], ls=("-", "--", ":")[i % 3], lw=4 - 1.2 * i,
                alpha=0.8, label=name, gid=f"pool:{name}")
    ax.set_xlabel("engine step")
    ax.set_ylabel("blocks in use (after the step)")
    ax.legend(fontsize=8)
    return fig


LANES = [("one engine", "one engine (chunked prefill)"), ("pair", "pair: decode rank"),
         ("prefill rank", "pair: prefill rank")]


def draw_timelines(timeline: dict) -> Figure:
    """Each engine's steps on one time axis (``bench kv``'s ``mixed["timeline"]``): a bar per
    step from its start to its end, orange if it ran prompt tokens, blue if decode rows only,
    hatched on the decode rank while a request waited there for its K/V (gid
    ``steps:LANE:prompt|decode``); a long prompt's arrival a triangle, its first token a star
    (gids ``arrive:LANE``, ``first:LANE``)."""
    fig = Figure(figsize=(11, 3.2), layout="constrained")
    ax = fig.subplots()
    for y, (key, _) in enumerate(reversed(LANES)):
        run = timeline.get(key, {})
        for kind, color in (("prompt", "tab:orange"), ("decode", "tab:blue")):
            steps = [s for s in run.get("timeline", []) if (s[2] > 0) == (kind == "prompt")]
            bars = ax.broken_barh([(a, b - a) for a, b, *_ in steps], (y - 0.35, 0.7), facecolors=color,
                                  edgecolors="white", linewidth=0.4, gid=f"steps:{key}:{kind}")
            bars.set_hatch(None)
        held = [s for s in run.get("timeline", []) if s[4] > 0]
        if held:
            ax.broken_barh([(a, b - a) for a, b, *_ in held], (y - 0.35, 0.7), facecolors="none",
                           edgecolors="0.2", hatch="///", linewidth=0, gid=f"held:{key}")
        longs = sorted(r for r in run.get("arrive_ms", {}) if r.startswith("l"))
        if longs:
            ax.plot([run["arrive_ms"][r] for r in longs], [y + 0.45] * len(longs), "v", color="k", ms=7,
                    gid=f"arrive:{key}")
            ax.plot([run["first_token_ms"][r] for r in longs], [y + 0.45] * len(longs), "*", color="tab:red", ms=10,
                    gid=f"first:{key}")
    ax.set_yticks(range(len(LANES)), [label for _, label in reversed(LANES)])
    ax.set_ylim(-0.6, len(LANES) - 0.2)
    ax.set_xlabel("ms since the short requests arrived")
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color="tab:orange", label="step runs prompt tokens"),
                       Patch(color="tab:blue", label="decode rows only"),
                       Patch(facecolor="none", edgecolor="0.2", hatch="///", label="a request waits for its K/V"),
                       Line2D([], [], marker="v", color="k", ls="", label="long prompt arrives"),
                       Line2D([], [], marker="*", color="tab:red", ls="", ms=10, label="its first token")],
              fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=5, frameon=False)
    return fig


PATH_PARTS = (("wait", "0.75", "waits for the prefill rank"), ("prefill", "tab:orange", "its prompt's step there"),
              ("transfer", "tab:blue", "K/V in flight, then the next decode step"),
              ("join", "tab:green", "the decode step that takes it in"))


def draw_request_paths(paths: dict) -> Figure:
    """Each long prompt's way through a prefill/decode pair on one time axis (``collect``'s
    ``long_requests``: ms of ``arrive``, ``prefill`` [start, end], ``join`` [start, end],
    ``first_token``): waiting for the prefill rank, its step there (its K/V sent layer by layer
    inside it), the K/V in flight until the decode rank's next step, that step, and the first
    token (a star). One row per request, gids ``path:PART:RID`` and ``first:RID``."""
    fig = Figure(figsize=(9, 0.5 + 0.45 * max(1, len(paths))), layout="constrained")
    ax = fig.subplots()
    rids = sorted(paths, key=lambda r: paths[r]["arrive"])
    for y, rid in enumerate(reversed(rids)):
        p = paths[rid]
        edges = {"wait": (p["arrive"], p["prefill"][0]), "prefill": tuple(p["prefill"]),
                 "transfer": (p["prefill"][1], p["join"][0]), "join": tuple(p["join"])}
        for part, color, _ in PATH_PARTS:
            a, b = edges[part]
            ax.broken_barh([(a, max(b - a, 0.0))], (y - 0.3, 0.6), facecolors=color, gid=f"path:{part}:{rid}")
        ax.plot([p["first_token"]], [y], "*", color="tab:red", ms=11, gid=f"first:{rid}")
    ax.set_yticks(range(len(rids)), list(reversed(rids)))
    ax.set_xlabel("ms since the short requests arrived")
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=c, label=label) for _, c, label in PATH_PARTS]
              + [Line2D([], [], marker="*", color="tab:red", ls="", ms=10, label="first token")],
              fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=5, frameon=False)
    return fig
