"""README's measured figures, rendered from the committed results files, or checked against them.

    python tools/readme_figures.py check    # exit 1, with a diff, where README and the results differ
    python tools/readme_figures.py render   # rewrite every figure block of README.md from the results

Every measured figure of README sits in a block between ``<!-- figures NAME -->`` and
``<!-- /figures NAME -->``; ``BLOCKS`` maps each NAME to its results file (under
``benchmarks/results/``, or the tiny model's ``training.json``) and the function that writes the
block's markdown from it. A block states the command that wrote the file, the threads and the
load the figures were measured under, and the figures; a sentence that compares two figures is
worded from the figures themselves. Prose outside the blocks quotes no measured number.
``tests/test_readme.py`` runs ``check``, so a re-run benchmark without a re-rendered README fails.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results"
TRAINING = ROOT / "fleetlab" / "models" / "weights" / "training.json"
WIDTH = 115  # README's prose line length

sys.path.insert(0, str(ROOT))  # run from anywhere: this checkout's fleetlab, not an installed one

from fleetlab.lab.bench.machine import describe  # noqa: E402


# ----------------------------------------------------------------------------- helpers
def fill(text: str) -> str:
    """A paragraph wrapped at README's width (markdown joins the lines again), never inside `code`."""
    text = re.sub(r"`[^`]*`", lambda m: m[0].replace(" ", "\0"), " ".join(text.split()))
    return textwrap.fill(text, WIDTH, break_long_words=False, break_on_hyphens=False).replace("\0", " ")


def command(result: dict, default: str) -> str:
    """The command line that wrote ``result``, with the threads it ran on: ``OMP_NUM_THREADS=1 python ...``."""
    cmd = (result.get("command") or default).strip()
    threads = (result.get("machine") or {}).get("omp_num_threads")
    return f"OMP_NUM_THREADS={threads} {cmd}" if threads else cmd


def ms(x: float) -> str:
    """Milliseconds (or any time) to two or three significant digits."""
    return f"{x:.0f}" if abs(x) >= 10 else f"{x:.1f}"


def trend(first: float, last: float, unit: str = " ms") -> str:
    """``"rises from 14 to 23 ms"``, ``"falls ..."``, or ``"stays at about 14 ms"`` (within 5%)."""
    if abs(last - first) <= 0.05 * max(abs(first), abs(last)):
        return f"stays at about {ms(first)}{unit}"
    return f"{'rises' if last > first else 'falls'} from {ms(first)} to {ms(last)}{unit}"


def compare(a: float, b: float) -> str:
    """How ``a`` stands to ``b``: ``"faster"``, ``"slower"`` or ``"about the same"`` (times; within 5%)."""
    if abs(a - b) <= 0.05 * max(a, b):
        return "about the same"
    return "faster" if a < b else "slower"


def not_measured(title: str, cmd: str, file: str) -> str:
    return fill(f"**{title}** — `{cmd}` writes `benchmarks/results/{file}`. No run of it is committed yet, "
                f"so no figure is quoted here.")


# ----------------------------------------------------------------------------- the blocks
def engine_block(r: dict | None) -> str:
    from fleetlab.lab.bench.report import headline_table

    intro = fill(
        f"**Engine vs PaddleFormers `generate`** — `{command(r, 'python -m fleetlab bench engine')}` "
        f"({r['elapsed_s']:.0f} s; writes `benchmarks/results/bench.json` and the PNGs `06_performance` draws), "
        f"best of {r['config']['repeats']} runs each side, taking turns. Measured on {describe(r['machine'])}:")
    return f"{intro}\n\n{headline_table(r)}"


def serving_block(r: dict) -> str:
    wl, runs = r["workload"], r["runs"]
    intro = fill(
        f"**Serving under Poisson traffic** — `{command(r, 'python -m fleetlab bench serve')}` "
        f"({r['elapsed_s']:.0f} s; starts `python -m fleetlab serve {r['server']['args']}`, then sends "
        f"{wl['num_prompts']} streamed completions per request rate, arrivals a Poisson process, "
        f"{wl['output_len'][0]}-{wl['output_len'][1]} output tokens each with `ignore_eos`; writes "
        f"`benchmarks/results/serving.json` and `serving.png`). Client and server share the machine: "
        f"{describe(r['machine'])}:")
    lines = ["| request rate | requests/s | output tok/s | TTFT mean / p50 / p99 | TPOT mean / p50 / p99 "
             "| ITL mean / p50 / p99 |", "|---|---|---|---|---|---|"]

    def stats(s):
        return " / ".join(ms(s[k]) for k in ("mean", "median", "p99")) + " ms"

    for run in runs:
        rate = "all at once" if run["rate"] == "inf" else f"{run['rate']:g}/s"
        lines.append(f"| {rate} | {run['request_throughput']:.1f} | {run['output_throughput']:.0f} | "
                     f"{stats(run['ttft_ms'])} | {stats(run['tpot_ms'])} | {stats(run['itl_ms'])} |")
    first, last = runs[0], runs[-1]
    where = "all at once" if last["rate"] == "inf" else f"at {last['rate']:g}/s"
    ttft = trend(first["ttft_ms"]["mean"], last["ttft_ms"]["mean"])
    tpot = trend(first["tpot_ms"]["mean"], last["tpot_ms"]["mean"])
    failed = sum(run["failed"] for run in runs)
    after = fill(f"From {first['rate']:g}/s to {where}, mean TTFT {ttft} and mean TPOT {tpot}; "
                 f"{'every request completed' if failed == 0 else f'{failed} requests failed'}.")
    return f"{intro}\n\n" + "\n".join(lines) + f"\n\n{after}"


