"""``python -m fleetlab bench [engine]``: fleetlab's engine measured side by side with PaddleFormers.

Every figure is measured in one run, on one machine, with the same models and requests:

1. **throughput** -- output tokens/s of ``LLM.generate`` against PaddleFormers'
   ``model.generate`` on the unpatched model (greedy, static left-padded batches of
   ``pf_batch_size`` requests, its own KV cache), on a mixed workload (prompt and output
   lengths uniform random in given ranges), at two model sizes. Both sides generate exactly
   each request's output length (``ignore_eos`` / no EOS), and only those tokens count (a
   static batch decodes until its longest request is done; the extra tokens are waste).
   The greedy tokens of both sides are compared request by request (``agreement``).
   fleetlab's timed run records a ``StepTrace`` per step (figure 2 reads them): that cost
   counts against it. ``--async-scheduling`` adds a third side, fleetlab overlapped
   (``LLM(async_scheduling=True)``, which cannot record traces: only its wall time, CPU time,
   steps, time to the first token and tokens are read), taking turns with the other two; each
   round's ratios are also taken pair by pair (``paired``), the sides of a pair run one right
   after the other.
2. **kv_memory** -- the share of allocated KV memory that holds real tokens, summed over
   the steps of the run: fleetlab's paged cache (blocks in use) against the padded
   contiguous cache of the static batches (``B x (longest prompt + steps so far)``) and
   against a contiguous cache reserving the workload's longest sequence per running request.
3. **prefix_caching** -- requests sharing a long prefix, prefix caching on against off.
4. **step_breakdown** -- where a step's time goes (schedule, batch_update, metadata,
   forward, sample, update, other) in decode steps at a small and a large batch.

Results go to ``<out>/bench.json`` and ``<out>/*.png`` (default ``benchmarks/results``),
which the ``06_performance`` notebook reads; :mod:`fleetlab.lab.bench.report` draws the
PNGs and the README table. ``--tiny`` runs a few-second version (tests). A progress bar per
section goes to stderr (``-q``: none).

JSON schema (``schema_version`` 1; times in seconds unless the key says ``_ms``)::

    schema_version: 1
    created: ISO-8601 time; command: the command line; preset: "full" | "tiny"; elapsed_s: float
    machine: {platform, processor, cpu_count, python, paddle, paddleformers, device, omp_num_threads,
              load_average: [1, 5, 15 min] at the start, load_average_end: the same at the end,
              cpu_use: {seconds, total, own, other}: mean busy cores while measuring}
              (see fleetlab.lab.bench.machine)
    config: the BenchConfig used (all fields)
    throughput:
      workload: {name, num_requests, prompt_len: [lo, hi], output_len: [lo, hi],
                 num_prompt_tokens, num_output_tokens}
      paddleformers_batch_size: int
      engine: {block_size, max_num_seqs, max_num_batched_tokens, enable_prefix_caching}
      models: list of
        {size, num_params, config: {model config overrides},
         paddleformers: {seconds, cpu_seconds (lists, one per repeat), best_s, best_cpu_s, output_tokens,
                         tokens_per_s (from best_s), generated_tokens (incl. static-batch waste),
                         num_batches, batch_size},
         fleetlab: {seconds, cpu_seconds, best_s, best_cpu_s, output_tokens, tokens_per_s,
                    num_steps, num_preemptions, core (the engine core's class name),
                    ttft_ms (lists, one per repeat: median arrival to first token), best_ttft_ms},
         fleetlab_overlap (only with --async-scheduling): {...the same keys as fleetlab},
         overlap_speedup, overlap_cpu_time_speedup, overlap_agreement (only with --async-scheduling):
             as speedup, cpu_time_speedup and agreement, for the overlapped side,
         paired (only with --async-scheduling): {speedup, overlap_speedup, overlap_over_sync: lists of
             tokens/s ratios, one per repeat, each from the same round; *_median: their medians},
         speedup: fleetlab tokens_per_s / paddleformers tokens_per_s (wall clock),
         cpu_time_speedup: paddleformers best_cpu_s / fleetlab best_cpu_s (process CPU time:
                           steadier than wall clock when other work shares the machine),
         agreement: {requests, identical_requests, matching_token_fraction}}
    kv_memory:
      size: model size used; block_size: int; bytes_per_token: int
      paged:    {token_fill, token_steps, slot_steps, peak_slots, peak_bytes}
      padded:   {...same keys}   (static batches of paddleformers_batch_size, as generate runs them)
      reserved: {...same keys}   (the workload's longest sequence reserved per running request)
      token_fill = token_steps / slot_steps: real tokens over allocated token slots, summed over
      steps. peak_* is the most held at once; it depends on how many requests run together
      (all of them for fleetlab, one batch for generate), so compare token_fill, not peaks.
    prefix_caching:
      size, workload: {... as above, prefix_len}
      on / off: {seconds, tokens_per_s, prefill_tokens_computed, hit_rate, num_steps}
      speedup: on tokens_per_s / off tokens_per_s; identical_outputs: bool
    step_breakdown: list of (one per batch size)
      {batch_size, size, num_steps (decode steps with every row decoding),
       ms_per_step: {schedule, batch_update, metadata, forward, sample, update, other, total},
       overhead_share: (total - forward) / total}
    plots: list of PNG file names written next to bench.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import paddle
from paddleformers.utils.log import logger as pf_logger

from fleetlab import LLM, SamplingParams
from fleetlab.lab.bench.machine import MachineRecord, describe
from fleetlab.lab.bench.overlap import switch_interval
from fleetlab.lab.bench.progress import add_quiet, bars_and_logs, run_step, section
from fleetlab.lab.bench.report import STEP_KEYS, headline_table, write_plots
from fleetlab.lab.bench.workloads import Workload, mixed_workload, padded_batches, shared_prefix_workload
from fleetlab.models import tiny

logger = logging.getLogger(__name__)

DEFAULT_OUT = Path("benchmarks/results")

# Random-init Llama configs (``fleetlab.models.tiny("llama", **overrides)``).
MODEL_SIZES = {
    # 1.0M parameters: per-step Python overhead dominates.
    "small": {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512},
    # 3.4M parameters: the forward pass weighs more against the engine's per-step overhead.
    "base": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
             "num_key_value_heads": 4, "head_dim": 32, "vocab_size": 1024},
    # For --tiny: the test-sized model.
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128},
}
# An EOS id for PaddleFormers' generate that no sampled token can equal (EOS off).
NO_EOS = -1


@dataclass(slots=True)
class BenchConfig:
    """Every knob of one benchmark run (the ``full`` and ``tiny`` presets are instances)."""

    sizes: tuple[str, ...] = ("small", "base")
    num_requests: int = 64
    prompt_len: tuple[int, int] = (16, 256)
    output_len: tuple[int, int] = (16, 256)
    pf_batch_size: int = 16
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    repeats: int = 2
    seed: int = 0
    # prefix caching
    prefix_requests: int = 32
    prefix_len: int = 384
    prefix_suffix_len: tuple[int, int] = (8, 32)
    prefix_output_len: tuple[int, int] = (8, 32)
    # step breakdown: decode steps at these batch sizes
    breakdown_batches: tuple[int, ...] = (4, 64)
    breakdown_prompt_len: tuple[int, int] = (64, 128)
    breakdown_output_len: int = 48
    # throughput only: a third side, fleetlab with async_scheduling=True, and the interpreter's thread
    # switch interval while it runs (as ``bench overlap`` measures it; 0: Python's default)
    async_scheduling: bool = False
    switch_interval: float = 0.0002
    out: str = str(DEFAULT_OUT)


PRESETS = {
    "full": BenchConfig(),
    "tiny": BenchConfig(sizes=("tiny",), num_requests=6, prompt_len=(4, 24), output_len=(2, 10), pf_batch_size=4,
                        max_num_seqs=8, max_num_batched_tokens=64, prefix_requests=4, prefix_len=32,
                        prefix_suffix_len=(2, 6), prefix_output_len=(2, 4), breakdown_batches=(2, 6),
                        breakdown_prompt_len=(4, 8), breakdown_output_len=6, repeats=1),
}


# ----------------------------------------------------------------------------- models
def build_model(size: str, max_len: int, seed: int = 0):
    """A random-init PaddleFormers Llama of ``size`` (see ``MODEL_SIZES``) holding ``max_len`` positions."""
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; choose from {sorted(MODEL_SIZES)}")
    return tiny("llama", seed=seed, max_position_embeddings=int(max_len), **MODEL_SIZES[size])


def num_params(model) -> int:
    """How many parameters ``model`` holds."""
    return int(sum(int(np.prod(p.shape)) for p in model.parameters()))


# ----------------------------------------------------------------------------- the two sides
def run_paddleformers(model, workload: Workload, batch_size: int) -> dict:
    """Greedy ``model.generate`` on static left-padded batches; returns time and tokens.

    Each batch decodes ``max_new_tokens`` = its longest output; a request's tokens are the
    first ``output_len`` of its row. EOS is off, like fleetlab's ``ignore_eos``: ``generate``
    falls back to the config's EOS when given ``None``, so it gets :data:`NO_EOS`, an id no
    token can take.
    """
    tokens: list[list[int]] = [[] for _ in range(workload.num_requests)]
    generated = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    for batch in padded_batches(workload, batch_size, pad_token_id=model.config.pad_token_id or 0):
        ids, _ = model.generate(input_ids=paddle.to_tensor(batch.input_ids),
                                attention_mask=paddle.to_tensor(batch.attention_mask),
                                max_new_tokens=batch.max_new_tokens, decode_strategy="greedy_search",
                                eos_token_id=NO_EOS, use_cache=True)
        ids = ids.numpy()
        if ids.shape[1] != batch.max_new_tokens:
            raise RuntimeError(f"PaddleFormers generate returned {ids.shape[1]} tokens per row, "
                               f"expected max_new_tokens={batch.max_new_tokens}: did it stop at an EOS?")
        generated += ids.size
        for row, i in enumerate(batch.indices):
            tokens[i] = [int(t) for t in ids[row, : workload.output_lens[i]]]
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "tokens": tokens, "generated_tokens": int(generated),
            "num_batches": -(-workload.num_requests // batch_size), "batch_size": batch_size}


def make_llm(model, cfg: BenchConfig, max_model_len: int, **overrides):
    """A fleetlab ``LLM`` on ``model`` with the benchmark's engine settings (traces recorded, except
    with ``async_scheduling=True``, which refuses them)."""
    engine = {"block_size": cfg.block_size, "max_num_seqs": cfg.max_num_seqs,
              "max_num_batched_tokens": cfg.max_num_batched_tokens, "max_model_len": max_model_len,
              "record_traces": not overrides.get("async_scheduling", False), "seed": cfg.seed}
    engine.update(overrides)
    # A pool that holds every row at full length, as the figures were measured (the engine's default
    # pool preempts under load: here that would measure memory pressure, not the engine).
    engine.setdefault("num_blocks", engine["max_num_seqs"] * -(-max_model_len // cfg.block_size))
    return LLM(model, **engine)


def run_fleetlab(model, workload: Workload, cfg: BenchConfig, **overrides) -> dict:
    """``LLM.generate`` on the workload (greedy, ``ignore_eos``); the model is unpatched after.

    ``async_scheduling=True`` runs the overlapped core, under ``cfg.switch_interval`` (restored after).
    ``ttft_s``: the median over requests of arrival to first token (all arrive at once)."""
    llm = make_llm(model, cfg, workload.max_seq_len + 1, **overrides)
    try:
        with switch_interval(cfg.switch_interval if llm.config.async_scheduling else 0):
            params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in workload.output_lens]
            start, cpu_start = time.perf_counter(), time.process_time()
            outs = llm.generate(prompt_token_ids=workload.prompts, sampling_params=params, use_tqdm=False)
            seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        stats = llm.stats()
    finally:
        llm.close()  # the overlapped core's model thread stops, then the model is unpatched
    ttft = float(np.median([o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs]))
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "tokens": [list(o.token_ids) for o in outs],
            "traces": llm.traces, "core": type(llm.core).__name__, "ttft_s": ttft,
            "stats": stats, "block_size": llm.pool.block_size}


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How far two sides' greedy tokens agree: identical requests, and the share of tokens
    before each request's first difference."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = 0
    for x, y in zip(a, b):
        n = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        prefix += n
    total = sum(len(x) for x in a)
    return {"requests": len(a), "identical_requests": int(same),
            "matching_token_fraction": prefix / total if total else 1.0}


# ----------------------------------------------------------------------------- KV memory
def paged_occupancy(traces, block_size: int) -> dict:
    """Real tokens vs allocated token slots of the paged cache, summed over steps.

    A step's allocation is the distinct blocks its rows hold; a block holds the row's
    tokens that fall inside it once the step has written them.
    """
    token_steps = slot_steps = peak = 0
    for tr in traces:
        filled: dict[int, int] = {}
        for row in tr.rows:
            n = row.num_computed_tokens + row.num_scheduled_tokens
            for j, block in enumerate(row.block_ids):
                filled[block] = max(filled.get(block, 0), min(block_size, n - j * block_size))
        token_steps += sum(max(0, v) for v in filled.values())
        slot_steps += len(filled) * block_size
        peak = max(peak, len(filled) * block_size)
    return _occupancy(token_steps, slot_steps, peak)


def padded_occupancy(workload: Workload, batch_size: int) -> dict:
    """The same figure for static batches as ``generate`` runs them.

    Model call ``t`` of a batch (``t = 0`` is the prefill) leaves ``B x (L + t)`` positions in
    the cache (``L`` = longest prompt); row ``i`` holds ``p_i + min(t, o_i - 1)`` real tokens
    (it never needs more than its prompt and its outputs but the last).
    """
    token_steps = slot_steps = peak = 0
    for batch in padded_batches(workload, batch_size):
        width = batch.input_ids.shape[1]
        p = np.array([len(workload.prompts[i]) for i in batch.indices])
        o = np.array([workload.output_lens[i] for i in batch.indices])
        for t in range(batch.max_new_tokens):
            token_steps += int((p + np.minimum(t, o - 1)).sum())
            slot_steps += len(p) * (width + t)
        peak = max(peak, len(p) * (width + batch.max_new_tokens - 1))
    return _occupancy(token_steps, slot_steps, peak)


def reserved_occupancy(traces, max_seq_len: int) -> dict:
    """Contiguous per-request reservation: every running request holds ``max_seq_len`` slots."""
    token_steps = slot_steps = peak = 0
    for tr in traces:
        token_steps += sum(r.num_computed_tokens + r.num_scheduled_tokens for r in tr.rows)
        slot_steps += len(tr.rows) * max_seq_len
        peak = max(peak, len(tr.rows) * max_seq_len)
    return _occupancy(token_steps, slot_steps, peak)


def _occupancy(token_steps: int, slot_steps: int, peak_slots: int) -> dict:
    return {"token_fill": token_steps / slot_steps if slot_steps else 0.0, "peak_slots": int(peak_slots),
            "token_steps": int(token_steps), "slot_steps": int(slot_steps)}


# ----------------------------------------------------------------------------- the figures
def bench_throughput(cfg: BenchConfig, workload: Workload, quiet: bool = True) -> tuple[dict, dict]:
    """Figure 1 at every model size, plus figure 2 (KV memory) from the first size's runs."""
    models, kv_memory = [], None
    for size in cfg.sizes:
        model = build_model(size, workload.max_seq_len + 1, seed=cfg.seed)
        sides = 3 if cfg.async_scheduling else 2
        with section(f"throughput, {size} model", 1 + sides * cfg.repeats, quiet=quiet) as bar:
            entry, fl = _measure_size(model, size, cfg, workload, bar)
        models.append(entry)
        logger.info("throughput %s: paddleformers %.0f tok/s, fleetlab %.0f tok/s (x%.2f)", size,
                    entry["paddleformers"]["tokens_per_s"], entry["fleetlab"]["tokens_per_s"], entry["speedup"])
        if kv_memory is None:
            kv_memory = _kv_memory(size, model, workload, cfg, fl)
    engine = {"block_size": cfg.block_size, "max_num_seqs": cfg.max_num_seqs,
              "max_num_batched_tokens": cfg.max_num_batched_tokens, "enable_prefix_caching": True}
    return ({"workload": workload.describe(), "paddleformers_batch_size": cfg.pf_batch_size,
             "engine": engine, "models": models}, kv_memory)


