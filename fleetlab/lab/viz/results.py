"""Drawing stored benchmark results: whatever JSON ``python -m fleetlab bench`` (and the
kernel benchmarks) left in ``benchmarks/results``.

- :func:`load_results` reads every ``*.json`` in a folder;
- :func:`draw_bench_summary` draws the sections of ``bench.json`` it recognizes and
  :func:`draw_decode_bandwidth` a kernel benchmark's decode bandwidth; both return None for
  a file they do not recognize, so a notebook can try each on every file;
- :func:`result_records` flattens any layout into records ``{"name": ..., <metric>: number}``
  and :func:`draw_result_bars` draws one panel per metric, for files of unknown layout.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from fleetlab.lab.viz._style import PALETTE, labelled_bars

logger = logging.getLogger(__name__)

_NAME_KEYS = ("name", "system", "engine", "label", "benchmark", "config")


RESULTS_ENV = "FLEETLAB_RESULTS"


def results_dir() -> Path:
    """Where benchmark results are read from, whatever the working directory:

    ``$FLEETLAB_RESULTS`` if set; else ``benchmarks/results`` of the source tree fleetlab is
    imported from (``make`` installs it editable, and ``python -m fleetlab bench`` writes
    there); else ``benchmarks/results`` under the working directory.
    """
    if os.environ.get(RESULTS_ENV):
        return Path(os.environ[RESULTS_ENV])
    beside_package = Path(__file__).resolve().parents[3] / "benchmarks" / "results"  # fleetlab/lab/viz/results.py
    return beside_package if beside_package.is_dir() else Path("benchmarks") / "results"


def load_results(folder=None) -> dict[str, object]:
    """``{file stem: parsed JSON}`` for each ``*.json`` in ``folder`` (default
    :func:`results_dir`); empty if there is none.

    A file that is not valid JSON is skipped with a warning (a half-written result should
    not stop a notebook).
    """
    results = {}
    for path in sorted(Path(results_dir() if folder is None else folder).glob("*.json")):
        try:
            results[path.stem] = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            logger.warning("skipping %s: %s", path, err)
    return results


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _record(name: str, item: Mapping) -> dict | None:
    metrics = {k: float(v) for k, v in item.items() if _is_number(v)}
    if not metrics:
        return None
    label = next((str(item[k]) for k in _NAME_KEYS if isinstance(item.get(k), str)), name)
    return {"name": label, **metrics}


def result_records(results, prefix: str = "") -> list[dict]:
    """Flatten benchmark JSON into records ``{"name": str, metric: float, ...}``.

    Accepts a list of dicts, a dict of dicts (keys become names), a dict holding such a
    list or dict under any key (``{"results": [...]}``), or the output of
    :func:`load_results`. Every dict with numeric values becomes one record; its name is
    its own ``name``/``system``/``engine``/``label`` field, else the path of keys to it.
    """
    records: list[dict] = []
    if isinstance(results, Mapping):
        own = _record(prefix or "result", results)
        if own is not None and not any(isinstance(v, (Mapping, list)) for v in results.values()):
            return [own]
        if own is not None:
            records.append(own)
        for key, value in results.items():
            if isinstance(value, (Mapping, list)):
                records += result_records(value, f"{prefix}/{key}" if prefix else str(key))
    elif isinstance(results, list):
        for i, item in enumerate(results):
            if isinstance(item, (Mapping, list)):
                records += result_records(item, f"{prefix}[{i}]")
    return records


def draw_result_bars(records: Sequence[Mapping], metrics: Sequence[str] | None = None, *, max_panels: int = 4):
    """One bar panel per metric, one bar per record (gid ``"result:<metric>:<name>"``);
    a record keeps its colour across panels.

    ``metrics``: which to draw; default the metrics most records share, at most
    ``max_panels``. Returns the Figure.
    """
    if not records:
        raise ValueError("draw_result_bars: no records to draw")
    if metrics is None:
        counts: dict[str, int] = {}
        for rec in records:
            for key in rec:
                if key != "name":
                    counts[key] = counts.get(key, 0) + 1
        metrics = sorted(counts, key=lambda k: (-counts[k], k))[:max_panels]
    fig = Figure(figsize=(3.4 * len(metrics), 0.25 * len(records) + 2.2), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(metrics)))
    color = {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(dict.fromkeys(r["name"] for r in records))}
    for ax, metric in zip(axes, metrics):
        shown = [r for r in records if metric in r]
        for y, rec in enumerate(shown):
            bar = ax.barh(y, rec[metric], color=color[rec["name"]])[0]
            bar.set_gid(f"result:{metric}:{rec['name']}")
        ax.set_yticks(range(len(shown)), [r["name"] for r in shown], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(metric, fontsize=9)
    return fig


# ---------------------------------------------------------------- known result files
def _num(value) -> float | None:
    return float(value) if _is_number(value) else None


def model_label(model: Mapping, default: str) -> str:
    """A benchmark model's name as README gives it: ``"Llama 1.0M params"`` from its
    ``num_params``, else its ``size`` field, else ``default``."""
    num_params = _num(model.get("num_params"))
    if num_params:
        return f"Llama {num_params / 1e6:.1f}M params"
    return str(model.get("size", default))


def _throughput_data(bench: Mapping) -> dict | None:
    """``{model label: {system: tokens/s}}`` from ``bench["throughput"]["models"]``."""
    models = (bench.get("throughput") or {}).get("models")
    if not isinstance(models, list):
        return None
    data = {}
    for i, model in enumerate(m for m in models if isinstance(m, Mapping)):
        systems = {name: _num((model.get(key) or {}).get("tokens_per_s"))
                   for key, name in (("paddleformers", "PaddleFormers generate"), ("fleetlab", "fleetlab LLM"))}
        systems = {k: v for k, v in systems.items() if v is not None}
        if systems:
            data[model_label(model, str(i))] = systems
    return data or None


def _kv_memory_data(bench: Mapping) -> dict | None:
    """``{layout: share of held KV slots that hold a token}`` from ``bench["kv_memory"]``."""
    kv = bench.get("kv_memory") or {}
    data = {layout: _num((kv.get(layout) or {}).get("token_fill")) for layout in ("paged", "padded", "reserved")}
    data = {k: v for k, v in data.items() if v is not None}
    return data or None


def _prefix_data(bench: Mapping) -> tuple[str, dict] | None:
    """``("tokens_per_s" or "seconds", {"off"/"on": value})`` from ``bench["prefix_caching"]``:
    output tokens per second when both runs have it (as README reports it), else seconds."""
    prefix = bench.get("prefix_caching") or {}
    for metric in ("tokens_per_s", "seconds"):
        data = {key: _num((prefix.get(key) or {}).get(metric)) for key in ("off", "on")}
        data = {k: v for k, v in data.items() if v is not None}
        if data:
            return metric, data
    return None


def _breakdown_data(bench: Mapping) -> dict | None:
    """``{"batch N": {part: ms per step}}`` from ``bench["step_breakdown"]`` (``total`` dropped)."""
    rows = bench.get("step_breakdown")
    if not isinstance(rows, list):
        return None
    data = {}
    for i, row in enumerate(r for r in rows if isinstance(r, Mapping)):
        parts = {k: float(v) for k, v in (row.get("ms_per_step") or {}).items() if k != "total" and _is_number(v)}
        if parts:
            data[f"batch {row.get('batch_size', i)}"] = parts
    return data or None


def _draw_grouped(ax, data: Mapping[str, Mapping[str, float]], gid: str, fmt: str = "{:.0f}") -> None:
    """Bars grouped by outer key, one colour per inner key (gid ``"<gid>:<outer>:<inner>"``),
    each with its value on top."""
    inner = list(dict.fromkeys(k for group in data.values() for k in group))
    width = 0.8 / max(len(inner), 1)
    top = 0.0
    for x, (outer, group) in enumerate(data.items()):
        for j, key in enumerate(inner):
            if key in group:
                xj = x + (j - (len(inner) - 1) / 2) * width
                bar = ax.bar(xj, group[key], width=width, color=PALETTE[j % len(PALETTE)],
                             label=key if x == 0 else None)[0]
                bar.set_gid(f"{gid}:{outer}:{key}")
                ax.text(xj, group[key], fmt.format(group[key]), ha="center", va="bottom", fontsize=7)
                top = max(top, group[key])
    ax.set_xticks(range(len(data)), list(data), fontsize=8)
    ax.set_ylim(0, top * 1.2 if top > 0 else 1.0)
    ax.legend(fontsize=7, frameon=False, loc="upper right")


def draw_bench_summary(bench: Mapping):
    """The sections of ``python -m fleetlab bench``'s ``bench.json`` that are present, one panel each.

    - throughput: output tokens/s of fleetlab's ``LLM`` and PaddleFormers' ``generate`` per model size;
    - kv_memory: share of held KV slots that hold a token, paged vs padded vs reserved;
    - prefix_caching: a shared-prefix workload with the prefix cache off and on, in output
      tokens per second (seconds in older files);
    - step_breakdown: milliseconds per step by part, per batch size (stacked).
    Panels sit two by two; models are named by their parameter count, as in README. Bars
    have gid ``"<section>:..."``. Returns the Figure, or None if no section is recognized.
    """
    panels = [(name, data) for name, data in (
        ("throughput", _throughput_data(bench)), ("kv_memory", _kv_memory_data(bench)),
        ("prefix_caching", _prefix_data(bench)), ("step_breakdown", _breakdown_data(bench))) if data]
    if not panels:
        return None
    ncols = min(2, len(panels))
    nrows = -(-len(panels) // ncols)
    fig = Figure(figsize=(5.2 * ncols, 3.4 * nrows), layout="constrained")
    axes = np.atleast_1d(fig.subplots(nrows, ncols)).ravel()
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    for ax, (name, data) in zip(axes, panels):
        if name == "throughput":
            _draw_grouped(ax, data, "throughput")
            ax.set_ylabel("output tokens / s", fontsize=8)
            ax.set_title("engine vs static batches of generate (higher is better)", fontsize=9)
        elif name == "step_breakdown":
            _draw_stacked(ax, data, "step_breakdown")
            ax.set_ylabel("ms per step", fontsize=8)
            ax.set_title("where an engine step's time goes", fontsize=9)
        elif name == "kv_memory":
            labelled_bars(ax, data, [100 * v for v in data.values()], "kv_memory", "{:.0f}%")
            ax.set_ylim(0, 118)
            ax.set_ylabel("% of allocated KV slots", fontsize=8)
            ax.set_title("KV memory that holds a real token (higher is better)", fontsize=9)
        else:
            metric, values = data
            names = {"off": "prefix cache off", "on": "prefix cache on"}
            shown = {names[k]: v for k, v in values.items()}
            if metric == "tokens_per_s":
                labelled_bars(ax, shown, shown.values(), "prefix_caching", "{:.0f}")
                ax.set_ylabel("output tokens / s", fontsize=8)
                ax.set_title("shared-prefix workload (higher is better)", fontsize=9)
            else:
                labelled_bars(ax, shown, shown.values(), "prefix_caching", "{:.2f} s")
                ax.set_ylabel("seconds", fontsize=8)
                ax.set_title("shared-prefix workload (lower is better)", fontsize=9)
            for bar, key in zip(ax.patches, values):
                bar.set_gid(f"prefix_caching:{key}")
            ax.set_ylim(0, max(values.values()) * 1.2)
    return fig


def _draw_stacked(ax, data: Mapping[str, Mapping[str, float]], gid: str) -> None:
    """One stacked bar per outer key, one colour per inner key (gid ``"<gid>:<outer>:<inner>"``)."""
    parts = list(dict.fromkeys(k for group in data.values() for k in group))
    for x, (label, group) in enumerate(data.items()):
        bottom = 0.0
        for j, part in enumerate(parts):
            value = group.get(part, 0.0)
            ax.bar(x, value, bottom=bottom, color=PALETTE[j % len(PALETTE)],
                   label=part if x == 0 else None)[0].set_gid(f"{gid}:{label}:{part}")
            bottom += value
        ax.text(x, bottom, f"{bottom:.1f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(data)), list(data), fontsize=8)
    ax.legend(fontsize=7, frameon=False, loc="upper left")


# What each implementation of the decode-bandwidth benchmark is, in words (legend labels).
IMPLEMENTATION_NAMES = {
    "triton": "paged Triton kernel: reads K/V through the block table",
    "sdpa": "SDPA on contiguous K/V (no paging: the target)",
    "gather_sdpa": "gather the blocks into a contiguous copy, then SDPA",
    "before": "an older copy of the paged Triton kernel, timed in the same run",
}
# One colour per implementation, whatever else a results file holds (notebook prose names them).
IMPLEMENTATION_COLORS = {"triton": PALETTE[2], "sdpa": PALETTE[1], "gather_sdpa": PALETTE[0], "before": "#9a9a9a"}
# The benchmark's clocks (its "clocks" entry): a bandwidth key is <impl>_tbps under CUDA-graph replay,
# <impl>_eager_tbps for calls issued back to back from Python.
CLOCK_SUFFIXES = {"graph": "_tbps", "eager": "_eager_tbps"}
CLOCK_TITLES = {"graph": "CUDA-graph replay, GPU time alone", "eager": "calls issued back to back from Python"}
# Peak memory bandwidth on the vendor's spec sheet, by device name (TB/s).
SPEC_BANDWIDTH_TBPS = {"NVIDIA H200": 4.8}


def _impl_series(rows, clock: str) -> list[str]:
    """The implementations ``rows`` time under ``clock`` (a key of :data:`CLOCK_SUFFIXES`)."""
    suffix = CLOCK_SUFFIXES[clock]
    other = tuple(s for s in CLOCK_SUFFIXES.values() if s != suffix and s.endswith(suffix))
    return sorted({k[: -len(suffix)] for r in rows for k in r
                   if k.endswith(suffix) and not k.endswith(other) and _is_number(r[k])})


def draw_decode_bandwidth(kernel_results: Mapping, *, ncols: int = 3, clock: str = "graph"):
    """Decode-attention bandwidth against context length, from a kernel benchmark's
    ``decode_bandwidth`` list (entries with ``batch``, ``context`` and ``<impl>_tbps``).

    ``clock``: ``"graph"`` draws the ``<impl>_tbps`` keys (CUDA-graph replay: the GPU's time
    alone), ``"eager"`` the ``<impl>_eager_tbps`` keys (calls issued from Python, as an engine
    issues them), each implementation under its own name either way; the title says which.

    One panel per batch size (``ncols`` to a row), one line per implementation named in
    words (:data:`IMPLEMENTATION_NAMES`) in its own colour (:data:`IMPLEMENTATION_COLORS`;
    gid ``"bandwidth:<batch>:<impl>"``). Two reference
    lines, when known: the device's spec-sheet peak (:data:`SPEC_BANDWIDTH_TBPS`, by
    ``environment.device``), the true upper bound; and a plain ``torch.sum`` over 2 GiB
    measured on the same card (``ceilings.read_sum_tbps``), a simple kernel to compare with,
    not a limit: a well-tuned kernel can read faster than it. Returns the Figure, or None
    when there is no such list.
    """
    rows = [r for r in kernel_results.get("decode_bandwidth") or [] if isinstance(r, Mapping)
            and _is_number(r.get("batch")) and _is_number(r.get("context"))]
    if clock not in CLOCK_SUFFIXES:
        raise ValueError(f"draw_decode_bandwidth: clock must be one of {sorted(CLOCK_SUFFIXES)}; got {clock!r}")
    impls = _impl_series(rows, clock)
    if not rows or not impls:
        return None
    suffix = CLOCK_SUFFIXES[clock]
    batches = sorted({int(r["batch"]) for r in rows})
    measured = _num((kernel_results.get("ceilings") or {}).get("read_sum_tbps"))
    device = str((kernel_results.get("environment") or {}).get("device", ""))
    spec = SPEC_BANDWIDTH_TBPS.get(device)
    ncols = max(1, min(ncols, len(batches)))
    nrows = -(-len(batches) // ncols)
    fig = Figure(figsize=(3.8 * ncols, 2.9 * nrows + 1.3), layout="constrained")
    axes = np.atleast_1d(fig.subplots(nrows, ncols, sharey=True, squeeze=False)).ravel()
    for ax, batch in zip(axes, batches):
        mine = sorted((r for r in rows if int(r["batch"]) == batch), key=lambda r: r["context"])
        for j, impl in enumerate(impls):
            points = [(r["context"], r[f"{impl}{suffix}"]) for r in mine if _is_number(r.get(f"{impl}{suffix}"))]
            if points:
                xs, ys = zip(*points)
                color = IMPLEMENTATION_COLORS.get(impl, PALETTE[(j + 5) % len(PALETTE)])
                ax.plot(xs, ys, marker="o", color=color, linestyle=":" if impl == "before" else "-",
                        label=IMPLEMENTATION_NAMES.get(impl, impl), gid=f"bandwidth:{batch}:{impl}")
        if spec is not None:
            ax.axhline(spec, color="black", linestyle="-", linewidth=0.9,
                       label=f"{device} spec-sheet peak, {spec:g} TB/s (the upper bound)")
        if measured is not None:
            ax.axhline(measured, color="black", linestyle="--", linewidth=0.8,
                       label=f"torch.sum over 2 GiB on the same card, {measured:.2f} TB/s (a reference, not a limit)")
        ax.set_xscale("log", base=2)
        contexts = sorted({int(r["context"]) for r in mine})
        ax.set_xticks(contexts, [f"{c // 1024}k" if c >= 1024 else str(c) for c in contexts], fontsize=7)
        ax.minorticks_off()
        ax.set_xlabel("context length (tokens)", fontsize=8)
        ax.set_title(f"batch {batch}", fontsize=9)
        top = max(r.get(f"{i}{suffix}") or 0 for r in rows for i in impls)
        ax.set_ylim(0, max(spec or 0, measured or 0, top) * 1.1)
    for ax in axes[len(batches):]:
        ax.set_visible(False)
    for ax in axes[::ncols]:
        ax.set_ylabel("K/V bytes read per second (TB/s)", fontsize=8)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=2, fontsize=7.5, frameon=False)
    where = f" on {device}" if device else ""
    fig.suptitle(f"decode attention: how fast each implementation reads the KV cache{where} "
                 f"({CLOCK_TITLES[clock]})", fontsize=9)
    return fig