def attention_block(r: dict | None) -> str:
    title = "Paged attention, tiled against naive"
    if r is None:
        return not_measured(title, "OMP_NUM_THREADS=1 python -m fleetlab bench attention", "attention.json")
    c = r["config"]
    decode, prefill = r["cases"]
    return fill(
        f"**{title}** (plain Paddle ops, one layer, Hq={c['heads']}, Hkv={c['kv_heads']}, D={c['head_dim']}, "
        f"block {c['block_size']}, {c['dtype']}) — `{command(r, 'python -m fleetlab bench attention')}` "
        f"(writes `benchmarks/results/attention.json`; median of {c['repeats']} calls after 2 warm-ups): "
        f"{decode['num_reqs']} decodes at context {decode['num_computed'] + 1} take {ms(decode['tiled_ms'])} ms "
        f"(the naive backend, one row at a time: {ms(decode['naive_ms'])} ms); a {prefill['query_len']}-token "
        f"prefill {ms(prefill['tiled_ms'])} ms (naive: {ms(prefill['naive_ms'])} ms). Measured on "
        f"{describe(r['machine'])}.")


def reorder_block(r: dict | None) -> str:
    title = "Condense + decode-first reorder per step"
    if r is None:
        return not_measured(title, "OMP_NUM_THREADS=1 python -m fleetlab bench reorder", "reorder.json")
    c = r["config"]
    intro = fill(
        f"**{title}** — `{command(r, 'python -m fleetlab bench reorder')}` (writes "
        f"`benchmarks/results/reorder.json`; median over {c['steps']} steps after {c['warmup']} warm-up steps, "
        f"in µs). Measured on {describe(r['machine'])}:")
    lines = ["| rows | condense + reorder | with the device sync | gather map (no moves) | with its upload |",
             "|---|---|---|---|---|"]
    for t in r["results"]:
        lines.append(f"| {t['rows']} | {t['moves_us']:.0f} µs | {t['moves_sync_us']:.0f} µs | "
                     f"{t['gather_us']:.0f} µs | {t['gather_upload_us']:.0f} µs |")
    return f"{intro}\n\n" + "\n".join(lines)


def tiny_model_block(t: dict) -> str:
    c, r = t["config"], t["result"]
    threads = c["num_threads"]
    return fill(
        f"**The shipped tiny model** — a PaddleFormers Llama ({r['num_params'] / 1e6:.1f}M parameters, "
        f"{c['num_hidden_layers']} layers, {r['model_bytes'] / 1e6:.0f} MB of safetensors) trained by "
        f"`python -m fleetlab train-tiny` ({r['steps']} steps, seed {c['seed']}, {threads} "
        f"thread{'s' if threads != 1 else ''}) in {r['wall_s']:.0f} s wall-clock, {r['cpu_s']:.0f} s of CPU time "
        f"(the machine's load was not recorded): it answers {100 * r['held_out_accuracy']:.1f}% of the "
        f"{r['num_held_out']:,} held-out two-digit additions (pairs never in its corpus) right "
        f"(`fleetlab/models/weights/training.json`); `tests/test_tiny_trained.py` checks >= 90%.")


CODE_DIR = ROOT / "fleetlab" / "models" / "code"