def _measure_size(model, size: str, cfg: BenchConfig, workload: Workload, bar=None) -> tuple[dict, dict]:
    """Both sides (three with ``cfg.async_scheduling``) on one model, ``cfg.repeats`` times each,
    alternating the order (A B C, C B A, ...: on a shared machine the load drifts; the best run of
    each side counts, and ``paired`` compares each round's runs). ``bar``: a progress bar advanced
    once per run (the warm-up counts as one). Returns the entry and the synchronous side's last run."""
    run_step(bar, "warm-up", lambda: _warm_up(model, workload, cfg))
    runs: dict[str, list[dict]] = {"pf": [], "fl": [], "ov": []}
    for i in range(cfg.repeats):
        sides = [(f"PaddleFormers generate {i + 1}/{cfg.repeats}",
                  lambda: runs["pf"].append(run_paddleformers(model, workload, cfg.pf_batch_size))),
                 (f"fleetlab LLM {i + 1}/{cfg.repeats}", lambda: runs["fl"].append(run_fleetlab(model, workload, cfg)))]
        if cfg.async_scheduling:
            sides.append((f"fleetlab overlapped {i + 1}/{cfg.repeats}",
                          lambda: runs["ov"].append(run_fleetlab(model, workload, cfg, async_scheduling=True))))
        for what, run_side in sides if i % 2 == 0 else sides[::-1]:
            run_step(bar, what, run_side)
    pf, fl = runs["pf"][-1], runs["fl"][-1]
    entry = {
        "size": size, "num_params": num_params(model), "config": dict(MODEL_SIZES[size]),
        "paddleformers": {**_timing(runs["pf"], workload), "generated_tokens": pf["generated_tokens"],
                          "num_batches": pf["num_batches"], "batch_size": pf["batch_size"]},
        "fleetlab": _fleetlab_side(runs["fl"], workload),
        "agreement": agreement(pf["tokens"], fl["tokens"]),
    }
    entry["speedup"] = entry["fleetlab"]["tokens_per_s"] / entry["paddleformers"]["tokens_per_s"]
    entry["cpu_time_speedup"] = entry["paddleformers"]["best_cpu_s"] / entry["fleetlab"]["best_cpu_s"]
    if cfg.async_scheduling:
        entry.update(_overlap_side(runs, workload, entry["paddleformers"]))
    return entry, fl


