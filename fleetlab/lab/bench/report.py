"""The engine benchmark's report: the README's markdown table and one PNG per figure,
both drawn from a ``bench.json`` result (schema in :mod:`fleetlab.lab.bench.engine`).

Kept apart from the measuring code so a stored result can be re-drawn without running
anything: ``write_plots(json.loads(path.read_text()), folder)``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure  # a bare Figure, not pyplot: no global backend switch, nothing left open

from fleetlab.engine.hooks import STEP_PHASES

# The parts of an engine step that ``StepTrace.timings`` records (plus "other", the rest).
STEP_KEYS = STEP_PHASES


def headline_table(result: dict) -> str:
    """The markdown table of a ``bench.json`` result: what ``bench engine`` prints and README shows."""
    tp, kv, px = result["throughput"], result["kv_memory"], result["prefix_caching"]
    wl = tp["workload"]
    lines = ["| figure | PaddleFormers generate | fleetlab `LLM` | ratio |", "|---|---|---|---|"]
    for i, e in enumerate(tp["models"]):
        a = e["agreement"]
        what = (f"{wl['num_requests']} requests, prompts {wl['prompt_len'][0]}-{wl['prompt_len'][1]}, "
                f"outputs {wl['output_len'][0]}-{wl['output_len'][1]}" if i == 0 else "same requests")
        lines.append(
            f"| output tok/s, Llama {e['num_params'] / 1e6:.1f}M params, {what} "
            f"| {e['paddleformers']['tokens_per_s']:.0f} (static batches of {tp['paddleformers_batch_size']}) "
            f"| {e['fleetlab']['tokens_per_s']:.0f} | **{e['speedup']:.2f}x** (CPU time {e['cpu_time_speedup']:.2f}x; "
            f"greedy tokens identical {a['identical_requests']}/{a['requests']}) |")
        if "fleetlab_overlap" in e:  # bench engine --async-scheduling
            lines.append(overlap_row(e, tp["paddleformers_batch_size"]))
    lines.append(f"| allocated KV memory holding real tokens | {100 * kv['padded']['token_fill']:.0f}% "
                 f"(padded batches) | {100 * kv['paged']['token_fill']:.0f}% (paged, block {kv['block_size']}) "
                 f"| reserving max length: {100 * kv['reserved']['token_fill']:.0f}% |")
    lines.append(f"| prefix caching, {px['workload']['num_requests']} requests sharing {px['workload']['prefix_len']} "
                 f"tokens, tok/s off / on | | {px['off']['tokens_per_s']:.0f} / {px['on']['tokens_per_s']:.0f} "
                 f"(hit rate {100 * px['on']['hit_rate']:.0f}%) | **{px['speedup']:.2f}x** |")
    for b in result["step_breakdown"]:
        ms = b["ms_per_step"]
        lines.append(f"| decode step at batch {b['batch_size']}: model forward / engine overhead | | "
                     f"{ms['forward']:.1f} ms / {ms['total'] - ms['forward']:.2f} ms "
                     f"| overhead {100 * b['overhead_share']:.1f}% |")
    return "\n".join(lines)


def overlap_row(e: dict, pf_batch: int) -> str:
    """The table row of one model's overlapped side (``LLM(async_scheduling=True)``)."""
    ov, a, paired = e["fleetlab_overlap"], e["overlap_agreement"], e["paired"]
    return (f"| same requests, fleetlab overlapped (`async_scheduling=True`) "
            f"| {e['paddleformers']['tokens_per_s']:.0f} (static batches of {pf_batch}) | {ov['tokens_per_s']:.0f} "
            f"| **{e['overlap_speedup']:.2f}x** (CPU time {e['overlap_cpu_time_speedup']:.2f}x; round by round "
            f"{paired['overlap_speedup_median']:.2f}x, synchronous {paired['speedup_median']:.2f}x; "
            f"greedy tokens identical {a['identical_requests']}/{a['requests']}) |")