def code_model_block(bench: dict) -> str:
    """The code model's training and held-out figures (its and its draft's ``training.json``) and
    ``bench code``'s speculation and prefix-caching figures (``code.json``)."""
    model, draft = (json.loads((d / "training.json").read_text(encoding="utf-8"))
                    for d in (CODE_DIR, CODE_DIR / "draft"))
    mh, dh = model["evaluation"]["held_out"], draft["evaluation"]["held_out"]
    sample = model["evaluation"]["samples"][3]
    head = fill(
        f"**The shipped code model is undertrained.** It was trained on a 2-core CPU shared with other work by "
        f"`python -m fleetlab train-code --steps {model['config']['steps']}` (and `--draft --steps "
        f"{draft['config']['steps']}`): {model['config']['steps']} steps of {model['config']['batch_size']} × "
        f"{model['config']['seq_len']} tokens, "
        f"{model['config']['steps'] * model['config']['batch_size'] * model['config']['seq_len'] / 1e6:.1f}M tokens of "
        f"the {model['train_tokens'] / 1e6:.1f}M, in {model['cpu_s']:.0f} s of CPU time ({model['wall_s']:.0f} s "
        f"wall-clock); the draft took {draft['cpu_s']:.0f} s of CPU time. No GPU machine could be had while it was "
        f"built, so the GPU recipe above has not been run. Held-out figures (`python -m fleetlab train-code "
        f"--evaluate [--draft]`: every {mh['seq_len']}-token window of the held-out modules, {mh['tokens']:,} "
        f"tokens, Paddle on the CPU; in `fleetlab/models/code/training.json`):")
    table = ["| model | held-out loss (nats) | perplexity | next-token accuracy |", "| --- | --- | --- | --- |",
             f"| code model ({model['parameters'] / 1e6:.1f}M) | {mh['loss']:.2f} | {mh['perplexity']:.0f} | "
             f"{100 * mh['accuracy']:.1f}% |",
             f"| draft ({draft['parameters'] / 1e6:.2f}M) | {dh['loss']:.2f} | {dh['perplexity']:.0f} | "
             f"{100 * dh['accuracy']:.1f}% |"]
    looks = fill(
        "Greedy text has the look of the library (indentation, `self.`, `assertEqual`, test classes) but soon "
        "loops; the tests compare the held-out figures with a model of token frequencies alone "
        "(`tests/test_code_model.py`). One of the samples in `training.json`, prompt then completion:")
    looks += "\n\n```text\n" + sample["prompt"] + sample["completion"] + "\n```"
    runs = {(w, r["name"]): r for w in ("edit", "continue") for r in bench[w]}
    intro = fill(
        f"**Speculation and prefix caching on it** (`OMP_NUM_THREADS=1 {bench['command']}`, "
        f"`benchmarks/results/code.json`; {describe(bench['machine'])}). Greedy, "
        f"{bench['edit'][0]['num_output_tokens']} and {bench['continue'][0]['num_output_tokens']} output tokens "
        f"over the prompts cut from the held-out modules; "
        f"every run's tokens equal speculation off's: "
        f"{all(r['identical_to_off'] for r in runs.values())}.")
    spec = ["| workload | run | acceptance | tokens per verify step | target forwards per output token |",
            "| --- | --- | --- | --- | --- |"]
    for (w, name), r in runs.items():
        if name != "off":
            spec.append(f"| {w} | {name} | {r['acceptance_rate']:.2f} | {r['mean_acceptance_length']:.2f} | "
                        f"{r['forwards_per_token_vs_off']:.2f} of off's |")
    completion = bench["sample_edit"]["completion"]
    caveat = fill(
        f"Read the prompt-lookup figures with care: the model does not copy the function back (on the first `edit` "
        f"prompt, after the function's `def` line, it writes `{' '.join(completion.split())[:40]}`...), and "
        f"{100 * bench['edit'][0]['repeated_4gram_share']:.0f}% of "
        f"the 4-grams of its `edit` outputs ({100 * bench['continue'][0]['repeated_4gram_share']:.0f}% for "
        f"`continue`) repeat earlier ones of the same output. Prompt lookup reads the output too, so it predicts "
        f"those loops: the acceptance is mostly loops, not identifiers copied from the prompt.")
    radix, none = bench["prefix"]["runs"]
    prefix = fill(
        f"Prefix caching over a real shared header (`{bench['prefix']['header_module']}` up to its first method: "
        f"imports, module code, the class skeleton; {bench['prefix']['header_tokens']} tokens), then one request "
        f"per method `def` line: with the radix cache {radix['prefill_tokens_computed']:,} of "
        f"{radix['prompt_tokens']:,} prompt tokens were computed (hit rate {radix['hit_rate']:.2f}), with none all "
        f"{none['prefill_tokens_computed']:,}; {radix['seconds']:.1f} s against {none['seconds']:.1f} s for the batch "
        f"(one run each after a warm-up: indicative only); tokens identical: {radix['identical_tokens']}.")
    return "\n\n".join([head, "\n".join(table), looks, intro, "\n".join(spec), caveat, prefix])


def tp_block(r: dict) -> str:
    from fleetlab.lab.bench.tp import table

    m, wl = r["model"], r["workload"]
    runs = {run["name"]: run for run in r["runs"]}
    one, two = runs["tp1 x 1 thread"], runs["tp2 x 1 thread"]
    elapsed = f"{r['elapsed_s']:.0f} s; " if "elapsed_s" in r else ""
    model = (f"a random Llama (hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, "
             f"{m['num_attention_heads']} query / {m['num_key_value_heads']} KV heads, MLP {m['intermediate_size']})"
             if m else "the tiny test Llama")
    same = "identical" if r["identical_tokens"] and all(x["ranks_identical"] for x in r["runs"]) else "NOT identical"
    intro = fill(
        f"**Measured** — `{command(r, 'python -m fleetlab bench tp')}` ({elapsed}writes "
        f"`benchmarks/results/tp.json` and `tp_step_time.png`): {model}, {len(wl['prompt_lens'])} requests of "
        f"{min(wl['prompt_lens'])}-"
        f"{max(wl['prompt_lens'])} prompt tokens and {wl['max_tokens']} output tokens, greedy; tokens {same} in "
        f"all {len(r['runs'])} runs and on both ranks. Each run is a fresh process (or pair) with the threads its "
        f"name says. Measured on {describe(r['machine'])}:")
    after = fill(
        f"At decode two processes on two cores are {compare(two['decode_step_ms'], one['decode_step_ms'])} than "
        f"one process on one core ({ms(two['decode_step_ms'])} vs {ms(one['decode_step_ms'])} ms a step). Each "
        f"step adds {two['all_reduce_per_step']} all-reduces of a `[tokens, {m.get('hidden_size', 'hidden')}]` "
        f"float32 tensor: "
        f"{two['all_reduce_alone_ms']:.2f} ms each when both ranks call at once, but "
        f"{ms(two['all_reduce_ms_per_call'])} ms on average inside a serving step, where a rank also waits for "
        f"the other to reach the same layer; {100 * two['all_reduce_share']:.0f}% of the serving time. Steps "
        f"with prefill, where each rank's half of the matmuls is large, take {ms(two['prefill_step_ms'])} ms on "
        f"two processes against {ms(one['prefill_step_ms'])} ms on one: "
        f"{compare(two['prefill_step_ms'], one['prefill_step_ms'])} in this run.")
    return f"{intro}\n\n{table(r)}\n\n{after}"