def _fleetlab_side(runs: list[dict], workload: Workload) -> dict:
    """One fleetlab side's figures over its runs: timing, steps, preemptions, its core, TTFT."""
    last = runs[-1]
    ttft = [1e3 * r["ttft_s"] for r in runs]
    return {**_timing(runs, workload), "num_steps": last["stats"]["num_steps"],
            "num_preemptions": last["stats"]["num_preemptions"], "core": last["core"],
            "ttft_ms": ttft, "best_ttft_ms": min(ttft)}


def _overlap_side(runs: dict[str, list[dict]], workload: Workload, pf: dict) -> dict:
    """The overlapped side's entry keys: its figures, its ratios to PaddleFormers (best runs, and
    round by round against the runs taken beside it)."""
    side = _fleetlab_side(runs["ov"], workload)
    tok_s = {k: [workload.num_output_tokens / r["seconds"] for r in rs] for k, rs in runs.items()}
    paired = {"speedup": [f / p for f, p in zip(tok_s["fl"], tok_s["pf"])],
              "overlap_speedup": [o / p for o, p in zip(tok_s["ov"], tok_s["pf"])],
              "overlap_over_sync": [o / f for o, f in zip(tok_s["ov"], tok_s["fl"])]}
    paired.update({f"{k}_median": float(np.median(v)) for k, v in list(paired.items())})
    return {"fleetlab_overlap": side, "overlap_speedup": side["tokens_per_s"] / pf["tokens_per_s"],
            "overlap_cpu_time_speedup": pf["best_cpu_s"] / side["best_cpu_s"],
            "overlap_agreement": agreement(runs["pf"][-1]["tokens"], runs["ov"][-1]["tokens"]), "paired": paired}


