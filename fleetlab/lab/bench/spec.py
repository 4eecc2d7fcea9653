"""Benchmark: speculative decoding, what it saves in target forwards and what it costs in time.

Two workloads, each run with speculation off and on, greedy (so every run must give the same
tokens as speculation off; the result records that it did):

- ``trained``: the shipped tiny Llama (4 layers, ``fleetlab.models.load_tiny()``) with its
  2-layer draft (``load_tiny_draft()``), ``method="draft"`` at several ``k`` and
  ``method="ngram"``. Prompts are cut from lines of the model's own training corpus, kinds
  that produce at least 8 tokens: counting (``"count 57"`` -> ``" 58 59 60 61"``) and
  sentences (``"the old man"`` -> ``" sat by the road."``); the model stops at its EOS, and
  only prompts whose output (speculation off) has at least 8 tokens are kept.
- ``repetitive``: ``method="ngram"`` on prompts of random tokens repeated three times, on a
  random-init tiny Llama (``fleetlab.models.tiny("llama")``), 48 tokens each with
  ``ignore_eos``: a random model's greedy output falls into loops, which prompt lookup
  predicts. (The trained model's short answers rarely repeat: ngram drafts little there.)

Per run: acceptance rate (overall, by draft position, mean tokens per verify step); **target
forwards per output token, counted per request**: the steps a request is scheduled in
divided by the tokens it gets, from the step traces; engine steps for the whole batch; and
wall-clock time. Timing is interleaved: after an untimed warm-up of every configuration,
each round runs every configuration of a workload once, on a fresh ``LLM`` (building it is
not timed), in a rotated order; the speed-up of a configuration is the median over rounds
of (speculation-off time / its time) within the round. The step traces also split the time
of a step into the target's forward and the proposer's drafting, which says why the
speed-up is what it is.

Results: ``<out>/spec.json`` and ``<out>/spec.png`` (default ``benchmarks/results``).

Run: ``OMP_NUM_THREADS=1 python -m fleetlab bench spec [--tiny] [--rounds N] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fleetlab import LLM, SamplingParams
from fleetlab.lab.bench.machine import MachineRecord, describe
from fleetlab.lab.bench.progress import add_quiet, section
from fleetlab.lab.viz.spec import draw_spec_benchmark, request_forwards
from fleetlab.models import load_tiny, load_tiny_draft, tiny
from fleetlab.models.corpus import CorpusMix, generate_lines

DEFAULT_OUT = Path("benchmarks/results")
MIN_OUTPUT_TOKENS = 8  # the goal is stated for requests that produce at least this many tokens


@dataclass(slots=True)
class SpecBenchConfig:
    """Every knob of one run of the benchmark (the ``full`` and ``tiny`` presets are instances)."""

    num_count: int = 16          # trained workload: counting prompts ...
    num_sentence: int = 16       # ... and sentence prompts (before the >= 8 tokens filter)
    max_tokens: int = 32         # trained workload: the model stops at EOS well before this
    draft_ks: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8)
    ngram_ks: tuple[int, ...] = (2, 4, 6)
    headline_k: int = 4          # the k the goal is checked at
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    rep_num_requests: int = 16   # repetitive workload
    rep_prompt_len: tuple[int, int] = (3, 10)
    rep_repeats: int = 3
    rep_max_tokens: int = 48
    block_size: int = 16
    alone_requests: int = 8      # latency: this many trained prompts, each served alone ...
    alone_ks: tuple[int, ...] = (2, 4)  # ... with the draft at these k
    rounds: int = 7              # timed rounds (after one untimed warm-up round)
    seed: int = 0
    out: str = str(DEFAULT_OUT)


PRESETS = {
    "full": SpecBenchConfig(),
    "tiny": SpecBenchConfig(num_count=2, num_sentence=2, max_tokens=20, draft_ks=(2, 4), ngram_ks=(4,),
                            rep_num_requests=2, rep_prompt_len=(3, 5), rep_max_tokens=12, alone_requests=2,
                            alone_ks=(4,), rounds=1),
}


# ----------------------------------------------------------------------------- workloads
def trained_prompts(num_count: int, num_sentence: int, seed: int = 0) -> list[str]:
    """Prompts cut from the tiny model's corpus (``fleetlab.models.corpus``): ``"count N"``
    from counting lines, the first three words of sentence lines; distinct, in corpus order."""
    zero = dict.fromkeys(("add2", "add1", "add3", "sub", "mul", "count", "sentence"), 0.0)
    prompts: list[str] = []
    for kind, n, cut in (("count", num_count, lambda line: " ".join(line.split()[:2])),
                         ("sentence", num_sentence, lambda line: " ".join(line.split()[:3]))):
        stream = iter(generate_lines(seed, 50 * max(n, 1), CorpusMix(**{**zero, kind: 1.0})))
        chosen: list[str] = []
        for line in stream:
            if len(chosen) == n:
                break
            prompt = cut(line)
            if prompt not in chosen:
                chosen.append(prompt)
        prompts += chosen
    return prompts


def repetitive_prompts(num: int, prompt_len: tuple[int, int], repeats: int, vocab_size: int,
                       seed: int = 0) -> list[list[int]]:
    """``num`` prompts, each a random token sequence (ids from 3) repeated ``repeats`` times."""
    rng = np.random.default_rng(seed)
    lo, hi = prompt_len
    return [[int(t) for t in rng.integers(3, vocab_size, size=int(rng.integers(lo, hi + 1)))] * repeats
            for _ in range(num)]


def spec_config(method: str, k: int, *, draft=None, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4) -> dict:
    """The ``speculative_config`` dict of one configuration."""
    if method == "draft":
        return {"method": "draft", "num_speculative_tokens": k, "model": draft}
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": prompt_lookup_min,
            "prompt_lookup_max": prompt_lookup_max}


# ----------------------------------------------------------------------------- one run
def measure(model, prompt_token_ids: list[list[int]], sampling, *, spec: dict | None = None,
            name: str | None = None, **engine) -> dict:
    """One ``generate`` of every prompt on a fresh ``LLM(model, record_traces=True,
    speculative_config=spec, **engine)``; building the engine is not timed.

    Returns a JSON-ready dict: ``name``, ``method`` (``"off"``, ``"draft"``, ``"ngram"``),
    ``k``, ``num_steps``, ``num_output_tokens``, ``acceptance_rate``,
    ``mean_acceptance_length`` (tokens a verify step yields: accepted drafts + 1),
    ``acceptance_by_position``, ``forwards_per_token`` (mean over requests) and
    ``forwards_per_token_by_request`` / ``num_forwards_by_request`` /
    ``num_tokens_by_request`` (in prompt order), ``wall_s``, ``cpu_s``, ``ms_per_step``
    (``forward``: the target's forward; ``propose``: drafting; ``total``: wall / steps), and
    ``token_ids`` (each request's output; drop it before storing).
    """
    method = spec["method"] if spec else "off"
    k = spec["num_speculative_tokens"] if spec else 0
    with LLM(model, record_traces=True, speculative_config=spec, **engine) as llm:
        cpu0, t0 = time.process_time(), time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompt_token_ids, sampling_params=sampling, use_tqdm=False)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        stats, traces = llm.stats(), llm.traces
    costs = request_forwards(traces)
    by_request = [costs[o.request_id] for o in outs]
    steps = max(1, len(traces))
    ms = {part: 1000 * sum(t.timings.get(part, 0.0) for t in traces) / steps for part in ("forward", "propose")}
    ms["total"] = 1000 * wall / steps
    return {
        "name": name or (f"{method} k={k}" if spec else "off"), "method": method, "k": k,
        "num_steps": stats["num_steps"], "num_output_tokens": sum(len(o.token_ids) for o in outs),
        "acceptance_rate": stats.get("spec_acceptance_rate", 0.0),
        "mean_acceptance_length": stats.get("spec_mean_acceptance_length", 1.0),
        "acceptance_by_position": stats.get("spec_acceptance_by_position", []),
        "num_draft_tokens": stats.get("num_draft_tokens", 0),
        "num_accepted_tokens": stats.get("num_accepted_tokens", 0),
        "forwards_per_token": float(np.mean([c.forwards_per_token for c in by_request])),
        "forwards_per_token_by_request": [c.forwards_per_token for c in by_request],
        "num_forwards_by_request": [c.num_forwards for c in by_request],
        "num_tokens_by_request": [c.num_tokens for c in by_request],
        "wall_s": wall, "cpu_s": cpu, "ms_per_step": ms,
        "token_ids": [list(o.token_ids) for o in outs],
    }


# ----------------------------------------------------------------------------- a workload, interleaved
def bench_workload(name: str, model, prompts: list[list[int]], sampling, configs: list[tuple[str, dict | None]],
                   rounds: int, engine: dict, bar=None) -> dict:
    """Warm up every configuration (its counts come from this run), then ``rounds`` timed
    rounds in rotated order. ``configs``: ``(name, speculative_config or None)``, the first
    one speculation off. Returns ``{"runs": [...]}`` with wall times and speed-ups."""
    runs = []
    for cfg_name, spec in configs:
        run = measure(model, prompts, sampling, spec=spec, name=cfg_name, **engine)
        run["wall_s"], run["cpu_s"] = [], []
        runs.append(run)
        if bar is not None:
            bar.update(1)
    off = runs[0]
    for run in runs:
        run["identical_to_off"] = run["token_ids"] == off["token_ids"]
        run["ratio_to_off_by_request"] = [s / o for s, o in zip(run["forwards_per_token_by_request"],
                                                                off["forwards_per_token_by_request"])]
    n = len(configs)
    for r in range(rounds):
        for i in [(r + j) % n for j in range(n)]:
            timed = measure(model, prompts, sampling, spec=configs[i][1], **engine)
            runs[i]["wall_s"].append(timed["wall_s"])
            runs[i]["cpu_s"].append(timed["cpu_s"])
            runs[i].setdefault("ms_per_step_rounds", []).append(timed["ms_per_step"])
            if bar is not None:
                bar.update(1)
    for run in runs:
        walls = run["wall_s"] or [0.0]
        run["wall_s_median"] = statistics.median(walls)
        ratios = [o / w for o, w in zip(off["wall_s"], run["wall_s"]) if w > 0]
        run["speedup"] = statistics.median(ratios) if ratios else float("nan")
        cpu_ratios = [o / c for o, c in zip(off["cpu_s"], run["cpu_s"]) if c > 0]
        run["cpu_speedup"] = statistics.median(cpu_ratios) if cpu_ratios else float("nan")
        rounds_ms = run.pop("ms_per_step_rounds", None)
        if rounds_ms:
            run["ms_per_step"] = {part: statistics.median(m[part] for m in rounds_ms) for part in rounds_ms[0]}
        run.pop("token_ids")
    return {"num_requests": len(prompts), "runs": runs}


def bench_alone(model, prompts: list[list[int]], sampling, configs: list[tuple[str, dict | None]], rounds: int,
                engine: dict, bar=None) -> dict:
    """Latency: each prompt served alone (batch 1), one configuration after another, in
    rotated order per round after an untimed warm-up; a configuration's time in a round is
    the sum over its prompts. ``configs`` as :func:`bench_workload` (off first)."""
    walls: list[list[float]] = [[] for _ in configs]
    steps = [0] * len(configs)
    n = len(configs)
    for r in range(rounds + 1):
        for i in [(r + j) % n for j in range(n)]:
            runs = [measure(model, [p], sampling, spec=configs[i][1], **engine) for p in prompts]
            if r:
                walls[i].append(sum(x["wall_s"] for x in runs))
            else:
                steps[i] = sum(x["num_steps"] for x in runs)
            if bar is not None:
                bar.update(1)
    out = []
    for (name, spec), wall, num_steps in zip(configs, walls, steps):
        out.append({"name": name, "method": spec["method"] if spec else "off",
                    "k": spec["num_speculative_tokens"] if spec else 0, "num_steps": num_steps, "wall_s": wall,
                    "wall_s_median": statistics.median(wall),
                    "speedup": statistics.median(o / w for o, w in zip(walls[0], wall))})
    return {"num_requests": len(prompts), "runs": out}


def goal(workload: dict, k: int) -> dict:
    """The headline check: draft at ``k``, per request, target forwards per output token
    against the same request with speculation off (goal: at most half)."""
    run = next(r for r in workload["runs"] if r["method"] == "draft" and r["k"] == k)
    ratios = run["ratio_to_off_by_request"]
    return {"k": k, "max_ratio_goal": 0.5, "mean_ratio": float(np.mean(ratios)), "worst_ratio": max(ratios),
            "requests_meeting_goal": sum(x <= 0.5 for x in ratios), "num_requests": len(ratios),
            "met": max(ratios) <= 0.5}


# ----------------------------------------------------------------------------- the whole benchmark
def run(cfg: SpecBenchConfig, preset: str = "custom", argv=None, quiet: bool = True) -> dict:
    """Measure both workloads; write ``spec.json`` and ``spec.png`` to ``cfg.out``; return the result.
    ``quiet=False``: a progress bar per workload on stderr."""
    start = time.perf_counter()
    machine = MachineRecord()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_tiny()
    draft, _ = load_tiny_draft()
    engine = {"block_size": cfg.block_size}
    lookup = {"prompt_lookup_min": cfg.prompt_lookup_min, "prompt_lookup_max": cfg.prompt_lookup_max}

    trained_sp = SamplingParams(max_tokens=cfg.max_tokens)
    candidates = trained_prompts(cfg.num_count, cfg.num_sentence, cfg.seed)
    first = measure(model, [tokenizer.encode(p) for p in candidates], trained_sp, **engine)
    kept = [p for p, n in zip(candidates, first["num_tokens_by_request"]) if n >= MIN_OUTPUT_TOKENS]
    trained_configs = [("off", None)]
    trained_configs += [(f"draft k={k}", spec_config("draft", k, draft=draft)) for k in cfg.draft_ks]
    trained_configs += [(f"ngram k={k}", spec_config("ngram", k, **lookup)) for k in cfg.ngram_ks]

    rep_model = tiny("llama", seed=cfg.seed)
    rep_prompts = repetitive_prompts(cfg.rep_num_requests, cfg.rep_prompt_len, cfg.rep_repeats,
                                     rep_model.config.vocab_size, cfg.seed)
    rep_sp = SamplingParams(max_tokens=cfg.rep_max_tokens, ignore_eos=True)
    rep_configs = [("off", None)] + [(f"ngram k={k}", spec_config("ngram", k, **lookup)) for k in cfg.ngram_ks]

    alone_configs = [("off", None)] + [(f"draft k={k}", spec_config("draft", k, draft=draft)) for k in cfg.alone_ks]

    def bar(desc, configs):
        return section(f"spec, {desc}", (cfg.rounds + 1) * len(configs), quiet=quiet)

    with bar("trained workload", trained_configs) as b:
        trained = bench_workload("trained", model, [tokenizer.encode(p) for p in kept], trained_sp, trained_configs,
                                 cfg.rounds, engine, b)
    with bar("repetitive workload", rep_configs) as b:
        repetitive = bench_workload("repetitive", rep_model, rep_prompts, rep_sp, rep_configs, cfg.rounds, engine, b)
    with bar("one request at a time", alone_configs) as b:
        alone = bench_alone(model, [tokenizer.encode(p) for p in kept[: cfg.alone_requests]], trained_sp,
                            alone_configs, cfg.rounds, engine, b)
    trained.update(model="shipped tiny Llama (4 layers) + its 2-layer draft", prompts=kept,
                   num_candidates=len(candidates), min_output_tokens=MIN_OUTPUT_TOKENS,
                   sampling={"temperature": 0, "max_tokens": cfg.max_tokens, "stops_at_eos": True})
    repetitive.update(model="random-init tiny Llama (fleetlab.models.tiny('llama'))",
                      prompt_lens=[len(p) for p in rep_prompts],
                      sampling={"temperature": 0, "max_tokens": cfg.rep_max_tokens, "ignore_eos": True})
    result = {
        "schema_version": 1,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m fleetlab bench spec " + " ".join(argv or []), "preset": preset,
        "machine": machine.close(), "config": dataclasses.asdict(cfg),
        "workloads": {"trained": trained, "repetitive": repetitive},
        "alone": alone, "goal": goal(trained, cfg.headline_k),
    }
    result["plots"] = write_plots(result, out)
    result["elapsed_s"] = time.perf_counter() - start
    (out / "spec.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


def write_plots(result: dict, out: Path) -> list[str]:
    """``spec.png`` in ``out`` (drawn by :func:`fleetlab.lab.viz.draw_spec_benchmark`)."""
    draw_spec_benchmark(result).savefig(Path(out) / "spec.png", dpi=110)
    return ["spec.png"]


def summary(result: dict) -> str:
    """The printed report: one line per run, the goal, and why the speed-up is what it is."""
    lines = ["(wall ms: median over rounds; speed-up: median over rounds of speculation off's time / this run's "
             "time in the same round; fwd/draft ms/step: medians of the step traces' timings)"]
    for wname, wl in result["workloads"].items():
        lines.append(f"\n{wname}: {wl['model']}, {wl['num_requests']} requests")
        lines.append(f"{'run':<12} {'accept':>6} {'tok/verify':>10} {'fwd/token':>9} {'vs off':>6} {'steps':>5} "
                     f"{'wall ms':>8} {'speed-up':>8} {'fwd ms/step':>11} {'draft ms/step':>13} same")
        for r in wl["runs"]:
            ms = r["ms_per_step"]
            ratio = float(np.mean(r["ratio_to_off_by_request"]))
            lines.append(f"{r['name']:<12} {r['acceptance_rate']:>6.2f} {r['mean_acceptance_length']:>10.2f} "
                         f"{r['forwards_per_token']:>9.3f} {ratio:>6.2f} {r['num_steps']:>5} "
                         f"{1000 * r['wall_s_median']:>8.1f} {r['speedup']:>7.2f}x {ms['forward']:>11.2f} "
                         f"{ms['propose']:>13.2f} {'yes' if r['identical_to_off'] else 'NO'}")
    al = result["alone"]
    lines.append(f"\nlatency, trained prompts served one at a time (first {al['num_requests']}): " + ", ".join(
        f"{r['name']} {1000 * r['wall_s_median']:.0f} ms in {r['num_steps']} steps ({r['speedup']:.2f}x)"
        for r in al["runs"]))
    g = result["goal"]
    lines.append(f"\ngoal (draft k={g['k']}, trained workload): target forwards per output token at most half of "
                 f"speculation off, per request: mean ratio {g['mean_ratio']:.2f}, worst {g['worst_ratio']:.2f}, "
                 f"{g['requests_meeting_goal']}/{g['num_requests']} requests meet it -> "
                 f"{'MET' if g['met'] else 'NOT MET'}")
    lines.append(why(result))
    return "\n".join(lines)


def why(result: dict) -> str:
    """One paragraph on the measured speed-up: what a step costs with and without drafting."""
    wl = result["workloads"]["trained"]
    off = next(r for r in wl["runs"] if r["method"] == "off")
    k = result["config"]["headline_k"]
    on = next(r for r in wl["runs"] if r["method"] == "draft" and r["k"] == k)
    per_draft = on["ms_per_step"]["propose"] / max(k, 1)
    return (f"why: with the draft at k={k} the batch takes {on['num_steps']} steps instead of {off['num_steps']}, "
            f"but a step costs {on['ms_per_step']['total']:.1f} ms instead of {off['ms_per_step']['total']:.1f} ms: "
            f"the target's verify forward {on['ms_per_step']['forward']:.1f} ms (a plain decode forward: "
            f"{off['ms_per_step']['forward']:.1f} ms) plus drafting {on['ms_per_step']['propose']:.1f} ms "
            f"(k draft forwards, ~{per_draft:.1f} ms each, {per_draft / off['ms_per_step']['forward']:.0%} of a "
            f"plain target forward). At this size a forward costs mostly fixed per-call overhead (the verify "
            f"forward runs {k + 1}x the tokens for {on['ms_per_step']['forward'] / off['ms_per_step']['forward']:.1f}x "
            f"the time), so the 2-layer draft costs a large fraction of the 4-layer target; with a large target "
            f"and a small draft, a draft forward is a few percent of a target forward.")


def _parse(argv) -> tuple[SpecBenchConfig, str, bool]:
    p = argparse.ArgumentParser(prog="python -m fleetlab bench spec", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a few-second run (tests, smoke checks)")
    p.add_argument("--out", help=f"results folder (default {DEFAULT_OUT})")
    p.add_argument("--rounds", type=int, help="timed rounds per configuration (after one warm-up)")
    p.add_argument("--seed", type=int)
    add_quiet(p)
    args = p.parse_args(argv)
    preset = "tiny" if args.tiny else "full"
    cfg = dataclasses.replace(PRESETS[preset])
    for name in ("out", "rounds", "seed"):
        value = getattr(args, name)
        if value is not None:
            setattr(cfg, name, value)
    if cfg.rounds < 1:
        p.error("--rounds must be >= 1")
    return cfg, preset, args.quiet


def main(argv=None) -> int:
    """Entry point of ``python -m fleetlab bench spec [options]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg, preset, quiet = _parse(argv)
    print(f"fleetlab speculative decoding benchmark ({preset}): results -> {cfg.out}", flush=True)
    result = run(cfg, preset, argv, quiet)
    print(summary(result))
    print(f"\n{describe(result['machine'])}")
    print(f"wrote {Path(cfg.out) / 'spec.json'} and {', '.join(result['plots'])} in {result['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