def gpu_tp_block(g: dict) -> str:
    ar, mm = g["all_reduce_us"], g["layer_matmul_us"]
    small = [ar[f"{n}x4096"] for n in (1, 16, 64, 256)]

    def balance(tokens: str, reduce_us: float) -> str:
        saved = mm[tokens]["tp1"] - mm[tokens]["tp2"]
        net = saved - 2 * reduce_us
        return (f"saves {saved:.0f} µs of matmul per layer and pays 2 × {reduce_us:.0f} µs of all-reduce: "
                f"a net {'gain' if net > 0 else 'loss'} of {abs(net):.0f} µs a layer")

    return fill(
        f"What it would take on GPUs was measured with torch + NCCL on 2 {g['device']}s of one host (not Paddle; "
        f"`tools/gpu_tp_costs.py`, `benchmarks/results/gpu_tp_costs.json`; torch {g['torch']}, NCCL {g['nccl']}, "
        f"bf16, timed with CUDA events: the median of 50 calls after 10 warm-ups): an all-reduce of a decode step's "
        f"`[64, 4096]` costs {ar['64x4096']:.0f} µs ({min(small):.0f}-{max(small):.0f} µs at 1-256 tokens, "
        f"{ar['2048x4096']:.0f} µs at 2048), while one Llama-3-8B-shaped layer's matmuls take "
        f"{mm['64']['tp1']:.0f} µs whole and {mm['64']['tp2']:.0f} µs as one rank's half at 64 tokens, "
        f"{mm['2048']['tp1']:.0f} vs {mm['2048']['tp2']:.0f} µs at 2048 tokens. So splitting an 8B model over 2 "
        f"GPUs at decode (64 tokens) {balance('64', ar['64x4096'])}; at prefill (2048 tokens) it "
        f"{balance('2048', ar['2048x4096'])}.")


def spec_block(r: dict) -> str:
    cfg, k = r["config"], r["config"]["headline_k"]
    trained, rep = r["workloads"]["trained"], r["workloads"]["repetitive"]

    def run(wl, method, kk=None):
        return next(x for x in wl["runs"] if x["method"] == method and (kk is None or x["k"] == kk))

    off, draft, ngram = run(trained, "off"), run(trained, "draft", k), run(trained, "ngram", k)
    rep_off, rep_ngram = run(rep, "off"), run(rep, "ngram", k)
    alone = {a["k"]: a for a in r["alone"]["runs"]}
    tokens = off["num_tokens_by_request"]
    every = all(x["identical_to_off"] for wl in r["workloads"].values() for x in wl["runs"])
    g = r["goal"]
    intro = fill(
        f"**Measured** — `{command(r, 'python -m fleetlab bench spec')}` ({r['elapsed_s']:.0f} s; writes "
        f"`benchmarks/results/spec.json` and `spec.png`). Greedy, {'every' if every else 'NOT every'} run "
        f"token-identical to speculation off. *Trained*: the shipped model and its draft on {trained['num_requests']} "
        f"prompts of kinds it was trained on that produce at least {trained['min_output_tokens']} tokens (counting "
        f"and sentences, e.g. `\"count 57\"` -> `\" 58 59 60 61\"`, {min(tokens)}-{max(tokens)} tokens each, all "
        f"{trained['num_requests']} requests in one batch). *Repetitive*: ngram on a random tiny Llama (its greedy "
        f"output falls into loops), {rep['num_requests']} prompts repeated {cfg['rep_repeats']} times, "
        f"{cfg['rep_max_tokens']} tokens each. Target forwards per output token are counted per request: the steps "
        f"it is scheduled in over the tokens it gets. Wall-clock: {cfg['rounds']} interleaved rounds, median of the "
        f"per-round ratios. Measured on {describe(r['machine'])}:")
    alone_ks = [kk for kk in alone if kk and kk != k]
    alone_more = "".join(f" (k = {kk}: {alone[kk]['speedup']:.2f}x)" for kk in alone_ks)
    rows = [
        f"| | speculation off | draft, k = {k} | ngram, k = {k} |", "| --- | --- | --- | --- |",
        f"| trained: acceptance rate | | {draft['acceptance_rate']:.2f} ({draft['mean_acceptance_length']:.1f} "
        f"tokens per verify step) | {ngram['acceptance_rate']:.2f} |",
        f"| trained: target forwards per output token | {off['forwards_per_token']:.2f} | "
        f"**{draft['forwards_per_token']:.2f}** (worst request {g['worst_ratio']:.2f}: at most half of off for "
        f"{g['requests_meeting_goal']} of {g['num_requests']} requests) | {ngram['forwards_per_token']:.2f} |",
        f"| trained: engine steps for the whole batch | {off['num_steps']} | {draft['num_steps']} | "
        f"{ngram['num_steps']} |",
        f"| trained: wall-clock, whole batch | {1000 * off['wall_s_median']:.0f} ms | {draft['speedup']:.2f}x | "
        f"{ngram['speedup']:.2f}x |",
        f"| trained: wall-clock, {r['alone']['num_requests']} requests one at a time | "
        f"{1000 * alone[0]['wall_s_median']:.0f} ms | {alone[k]['speedup']:.2f}x{alone_more} | |",
        f"| repetitive: acceptance / forwards per token / steps / wall-clock | - / "
        f"{rep_off['forwards_per_token']:.2f} / {rep_off['num_steps']} / {1000 * rep_off['wall_s_median']:.0f} ms "
        f"| | {rep_ngram['acceptance_rate']:.2f} / {rep_ngram['forwards_per_token']:.2f} / "
        f"{rep_ngram['num_steps']} / {rep_ngram['speedup']:.2f}x |",
    ]
    plain, verify = off["ms_per_step"]["forward"], draft["ms_per_step"]["forward"]
    per_draft = draft["ms_per_step"]["propose"] / k
    bigger = [run(trained, "draft", kk) for kk in cfg["draft_ks"] if kk > k]
    ks = ", ".join(str(x["k"]) for x in bigger)
    fwd = ", ".join(f"{x['forwards_per_token']:.2f}" for x in bigger)
    speed = ", ".join(f"{x['speedup']:.2f}x" for x in bigger)
    more = f"k = {ks} give {fwd} target forwards per token at {speed} wall-clock"
    best_alone = max((a for a in alone.values() if a["k"]), key=lambda a: a["speedup"])
    where = (f"Fewer forwards are less time here only one request at a time (k = {best_alone['k']}: "
             f"{best_alone['speedup']:.2f}x), where a step's fixed cost dominates. "
             if best_alone["speedup"] > 1 >= draft["speedup"] else "")
    after = fill(
        f"A speculative step at k = {k} costs the target's verify forward ({k + 1} tokens a row instead of 1: "
        f"{verify / plain:.1f}x the time of a plain decode forward, {verify:.1f} vs {plain:.1f} ms) plus {k} forwards "
        f"of the draft, each {per_draft:.1f} ms ({per_draft / plain:.0%} of a plain target forward). {where}"
        f"Larger k saves few more forwards and costs more drafting ({more}): the answers are short, and drafts "
        f"land past the EOS. Prompt "
        f"lookup drafts in {ngram['ms_per_step']['propose']:.1f} ms a step, but on the trained model's short answers "
        f"it is right {ngram['acceptance_rate']:.0%} of the time.")
    return f"{intro}\n\n" + "\n".join(rows) + f"\n\n{after}"