def _timing(runs: list[dict], workload: Workload) -> dict:
    """Wall-clock and CPU seconds of every run; tokens/s from the fastest wall-clock run."""
    wall = [r["seconds"] for r in runs]
    cpu = [r["cpu_seconds"] for r in runs]
    return {"seconds": wall, "cpu_seconds": cpu, "best_s": min(wall), "best_cpu_s": min(cpu),
            "output_tokens": workload.num_output_tokens, "tokens_per_s": workload.num_output_tokens / min(wall)}


def _warm_up(model, workload: Workload, cfg: BenchConfig) -> None:
    """One short run of each side, so first-call costs (kernel setup, allocations) are not timed."""
    small = Workload("warm-up", [p[:8] for p in workload.prompts[:2]], [2, 2])
    run_paddleformers(model, small, 2)
    run_fleetlab(model, small, cfg)
    if cfg.async_scheduling:
        run_fleetlab(model, small, cfg, async_scheduling=True)


def _kv_memory(size: str, model, workload: Workload, cfg: BenchConfig, fl: dict) -> dict:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 4  # K+V, float32
    result = {"size": size, "block_size": cfg.block_size, "bytes_per_token": int(per_token),
              "paged": paged_occupancy(fl["traces"], fl["block_size"]),
              "padded": padded_occupancy(workload, cfg.pf_batch_size),
              "reserved": reserved_occupancy(fl["traces"], workload.max_seq_len)}
    for key in ("paged", "padded", "reserved"):
        result[key]["peak_bytes"] = result[key]["peak_slots"] * per_token
    return result


