"""Drawing what a Triton attention call costs the host, from the kernel benchmark's JSON
(``python -m fleetlab.lab.bench.triton_attention``, stored as ``benchmarks/results/h200_triton.json``).

:func:`draw_launch_costs` draws the host clock beside the GPU: microseconds of Python and
launches per call, and a whole decode step eager against one CUDA graph.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from matplotlib.figure import Figure

from fleetlab.lab.viz._style import PALETTE

# host-time keys of a decode row, and what each measures (legend labels)
HOST_CLOCKS = {
    "triton_host_us": "Triton: one attention call (plan made once per step)",
    "layer_host_us": "Triton: a whole layer call (plan lookup, store K/V, attention)",
    "before_host_us": "Triton before: one call that plans every time",
    "sdpa_host_us": "torch SDPA: one call",
}


def _shape_label(row: Mapping) -> str:
    context = int(row["context"])
    text = f"{context // 1024}k" if context % 1024 == 0 else str(context)
    return f"{row['batch']}×{text}\n{row['num_heads']}/{row['num_kv_heads']} d{row['head_dim']}"


def draw_launch_costs(kernel_results: Mapping, *, section: str = "decode_issue_shapes", target_us: float = 50.0):
    """Left: host microseconds per call for each decode shape of ``section`` (bars for each
    of :data:`HOST_CLOCKS` a row has; gid ``"host:<shape>:<clock>"``), with ``target_us`` as
    a dashed line. Right: ``decode_step`` rows, the eager step against one CUDA graph of it
    (gid ``"step:<shape>:<eager|graph>"``). Returns the Figure, or None when the results
    hold neither section."""
    rows = [r for r in kernel_results.get(section) or [] if isinstance(r, Mapping)]
    steps = [r for r in kernel_results.get("decode_step") or [] if isinstance(r, Mapping)]
    if not rows and not steps:
        return None
    fig = Figure(figsize=(12, 4.2), layout="constrained")
    host_ax, step_ax = fig.subplots(1, 2, width_ratios=[2.2, 1])
    clocks = [k for k in HOST_CLOCKS if any(isinstance(r.get(k), (int, float)) for r in rows)]
    width = 0.8 / max(1, len(clocks))
    for j, clock in enumerate(clocks):
        for x, row in enumerate(rows):
            value = row.get(clock)
            if isinstance(value, (int, float)):
                bar = host_ax.bar(x + (j - (len(clocks) - 1) / 2) * width, value, width, color=PALETTE[j],
                                  label=HOST_CLOCKS[clock] if x == 0 else None)[0]
                bar.set_gid(f"host:{_shape_label(row).replace(chr(10), ' ')}:{clock}")
    if rows:
        host_ax.axhline(target_us, color="black", linestyle="--", linewidth=0.8, label=f"{target_us:g} µs target")
        host_ax.set_xticks(range(len(rows)), [_shape_label(r) for r in rows], fontsize=7)
        host_ax.set_ylabel("host µs per call (GPU held busy)", fontsize=8)
        top = max([target_us] + [r[k] for r in rows for k in clocks if isinstance(r.get(k), (int, float))])
        host_ax.set_ylim(0, top * 1.35)  # room for the legend above the bars
        host_ax.legend(fontsize=7, frameon=False, loc="upper left", ncols=2)
        host_ax.set_title("what one call costs the host, per decode shape", fontsize=9)
    labels = [f"{r['batch']}×{int(r['context']) // 1024}k" + (f"+{r['prefill_chunk']}" if r.get("prefill_chunk")
                                                               else "") for r in steps]
    x = np.arange(len(steps))
    for offset, key, name, color in ((-0.2, "eager_step_ms", "eager", PALETTE[2]),
                                     (0.2, "graph_step_ms", "graph", PALETTE[0])):
        bars = step_ax.bar(x + offset, [r[key] for r in steps], 0.4, color=color,
                           label="eager (launched from Python)" if name == "eager" else "one CUDA graph")
        for bar, label in zip(bars, labels):
            bar.set_gid(f"step:{label}:{name}")
    if steps:
        step_ax.set_xticks(x, labels, fontsize=8)
        step_ax.set_ylim(0, max(r["eager_step_ms"] for r in steps) * 1.25)  # room for the legend
        step_ax.set_ylabel(f"ms per step ({steps[0].get('num_layers', '?')} layers' attention)", fontsize=8)
        step_ax.legend(fontsize=7, frameon=False)
        step_ax.set_title("a whole decode step", fontsize=9)
    device = (kernel_results.get("environment") or {}).get("device", "")
    fig.suptitle(f"Triton attention launched as an engine calls it{' on ' + device if device else ''}", fontsize=10)
    return fig