def step_host_block(r: dict | None) -> str:
    title = "The engine's host time per decode step, checkouts side by side"
    cmd = "python benchmarks/step_host_time.py --rounds 40 <checkouts>"
    if r is None:
        return not_measured(title, cmd, "step_host_time.json")
    rows = r["checkouts"]
    intro = fill(
        f"**{title}** — `{command(r, cmd)}` (writes `benchmarks/results/step_host_time.json`): {rows[0]['batch']} "
        f"requests decoding on the small Llama with each step's forward replaced by its cached output, so that only "
        f"the engine's own work is left; one worker process per checkout, taking turns for {rows[0]['rounds']} rounds "
        f"of {r['steps_per_round']} steps (medians), and one real forward a round (contexts of 65 to 129 tokens). "
        f"On a machine whose speed swings between minutes, only figures taken side by side compare. Measured on "
        f"{describe(r['machine'])}:")
    table = ["| commit | host time per step | forward | host share of a step |", "|---|---|---|---|"]
    table += [f"| {c['commit']} | {c['host_ms_per_step']:.2f} ms | {ms(c['forward_ms'])} ms | "
              f"{100 * c['host_share_of_step']:.1f}% |" for c in rows]
    after = fill(f"From {rows[0]['commit']} to {rows[-1]['commit']} the host time per step "
                 f"{trend(rows[0]['host_ms_per_step'], rows[-1]['host_ms_per_step'])}.")
    return f"{intro}\n\n" + "\n".join(table) + f"\n\n{after}"


def prefix_block(r: dict | None) -> str:
    title = "Prefix caching: hash chain, radix tree, none; fcfs against longest prefix first"
    cmd = "python -m fleetlab bench prefix"
    if r is None:
        return not_measured(title, cmd, "prefix.json")
    intro = fill(f"**{title}** — `{command(r, cmd)}` (writes `benchmarks/results/prefix.json`): "
                 f"a random-init tiny Llama, block size {r['block_size']}, greedy, {r['params']['max_tokens']} "
                 f"output tokens a request; medians of {r['params']['rounds']} rounds, every configuration once a "
                 f"round on a fresh engine, in turns. Measured on {describe(r['machine'])}:")
    from fleetlab.lab.bench.prefix import table  # the bench prints the same rows
    pb = r["partial_block"]
    after = fill(f"few_shot: {r['params']['num_requests']} requests sharing a {r['params']['prefix_len']}-token "
                 f"prefix (not a block boundary); multi_turn: {r['params']['chats']} chats of {r['params']['turns']} "
                 f"turns, each extending the last; unrelated: nothing shared; groups: {r['params']['groups']} "
                 f"prefixes, {r['params']['per_group']} requests each, arriving interleaved into a pool of "
                 f"{r['params']['group_pool_blocks']} blocks. A match ending inside a block, the few_shot prefix's "
                 f"last {pb['k']} tokens after {pb['context']} cached ones: the radix tree's copy of them (K and V, "
                 f"every layer) took {pb['copy_us']:.0f} us, {pb['copy_us_per_token']:.0f} us a token; recomputing "
                 f"them in a {pb['q']}-token chunk added {pb['recompute_us_per_token']:.0f} us a token "
                 f"({pb['forward_k_plus_q_us'] / 1e3:.1f} against {pb['forward_q_us'] / 1e3:.1f} ms); copy and "
                 f"chunk took {pb['copy_then_forward_over_forward']:.2f}x the longer chunk (medians of "
                 f"{pb['rounds']} alternating rounds, `fleetlab/lab/bench/copy_cost.py`).")
    return f"{intro}\n\n{table(r)}\n\n{after}"