def bench_prefix_caching(cfg: BenchConfig, bar=None) -> dict:
    """Figure 3: a shared-prefix workload with prefix caching on and off. ``bar``: a progress
    bar advanced once per run (warm-up, on, off)."""
    size = cfg.sizes[0]
    vocab = MODEL_SIZES[size]["vocab_size"]
    wl = shared_prefix_workload(cfg.prefix_requests, cfg.prefix_len, cfg.prefix_suffix_len,
                                cfg.prefix_output_len, vocab, seed=cfg.seed + 1)
    model = build_model(size, wl.max_seq_len + 1, seed=cfg.seed)
    run_step(bar, "warm-up", lambda: run_fleetlab(model, wl.head(2), cfg))
    runs = {}
    for name, on in (("on", True), ("off", False)):  # "on" first: any warm-up advantage goes to "off"
        fl = run_step(bar, f"{cfg.prefix_requests} requests, caching {name}",
                      lambda on=on: run_fleetlab(model, wl, cfg, enable_prefix_caching=on))
        decode_tokens = sum(1 for tr in fl["traces"] for r in tr.rows if r.phase == "decode")
        prefill = sum(tr.num_batched_tokens for tr in fl["traces"]) - decode_tokens
        runs[name] = {"seconds": fl["seconds"], "tokens_per_s": wl.num_output_tokens / fl["seconds"],
                      "prefill_tokens_computed": int(prefill), "hit_rate": fl["stats"]["prefix_cache_hit_rate"],
                      "num_steps": len(fl["traces"]), "tokens": fl["tokens"]}
    same = runs["on"].pop("tokens") == runs["off"].pop("tokens")
    return {"size": size, "workload": {**wl.describe(), "prefix_len": cfg.prefix_len}, **runs,
            "speedup": runs["on"]["tokens_per_s"] / runs["off"]["tokens_per_s"], "identical_outputs": same}


