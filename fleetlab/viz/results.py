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
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from fleetlab.viz._style import PALETTE, labelled_bars

logger = logging.getLogger(__name__)

_NAME_KEYS = ("name", "system", "engine", "label", "benchmark", "config")


def load_results(folder="benchmarks/results") -> dict[str, object]:
    """``{file stem: parsed JSON}`` for each ``*.json`` in ``folder``; empty if there is none.

    A file that is not valid JSON is skipped with a warning (a half-written result should
    not stop a notebook).
    """
    results = {}
    for path in sorted(Path(folder).glob("*.json")):
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


def _throughput_data(bench: Mapping) -> dict | None:
    """``{model size: {system: tokens/s}}`` from ``bench["throughput"]["models"]``."""
    models = (bench.get("throughput") or {}).get("models")
    if not isinstance(models, list):
        return None
    data = {}
    for i, model in enumerate(m for m in models if isinstance(m, Mapping)):
        systems = {name: _num((model.get(key) or {}).get("tokens_per_s"))
                   for key, name in (("paddleformers", "PaddleFormers generate"), ("fleetlab", "fleetlab LLM"))}
        systems = {k: v for k, v in systems.items() if v is not None}
        if systems:
            data[str(model.get("size", i))] = systems
    return data or None


def _kv_memory_data(bench: Mapping) -> dict | None:
    """``{layout: share of held KV slots that hold a token}`` from ``bench["kv_memory"]``."""
    kv = bench.get("kv_memory") or {}
    data = {layout: _num((kv.get(layout) or {}).get("token_fill")) for layout in ("paged", "padded", "reserved")}
    data = {k: v for k, v in data.items() if v is not None}
    return data or None


def _prefix_data(bench: Mapping) -> dict | None:
    """``{"off"/"on": seconds}`` from ``bench["prefix_caching"]``."""
    prefix = bench.get("prefix_caching") or {}
    data = {key: _num((prefix.get(key) or {}).get("seconds")) for key in ("off", "on")}
    data = {k: v for k, v in data.items() if v is not None}
    return data or None


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


def _draw_grouped(ax, data: Mapping[str, Mapping[str, float]], gid: str) -> None:
    """Bars grouped by outer key, one colour per inner key (gid ``"<gid>:<outer>:<inner>"``)."""
    inner = list(dict.fromkeys(k for group in data.values() for k in group))
    width = 0.8 / max(len(inner), 1)
    for x, (outer, group) in enumerate(data.items()):
        for j, key in enumerate(inner):
            if key in group:
                bar = ax.bar(x + (j - (len(inner) - 1) / 2) * width, group[key], width=width,
                             color=PALETTE[j % len(PALETTE)], label=key if x == 0 else None)[0]
                bar.set_gid(f"{gid}:{outer}:{key}")
    ax.set_xticks(range(len(data)), list(data), fontsize=8)
    ax.legend(fontsize=7, frameon=False)


def draw_bench_summary(bench: Mapping):
    """The sections of ``python -m fleetlab bench``'s ``bench.json`` that are present, one panel each.

    - throughput: output tokens/s of fleetlab's ``LLM`` and PaddleFormers' ``generate`` per model size;
    - kv_memory: share of held KV slots that hold a token, paged vs padded vs reserved;
    - prefix_caching: seconds for a shared-prefix workload with the prefix cache off and on;
    - step_breakdown: milliseconds per step by part, per batch size (stacked).
    Bars have gid ``"<section>:..."``. Returns the Figure, or None if no section is recognized.
    """
    panels = [(name, data) for name, data in (
        ("throughput", _throughput_data(bench)), ("kv_memory", _kv_memory_data(bench)),
        ("prefix_caching", _prefix_data(bench)), ("step_breakdown", _breakdown_data(bench))) if data]
    if not panels:
        return None
    fig = Figure(figsize=(3.6 * len(panels), 3.2), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(panels)))
    for ax, (name, data) in zip(axes, panels):
        if name == "throughput":
            _draw_grouped(ax, data, "throughput")
            ax.set_title("output tokens / s (higher is better)", fontsize=9)
            ax.set_xlabel("model size", fontsize=8)
        elif name == "step_breakdown":
            _draw_stacked(ax, data, "step_breakdown")
            ax.set_title("ms per engine step, by part", fontsize=9)
        elif name == "kv_memory":
            labelled_bars(ax, data, [100 * v for v in data.values()], "kv_memory", "{:.0f}%")
            ax.set_title("KV slots holding a token (%)", fontsize=9)
        else:
            labelled_bars(ax, data, data.values(), "prefix_caching", "{:.2f} s")
            ax.set_title("prefix cache: seconds (lower is better)", fontsize=9)
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
    ax.set_xticks(range(len(data)), list(data), fontsize=8)
    ax.legend(fontsize=6, frameon=False)


def draw_decode_bandwidth(kernel_results: Mapping):
    """Decode-attention bandwidth against context length, from a kernel benchmark's
    ``decode_bandwidth`` list (entries with ``batch``, ``context`` and ``<impl>_tbps``).

    One panel per batch size, one line per implementation (gid ``"bandwidth:<batch>:<impl>"``),
    and the device's read ceiling (``ceilings.read_sum_tbps``) dashed when given. Returns the
    Figure, or None when there is no such list.
    """
    rows = [r for r in kernel_results.get("decode_bandwidth") or [] if isinstance(r, Mapping)
            and _is_number(r.get("batch")) and _is_number(r.get("context"))]
    if not rows:
        return None
    batches = sorted({int(r["batch"]) for r in rows})
    impls = sorted({k[: -len("_tbps")] for r in rows for k in r if k.endswith("_tbps") and _is_number(r[k])})
    ceiling = _num((kernel_results.get("ceilings") or {}).get("read_sum_tbps"))
    fig = Figure(figsize=(3.4 * len(batches), 3.0), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(batches), sharey=True))
    for ax, batch in zip(axes, batches):
        mine = sorted((r for r in rows if int(r["batch"]) == batch), key=lambda r: r["context"])
        for j, impl in enumerate(impls):
            points = [(r["context"], r[f"{impl}_tbps"]) for r in mine if _is_number(r.get(f"{impl}_tbps"))]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o", color=PALETTE[j % len(PALETTE)], label=impl,
                        gid=f"bandwidth:{batch}:{impl}")
        if ceiling is not None:
            ax.axhline(ceiling, color="black", linestyle="--", linewidth=0.8, label="device read ceiling")
        ax.set_xscale("log", base=2)
        contexts = sorted({int(r["context"]) for r in mine})
        ax.set_xticks(contexts, [f"{c // 1024}k" if c >= 1024 else str(c) for c in contexts], fontsize=7)
        ax.minorticks_off()
        ax.set_xlabel("context length (tokens)", fontsize=8)
        ax.set_title(f"batch {batch}", fontsize=9)
    axes[0].set_ylabel("KV read bandwidth (TB/s)")
    axes[-1].legend(fontsize=7, frameon=False)
    return fig