def kv_block(r: dict | None) -> str:
    title = "KV beyond one engine"
    cmd = "python -m fleetlab bench kv"
    if r is None:
        return not_measured(title, cmd, "kv.json")
    c, o, s, d = r["config"], r["offload"], r["shared_storage"], r["paddle_distributed"]
    pool, tier = o["runs"]["pool alone"], o["runs"]["pool + offload"]
    t = s["ttft_median_ms"]
    same = all((o["identical_tokens"], s["identical_tokens"], d["equal_single"], d["equal_forward"]))
    intro = fill(
        f"**{title}** — `{command(r, cmd)}` (writes `benchmarks/results/kv.json`): a random Llama "
        f"({c['model'].get('num_hidden_layers', 'tiny')} layers), prompts of {c['prompt_len']} tokens, blocks of "
        f"{c['block_size']}, requests one after another, engines built in turns ({c['turns']} each); tokens "
        f"{'identical' if same else 'NOT identical'} across every mode and section. Measured on "
        f"{describe(r['machine'])}:")
    table = ["| figure | value |", "|---|---|",
             f"| offload, {c['prompts']} prompts x {c['rounds']} rounds on a pool of {o['num_blocks']} blocks "
             f"(half the working set): pool hit rate alone / host tier hit rate | {pool['pool_hit_rate']:.2f} / "
             f"{tier['tier_hit_rate']:.2f} |",
             f"| offload: TTFT of the repeats, pool alone / with the tier (median) | "
             f"{ms(pool['repeat_ttft_median_ms'])} / {ms(tier['repeat_ttft_median_ms'])} ms |",
             f"| shared storage: a new engine's TTFT, computing / loading {s['loaded_tokens']} of {s['prompt_len']} "
             f"tokens (median) | {ms(t['new engine, computing'])} / {ms(t['new engine, loading'])} ms |",
             f"| prefill rank -> decode rank ({d['num_prompts']} requests on the tiny Fleet-style model, gloo): "
             f"bytes per loaded token / `2 x layers x kv_heads x head_dim x 4` | {d['bytes_per_token']:.0f} / "
             f"{d['expected_bytes_per_token']} |",
             f"| prefill rank -> decode rank: transfer time per request (its handshake out to its last layer in) | "
             f"{ms(d['recv_ms_per_request'])} ms |"]
    m, sp = d.get("mixed"), d.get("mixed_spread")
    if m and sp:
        mc, pair, one, ratio = m["config"], sp["pair"], sp["one engine"], sp["pair_over_one_engine"]
        runs = len(d["mixed_runs"])
        rng = lambda v: f"{ms(v[0])} ({ms(v[1])}-{ms(v[2])})"  # noqa: E731
        table += [f"| mixed ({mc['short']} short requests decoding {mc['short_tokens']} tokens, {mc['long']} "
                  f"prompts of {mc['long_len']} arriving; {runs} runs, median (range)): decode ITL p50 / p99, one "
                  f"engine (chunked prefill, {mc['budget']} tokens a step) | {rng(one['itl_p50_ms'])} / "
                  f"{rng(one['itl_p99_ms'])} ms |",
                  f"| mixed: decode ITL p50 / p99, prefill rank ({mc.get('prefill_budget', mc['budget'])} tokens a "
                  f"step) + decode rank | {rng(pair['itl_p50_ms'])} / {rng(pair['itl_p99_ms'])} ms |",
                  f"| mixed: the long prompts' TTFT, one engine / the pair (median of each run) | "
                  f"{rng(one['long_ttft_median_ms'])} / {rng(pair['long_ttft_median_ms'])} ms |",
                  f"| mixed: pair / one engine, median of the runs' ratios: ITL p99 / long-prompt TTFT | "
                  f"{ratio['itl_p99_ms']:.2f}x / {ratio['long_ttft_median_ms']:.2f}x |"]
    mixed = ""
    if m and sp:
        itl = "lower" if ratio["itl_p99_ms"] < 1 else "no lower"
        later = ratio["long_ttft_median_ms"] > 1
        mixed = (f" On the mixed workload (the pair and one engine in turn within each of {runs} runs) the pair's "
                 f"decode ITL p99 is {ratio['itl_p99_ms']:.2f}x one engine's and its long prompts' median TTFT "
                 f"{ratio['long_ttft_median_ms']:.2f}x: {itl} decode latency, "
                 f"{'bought with a later first token' if later else 'and no later first token'} (both ranks share "
                 f"the machine's two cores).")
    after = fill(
        f"With the host tier the repeats' TTFT is "
        f"{compare(tier['repeat_ttft_median_ms'], pool['repeat_ttft_median_ms'])} than with the pool alone, and a "
        f"new engine loading from the directory answers "
        f"{compare(t['new engine, loading'], t['new engine, computing'])} than one computing, in this run. The "
        f"transfer time includes the prefill rank computing the prompt and any handshake queued before it; the "
        f"decode rank keeps stepping meanwhile, the request held out of its batch (`WAITING_FOR_REMOTE_KVS`)."
        + mixed)
    return f"{intro}\n\n" + "\n".join(table) + f"\n\n{after}"