def bench_step_breakdown(cfg: BenchConfig) -> list[dict]:
    """Figure 4: per-step time by part, in steps where every one of ``batch`` rows decodes."""
    size = cfg.sizes[0]
    vocab = MODEL_SIZES[size]["vocab_size"]
    results = []
    for batch in cfg.breakdown_batches:
        wl = mixed_workload(batch, cfg.breakdown_prompt_len, (cfg.breakdown_output_len,) * 2, vocab,
                            seed=cfg.seed + 2)
        model = build_model(size, wl.max_seq_len + 1, seed=cfg.seed)
        run_fleetlab(model, wl.head(2), cfg)  # warm-up
        llm = make_llm(model, cfg, wl.max_seq_len + 1, max_num_seqs=max(batch, cfg.max_num_seqs))
        try:
            for prompt, n in zip(wl.prompts, wl.output_lens):
                llm.add_request(prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=n, ignore_eos=True))
            sums, steps = dict.fromkeys((*STEP_KEYS, "other", "total"), 0.0), 0
            while llm.has_unfinished_requests():
                start = time.perf_counter()
                llm.step()
                trace = llm.traces[-1]
                wall = time.perf_counter() - start - trace.timings["record"]  # less the recorder's own time
                if len(trace.rows) == batch and all(r.phase == "decode" for r in trace.rows):
                    for key in STEP_KEYS:
                        sums[key] += trace.timings.get(key, 0.0)
                    sums["other"] += wall - sum(trace.timings.get(k, 0.0) for k in STEP_KEYS)
                    sums["total"] += wall
                    steps += 1
        finally:
            llm.handle.unpatch()
        ms = {k: 1000 * v / max(steps, 1) for k, v in sums.items()}
        share = (ms["total"] - ms["forward"]) / ms["total"] if ms["total"] else 0.0
        results.append({"batch_size": batch, "size": size, "num_steps": steps, "ms_per_step": ms,
                        "overhead_share": share})
        logger.info("step breakdown batch %d: %.2f ms/step, overhead %.1f%%", batch, ms["total"], 100 * share)
    return results