def write_plots(result: dict, out: Path) -> list[str]:
    """One PNG per figure in ``out``; returns the file names."""
    names = []
    for name, draw in (("throughput.png", _plot_throughput), ("kv_memory.png", _plot_kv_memory),
                       ("prefix_caching.png", _plot_prefix_caching), ("step_breakdown.png", _plot_step_breakdown)):
        fig = Figure(figsize=(5.8, 3.4), layout="tight")
        draw(fig.add_subplot(), result)
        fig.savefig(Path(out) / name, dpi=110)
        names.append(name)
    return names


def _plot_throughput(ax, result: dict) -> None:
    """Output tokens/s of each side per model size (the overlapped one too, where measured), the
    speedup written over fleetlab's bars."""
    tp = result["throughput"]["models"]
    x = np.arange(len(tp))
    pf_batch = result["throughput"]["paddleformers_batch_size"]
    sides = [("paddleformers", None, f"PaddleFormers generate (batches of {pf_batch})"),
             ("fleetlab", "speedup", "fleetlab LLM (continuous batching)")]
    if all("fleetlab_overlap" in e for e in tp):
        sides.append(("fleetlab_overlap", "overlap_speedup", "fleetlab LLM, async_scheduling=True"))
    width = 0.8 / len(sides)
    tallest = 0.0
    for j, (key, ratio, label) in enumerate(sides):
        vals = [e[key]["tokens_per_s"] for e in tp]
        offset = (j - (len(sides) - 1) / 2) * width
        ax.bar(x + offset, vals, width, label=label)
        for i, e in enumerate(tp):
            if ratio:
                ax.text(i + offset, vals[i], f"{e[ratio]:.2f}x", ha="center", va="bottom", fontsize=8)
        tallest = max(tallest, *vals)
    ax.set_xticks(x, [f"{e['size']} ({e['num_params'] / 1e6:.1f}M params)" for e in tp])
    ax.set_ylim(0, 1.35 * tallest)
    ax.set_ylabel("output tokens / s")
    ax.set_title("Throughput on a mixed workload")
    ax.legend(fontsize=7, loc="upper left")


def _plot_kv_memory(ax, result: dict) -> None:
    """Share of allocated KV memory holding real tokens: paged, padded, reserved."""
    kv = result["kv_memory"]
    labels = [f"paged, block {kv['block_size']} (fleetlab)", "padded static batches", "reserve longest sequence"]
    vals = [100 * kv[k]["token_fill"] for k in ("paged", "padded", "reserved")]
    ax.barh(labels, vals, color=["tab:green", "tab:orange", "tab:red"])
    for i, v in enumerate(vals):
        ax.text(v, i, f" {v:.0f}%", va="center")
    ax.set_xlim(0, 115)
    ax.set_xlabel("allocated KV memory holding real tokens (%)")
    ax.set_title("KV memory use over the run")


def _plot_prefix_caching(ax, result: dict) -> None:
    """Output tokens/s of the shared-prefix workload with prefix caching off and on."""
    px = result["prefix_caching"]
    ax.bar(["caching off", "caching on"], [px["off"]["tokens_per_s"], px["on"]["tokens_per_s"]],
           color=["tab:gray", "tab:green"])
    ax.set_ylim(0, 1.15 * max(px["off"]["tokens_per_s"], px["on"]["tokens_per_s"]))
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"Shared {px['workload']['prefix_len']}-token prefix: hit rate {100 * px['on']['hit_rate']:.0f}%, "
                 f"{px['speedup']:.2f}x")


def _plot_step_breakdown(ax, result: dict) -> None:
    """ms per decode step stacked by part, one bar per batch size."""
    sb = result["step_breakdown"]
    bottom = np.zeros(len(sb))
    for key in (*STEP_KEYS, "other"):
        vals = np.array([b["ms_per_step"][key] for b in sb])
        ax.bar([f"batch {b['batch_size']}" for b in sb], vals, bottom=bottom, label=key)
        bottom += vals
    for i, b in enumerate(sb):
        ax.text(i, bottom[i], f"overhead {100 * b['overhead_share']:.1f}%", ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, 1.12 * bottom.max())
    ax.set_ylabel("ms per decode step")
    ax.set_title("Where a decode step's time goes")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