def overlap_block(r: dict | None) -> str:
    title = "Overlap scheduling against the synchronous loop"
    cmd = "python -m fleetlab bench overlap"
    if r is None:
        return not_measured(title, cmd, "overlap.json")
    c, s = r["config"], r["summary"]
    med, spread = s["median"], s.get("spread", {})
    intro = fill(
        f"**{title}** — `{command(r, cmd)}` (writes `benchmarks/results/overlap.json`): {c['batch']} requests of "
        f"{c['prompt_len'][0]}-{c['prompt_len'][1]} prompt tokens decoding {c['output_len']} tokens together on the "
        f"shipped tiny model, the loops taking turns for {c['rounds']} rounds each (medians of the rounds, and their "
        f"range; each round's figures are medians over its steady decode steps, from the engine's own phase "
        f"timestamps), thread switch interval {c['switch_interval'] * 1e3:g} ms. Measured on "
        f"{describe(r['machine'])}:")
    table = ["| loop | step | forward + sample | host phases | tok/s (range over rounds) | TTFT |",
             "|---|---|---|---|---|---|"]
    labels = (("sync", "synchronous"), ("overlap", "overlapped, `async_scheduling=True` (its gate chooses)"),
              ("overlap_always", "overlapped, every step (`gate.always`)"))
    for mode, label in labels:
        if mode not in med:
            continue
        m, rng = med[mode], spread.get(mode, {}).get("tok_s")
        span = f" ({rng[0]:.0f}-{rng[1]:.0f})" if rng else ""
        table.append(f"| {label} | {m['step_ms']:.2f} ms | {m['model_ms']:.2f} ms | {m['host_ms']:.2f} ms | "
                     f"{m['tok_s']:.0f}{span} | {ms(m['ttft_ms'])} ms |")
    probes = r.get("gate_probes", [])
    gate = (f" The gate probed {len(probes)} times in the overlapped engine's rounds and chose to overlap after "
            f"{sum(p['overlap'] for p in probes)} of them." if probes else "")
    always = (f"; overlapping every step, {s['paired_always_tok_s_ratio']:.2f}x" if "paired_always_tok_s_ratio" in s
              else "")
    after = fill(
        f"Round by round (each round's loops taken one right after the other, the median of the rounds' ratios) "
        f"the overlapped loop as built serves {s['paired_tok_s_ratio']:.2f}x the synchronous loop's tokens a second"
        f"{always}.{gate} Its time to the first token is {s['ttft_ratio']:.2f}x the synchronous loop's.")
    return f"{intro}\n\n" + "\n".join(table) + f"\n\n{after}"


def engine_overlap_block(r: dict | None) -> str:
    title = "`make bench` with the overlapped loop beside the synchronous one"
    cmd = "python -m fleetlab bench engine --async-scheduling --out benchmarks/results/engine_overlap"
    if r is None:
        return not_measured(title, cmd, "engine_overlap/bench.json")
    c, tp = r["config"], r["throughput"]
    wl = tp["workload"]
    intro = fill(
        f"**{title}** — `{command(r, cmd)}` ({r['elapsed_s']:.0f} s): the engine benchmark's throughput figure "
        f"({wl['num_requests']} requests, prompts {wl['prompt_len'][0]}-{wl['prompt_len'][1]}, outputs "
        f"{wl['output_len'][0]}-{wl['output_len'][1]} tokens, all queued at once) with a third side, "
        f"`LLM(async_scheduling=True)`; PaddleFormers `generate` (static batches of {tp['paddleformers_batch_size']}), "
        f"the synchronous engine and the overlapped one take turns (A B C, then C B A), best of {c['repeats']} runs "
        f"each, and each round's runs also compared with each other (the median of the rounds). The overlapped side "
        f"cannot record traces, so only its wall time, tokens and time to the first token are read; the thread "
        f"switch interval is {c['switch_interval'] * 1e3:g} ms while it runs. Measured on {describe(r['machine'])}:")
    table = ["| model | generate tok/s | synchronous tok/s | overlapped tok/s | overlapped / generate (target 3.2x) "
             "| synchronous / generate | overlapped / synchronous, round by round "
             "| TTFT (median request, best run), synchronous / overlapped |",
             "|---|---|---|---|---|---|---|---|"]
    for e in tp["models"]:
        sync, over, paired = e["fleetlab"], e["fleetlab_overlap"], e["paired"]
        table.append(
            f"| Llama {e['num_params'] / 1e6:.1f}M | {e['paddleformers']['tokens_per_s']:.0f} "
            f"| {sync['tokens_per_s']:.0f} | {over['tokens_per_s']:.0f} | **{e['overlap_speedup']:.2f}x** "
            f"(round by round {paired['overlap_speedup_median']:.2f}x) | {e['speedup']:.2f}x (round by round "
            f"{paired['speedup_median']:.2f}x) | {paired['overlap_over_sync_median']:.2f}x "
            f"| {ms(sync['best_ttft_ms'])} / {ms(over['best_ttft_ms'])} ms |")
    sentences = []
    for e in tp["models"]:
        sync, over = e["fleetlab"], e["fleetlab_overlap"]
        sentences.append(
            f"On the {e['num_params'] / 1e6:.1f}M-parameter Llama the overlapped engine is "
            f"{compare(over['best_s'], sync['best_s'])} than the synchronous one ({e['overlap_speedup']:.2f}x "
            f"generate's tokens a second against {e['speedup']:.2f}x), its time to the first token "
            f"{over['best_ttft_ms'] / sync['best_ttft_ms']:.2f}x the synchronous one's.")
    reached = sum(e["overlap_speedup"] >= 3.2 for e in tp["models"])
    where = {0: "at no model size", len(tp["models"]): "at every model size"}.get(reached, f"at {reached} of "
                                                                                   f"{len(tp['models'])} sizes")
    sentences.append(f"The issue's target, at least 3.2x generate's tokens a second with overlap, is reached {where} "
                     f"in this run.")
    after = fill(" ".join(sentences))
    return f"{intro}\n\n" + "\n".join(table) + f"\n\n{after}"