# ----------------------------------------------------------------------------- output


def run(cfg: BenchConfig, preset: str = "custom", argv=None, quiet: bool = True) -> dict:
    """Run every figure with ``cfg``; write ``bench.json`` and the PNGs to ``cfg.out``; return the result.

    ``quiet=False`` shows a progress bar per section on stderr.
    """
    start = time.perf_counter()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = MachineRecord()
    result = {
        "schema_version": 1,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m fleetlab bench engine " + " ".join(argv or []), "preset": preset,
        "machine": machine.info, "config": dataclasses.asdict(cfg),
    }
    vocab = min(MODEL_SIZES[s]["vocab_size"] for s in cfg.sizes)
    workload = mixed_workload(cfg.num_requests, cfg.prompt_len, cfg.output_len, vocab, seed=cfg.seed)
    result["throughput"], result["kv_memory"] = bench_throughput(cfg, workload, quiet)
    with section("prefix caching", 3, quiet=quiet) as bar:
        result["prefix_caching"] = bench_prefix_caching(cfg, bar)
    result["step_breakdown"] = []
    with section("step breakdown", len(cfg.breakdown_batches), quiet=quiet, unit="batch") as bar:
        for batch in cfg.breakdown_batches:  # one batch size at a time, so the bar moves
            bar.set_postfix_str(f"decode steps at batch {batch}")
            result["step_breakdown"] += bench_step_breakdown(dataclasses.replace(cfg, breakdown_batches=(batch,)))
            bar.update()
    machine.close()
    result["plots"] = write_plots(result, out)
    result["elapsed_s"] = time.perf_counter() - start
    (out / "bench.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


def _parse(argv) -> tuple[BenchConfig, str, bool]:
    p = argparse.ArgumentParser(prog="python -m fleetlab bench engine", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a few-second run (tests, smoke checks)")
    p.add_argument("--out", help=f"results folder (default {DEFAULT_OUT})")
    p.add_argument("--sizes", help="comma-separated model sizes from " + ",".join(MODEL_SIZES))
    p.add_argument("--num-requests", type=int)
    p.add_argument("--prompt-len", type=int, nargs=2, metavar=("LO", "HI"))
    p.add_argument("--output-len", type=int, nargs=2, metavar=("LO", "HI"))
    p.add_argument("--pf-batch-size", type=int, help="PaddleFormers static batch size")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--repeats", type=int, help="timed runs per side; the best counts")
    p.add_argument("--seed", type=int)
    p.add_argument("--async-scheduling", action="store_true",
                   help="throughput: also measure fleetlab with async_scheduling=True (overlap), taking turns")
    p.add_argument("--switch-interval", type=float,
                   help="seconds: thread switch interval while the overlapped side runs (default 0.0002; 0: Python's)")
    add_quiet(p)
    args = p.parse_args(argv)
    preset = "tiny" if args.tiny else "full"
    cfg = dataclasses.replace(PRESETS[preset])
    for name in ("out", "num_requests", "pf_batch_size", "max_num_seqs", "max_num_batched_tokens", "repeats", "seed",
                 "switch_interval"):
        value = getattr(args, name)
        if value is not None:
            setattr(cfg, name, value)
    if args.sizes:
        cfg.sizes = tuple(s.strip() for s in args.sizes.split(",") if s.strip())
        unknown = [s for s in cfg.sizes if s not in MODEL_SIZES]
        if unknown:
            p.error(f"unknown sizes {unknown}; choose from {sorted(MODEL_SIZES)}")
    if args.prompt_len:
        cfg.prompt_len = tuple(args.prompt_len)
    if args.output_len:
        cfg.output_len = tuple(args.output_len)
    cfg.async_scheduling = args.async_scheduling
    return cfg, preset, args.quiet


def main(argv=None) -> int:
    """Entry point of ``python -m fleetlab bench [engine] [options]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg, preset, quiet = _parse(argv)
    _quiet_libraries()
    print(f"fleetlab engine benchmark ({preset}): results -> {cfg.out}", flush=True)
    with bars_and_logs():
        result = run(cfg, preset, argv, quiet)
    print(f"{describe(result['machine'])}\n")
    print(headline_table(result))
    print(f"\nwrote {Path(cfg.out) / 'bench.json'} and {', '.join(result['plots'])} in {result['elapsed_s']:.0f} s")
    return 0


def _quiet_libraries() -> None:
    """PaddleFormers logs a warning per ``generate`` call; keep the benchmark's output readable."""
    pf_logger.set_level("ERROR")


if __name__ == "__main__":
    sys.exit(main())