# name -> (results file, renderer); the renderer gets the parsed file, or None if there is none
BLOCKS = {
    "engine": (RESULTS / "bench.json", engine_block),
    "step-host": (RESULTS / "step_host_time.json", step_host_block),
    "serving": (RESULTS / "serving.json", serving_block),
    "attention": (RESULTS / "attention.json", attention_block),
    "reorder": (RESULTS / "reorder.json", reorder_block),
    "tiny-model": (TRAINING, tiny_model_block),
    "tp": (RESULTS / "tp.json", tp_block),
    "gpu-tp": (RESULTS / "gpu_tp_costs.json", gpu_tp_block),
    "spec": (RESULTS / "spec.json", spec_block),
    "prefix": (RESULTS / "prefix.json", prefix_block),
    "kv": (RESULTS / "kv.json", kv_block),
    "overlap": (RESULTS / "overlap.json", overlap_block),
    "engine-overlap": (RESULTS / "engine_overlap" / "bench.json", engine_overlap_block),
    "code-model": (RESULTS / "code.json", code_model_block),
}
_BLOCK = re.compile(r"<!-- figures (?P<name>[\w-]+) -->\n(?:(?P<body>.*?)\n)?<!-- /figures (?P=name) -->", re.S)


# ----------------------------------------------------------------------------- render / check
def render(name: str) -> str:
    """Block ``name``'s markdown, from its results file as committed now."""
    path, renderer = BLOCKS[name]
    data = json.loads(path.read_text(encoding="utf-8")) if path.exists() else None
    return renderer(data)


def blocks_in(text: str) -> dict[str, str]:
    """``{name: body}`` of every figure block in ``text``."""
    found = {}
    for m in _BLOCK.finditer(text):
        if m["name"] in found:
            raise ValueError(f"README has two figure blocks named {m['name']!r}")
        found[m["name"]] = m["body"] or ""
    unknown = sorted(set(found) - set(BLOCKS))
    missing = sorted(set(BLOCKS) - set(found))
    if unknown or missing:
        raise ValueError(f"README's figure blocks do not match tools/readme_figures.py's BLOCKS: "
                         f"unknown {unknown}, missing {missing}")
    return found


def drift(text: str) -> dict[str, str]:
    """``{name: unified diff}`` of every block of ``text`` that differs from its rendering."""
    out = {}
    for name, body in blocks_in(text).items():
        want = render(name)
        if body != want:
            out[name] = "".join(difflib.unified_diff(body.splitlines(True), want.splitlines(True),
                                                     f"README.md ({name})", f"rendered from {BLOCKS[name][0].name}"))
    return out


def rendered(text: str) -> str:
    """``text`` with every figure block rewritten from its results file."""
    blocks_in(text)  # every block present, none unknown
    return _BLOCK.sub(lambda m: f"<!-- figures {m['name']} -->\n{render(m['name'])}\n<!-- /figures {m['name']} -->",
                      text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("action", choices=["check", "render"])
    args = p.parse_args(argv)
    text = README.read_text(encoding="utf-8")
    if args.action == "render":
        new = rendered(text)
        README.write_text(new, encoding="utf-8")
        print(f"README.md: {len(BLOCKS)} figure blocks rendered" + ("" if new != text else " (no change)"))
        return 0
    diffs = drift(text)
    for diff in diffs.values():
        print(diff)
    if diffs:
        print(f"README's figures differ from the results in {sorted(diffs)}: run python tools/readme_figures.py render",
              file=sys.stderr)
        return 1
    print(f"README.md: all {len(BLOCKS)} figure blocks match the results files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
