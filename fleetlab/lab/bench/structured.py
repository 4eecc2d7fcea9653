"""Benchmark: what structured outputs cost outside the model, with the llguidance backend.

* **compile**: seconds to compile each example constraint (``fleetlab.structured_output.examples``
  schemas, compact JSON; plus ``json_object``, a regex, a choice and a Lark grammar), median of
  ``--repeats`` fresh compiles (the cache bypassed), with the vocabulary check's share. On the
  JSON-capable character vocabulary (88 tokens) and on the shipped model's (55 tokens: only the
  constraints it can spell).
* **fill**: microseconds to fill one request's bitmask row, at every state along a valid output
  of each schema (so early and late states both count), one row at a time; and a 64-row step
  filled one by one against llguidance's thread pool (``fill_threads=2``).
* **apply**: microseconds for ``apply_token_bitmask`` on ``[rows, vocab]`` float32 logits (Paddle,
  current device), all rows constrained.
* **steps**: the engine's time per decode step with 0 %, 25 % and 100 % of ``--rows`` rows
  constrained (a JSON schema with a 40-character string, on a one-layer tiny random Llama over
  the JSON vocabulary), and of it the sampler's part, where the masks are filled, uploaded and
  applied. The fractions run interleaved, ``--step-runs`` times each; medians over every step in
  which all rows decode.

Run: ``python -m fleetlab bench structured`` (writes ``benchmarks/results/structured.json``;
``-q``: no progress bars).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from fleetlab.lab.bench.machine import machine_info
from fleetlab.lab.bench.progress import add_quiet, section

OUT = Path("benchmarks/results/structured.json")

OTHER_CONSTRAINTS = {
    "json_object": {"json_object": True, "disable_any_whitespace": True},
    "regex": {"regex": r"[0-9]{2} (red|blue) [a-z]{3,5}\."},
    "choice": {"choice": ["cat", "dog", "old man", "the red cat sat"]},
    "grammar": {"grammar": 'start: expr\nexpr: NUM | "(" expr "+" expr ")"\nNUM: /[0-9]+/'},
}
EXAMPLE_OUTPUTS = {  # a valid output per constraint: the fill benchmark walks its states
    "person": '{"name":"Ada","age":36}', "scores": "[1,22,3]", "flags": '{"color":"green","ok":true}',
    "nested": '{"id":7,"tags":["a","c"],"owner":{"name":"Bo"}}', "code": '{"code":"ABC-12","value":null}',
    "json_object": '{"a":[1,{"b":"x"}]}', "regex": "12 red cat.", "choice": "old man", "grammar": "(1+(22+3))",
}


def _constraints() -> dict[str, dict]:
    from fleetlab.structured_output.examples import SCHEMAS

    return {**{n: {"json": s, "disable_any_whitespace": True} for n, s in SCHEMAS.items()}, **OTHER_CONSTRAINTS}


def time_compiles(backend, constraints: dict[str, dict], repeats: int, bar) -> dict:
    """Per constraint: median compile and vocabulary-check milliseconds, or the refusal."""
    from fleetlab.structured_output import StructuredOutputsParams

    out = {}
    for name, fields in constraints.items():
        params = StructuredOutputsParams(**fields).validate(name)
        totals, checks = [], []
        for _ in range(repeats):
            try:
                grammar = backend.compile(params)
            except ValueError as exc:
                out[name] = {"refused": str(exc)}
                break
            totals.append(grammar.compile_time_s * 1e3)
            checks.append(grammar.check_time_s * 1e3)
        else:
            out[name] = {"compile_ms": statistics.median(totals), "check_ms": statistics.median(checks),
                         "min_ms": min(totals)}
        bar.update(1)
    return out


def time_fills(backend, constraints: dict[str, dict], rounds: int) -> dict:
    """Per constraint: median microseconds to fill one row, over every state of its example output."""
    from fleetlab.structured_output import StructuredOutputsParams

    out = {}
    row = backend.allocate_bitmask(1)
    for name, fields in constraints.items():
        grammar = backend.compile(StructuredOutputsParams(**fields).validate(name))
        tokens = backend.tokenize(EXAMPLE_OUTPUTS[name])
        samples = []
        for _ in range(rounds):
            matcher = grammar.matcher()
            for t in [*tokens, None]:
                t0 = time.perf_counter()
                matcher.fill_bitmask(row, 0)
                samples.append(time.perf_counter() - t0)
                if t is not None and not matcher.accept_tokens([t]):
                    raise RuntimeError(f"{name}: the example output is not valid at token {t}")
        out[name] = {"fill_us_median": statistics.median(samples) * 1e6, "states": len(tokens) + 1,
                     "fill_us_p90": float(np.percentile(samples, 90)) * 1e6}
    return out


def time_step_fill(tokenizer, constraints: dict[str, dict], rows: int, rounds: int) -> dict:
    """A step of ``rows`` constrained rows (mixed constraints, mid-output): one by one vs 2 threads."""
    from fleetlab.structured_output import StructuredOutputsParams
    from fleetlab.structured_output.guidance import GuidanceBackend

    out = {}
    for threads in (1, 2):
        backend = GuidanceBackend(tokenizer, fill_threads=threads)
        grammars = [backend.compile(StructuredOutputsParams(**f).validate(n)) for n, f in constraints.items()]
        matchers = []
        for i in range(rows):
            name = list(constraints)[i % len(grammars)]
            tokens = backend.tokenize(EXAMPLE_OUTPUTS[name])
            matchers.append((grammars[i % len(grammars)].matcher(replay=tokens[: i % len(tokens)]), i))
        bitmask = backend.allocate_bitmask(rows)
        samples = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            backend.fill_bitmasks(matchers, bitmask)
            samples.append(time.perf_counter() - t0)
        out[f"threads_{threads}"] = {"step_us_median": statistics.median(samples) * 1e6}
    return out


def time_apply(shapes: list[tuple[int, int]], rounds: int) -> list[dict]:
    """``apply_token_bitmask`` on random logits and masks, device time included (one read back)."""
    import paddle

    from fleetlab.device import upload
    from fleetlab.structured_output.bitmask import apply_token_bitmask

    out = []
    rng = np.random.default_rng(0)
    for rows, vocab in shapes:
        logits = upload(rng.standard_normal((rows, vocab)).astype(np.float32))
        mask = upload(rng.integers(-2**31, 2**31, size=(rows, -(-vocab // 32)), dtype=np.int64).astype(np.int32))
        apply_token_bitmask(logits, mask)
        samples = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            float(apply_token_bitmask(logits, mask)[0, 0])
            samples.append(time.perf_counter() - t0)
        out.append({"rows": rows, "vocab": vocab, "apply_us_median": statistics.median(samples) * 1e6,
                    "device": paddle.device.get_device()})
    return out


STEP_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["text"],
               "properties": {"text": {"type": "string", "minLength": 40, "maxLength": 40}}}
"""The step benchmark's constraint: every output is ``{"text":"<40 characters>"}`` (51 tokens)."""


def time_steps(fractions: tuple[float, ...], rows: int, runs: int, bar) -> dict:
    """Per fraction of constrained rows: median ms per decode step, and of it the sampler's."""
    from fleetlab import LLM, SamplingParams
    from fleetlab.models import tiny_json

    model, tok = tiny_json(num_hidden_layers=1)
    constrained = SamplingParams(max_tokens=64, structured_outputs={"json": STEP_SCHEMA,
                                                                    "disable_any_whitespace": True})
    plain = SamplingParams(max_tokens=51, ignore_eos=True)
    prompts = [tok.encode(f"request {i}: ") for i in range(rows)]
    samples = {f: {"step": [], "sample": []} for f in fractions}
    for _ in range(runs):
        for f in fractions:  # interleaved: a change in the machine's load hits every fraction alike
            k = round(f * rows)
            with LLM(model, tok, block_size=16, max_num_seqs=rows, record_traces=True) as llm:
                for i, p in enumerate(prompts):
                    llm.add_request(prompt_token_ids=p, sampling_params=constrained if i < k else plain)
                while llm.has_unfinished_requests():
                    t0 = time.perf_counter()
                    llm.step()
                    wall = time.perf_counter() - t0
                    trace = llm.traces[-1]
                    if len(trace.rows) == rows and all(r.phase == "decode" for r in trace.rows):
                        samples[f]["step"].append(wall)
                        samples[f]["sample"].append(trace.timings["sample"])
            bar.update(1)
    return {f"{round(f * 100)}%": {"constrained_rows": round(f * rows), "rows": rows,
                                   "steps": len(s["step"]), "step_ms_median": statistics.median(s["step"]) * 1e3,
                                   "sample_ms_median": statistics.median(s["sample"]) * 1e3}
            for f, s in samples.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fleetlab bench structured", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="fresh compiles per constraint")
    p.add_argument("--rounds", type=int, default=20, help="walks along each example output")
    p.add_argument("--rows", type=int, default=16, help="requests decoding at once in the step benchmark")
    p.add_argument("--step-runs", type=int, default=3, help="runs of each fraction of constrained rows")
    p.add_argument("--out", type=Path, default=OUT)
    add_quiet(p)
    args = p.parse_args(argv)
    from tqdm.auto import tqdm

    from fleetlab.models.json_tiny import json_tokenizer
    from fleetlab.models.pretrained import WEIGHTS_DIR
    from fleetlab.models.tokenizer import CharTokenizer
    from fleetlab.structured_output.guidance import GuidanceBackend

    constraints = _constraints()
    shipped = {n: constraints[n] for n in ("json_object", "person", "regex", "choice", "grammar")}
    result = {"machine": machine_info(), "repeats": args.repeats, "rounds": args.rounds}
    json_backend = GuidanceBackend(json_tokenizer())
    with tqdm(total=len(constraints) + len(shipped), desc="compiles", unit="constraint", file=sys.stderr,
              disable=args.quiet) as bar:
        result["compile_json_vocab"] = time_compiles(json_backend, constraints, args.repeats, bar)
        result["compile_shipped_vocab"] = time_compiles(GuidanceBackend(CharTokenizer.load(WEIGHTS_DIR)), shipped,
                                                        args.repeats, bar)
    result["fill_json_vocab"] = time_fills(json_backend, constraints, args.rounds)
    result["step_fill_64_rows"] = time_step_fill(json_tokenizer(), constraints, 64, args.rounds)
    result["apply"] = time_apply([(1, 88), (64, 88), (64, 32000), (64, 128000)], args.rounds)
    fractions = (0.0, 0.25, 1.0)
    with section("steps", len(fractions) * args.step_runs, quiet=args.quiet) as bar:
        result["steps"] = time_steps(fractions, args.rows, args.step_runs, bar)
    result["machine"]["load_average_end"] = machine_info(with_paddle=False)["load_average"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(format_report(result))
    print(f"wrote {args.out}")
    return 0


def format_report(result: dict) -> str:
    """The README's tables (markdown) from a ``structured.json`` result."""
    lines = ["| constraint | compile, JSON vocab (88) | of which vocab check | fill one row (median / p90) "
             "| compile, shipped vocab (55) |", "|---|---|---|---|---|"]
    for name, c in result["compile_json_vocab"].items():
        f = result["fill_json_vocab"][name]
        s = result["compile_shipped_vocab"].get(name)
        shipped = "" if s is None else ("refused" if "refused" in s else f"{s['compile_ms']:.2f} ms")
        lines.append(f"| {name} | {c['compile_ms']:.2f} ms | {c['check_ms']:.2f} ms | "
                     f"{f['fill_us_median']:.1f} / {f['fill_us_p90']:.1f} us | {shipped} |")
    step = result["step_fill_64_rows"]
    lines += ["", f"64 constrained rows filled in one step: {step['threads_1']['step_us_median']:.0f} us one by one, "
                  f"{step['threads_2']['step_us_median']:.0f} us on llguidance's pool of 2 threads.", "",
              "| apply_token_bitmask rows x vocab | us |", "|---|---|"]
    lines += [f"| {a['rows']} x {a['vocab']} | {a['apply_us_median']:.0f} |" for a in result["apply"]]
    if "steps" in result:
        lines += ["", "| constrained rows | decode step, median | of which sampling (masks filled, uploaded, "
                      "applied) |", "|---|---|---|"]
        lines += [f"| {name} ({s['constrained_rows']} of {s['rows']}) | {s['step_ms_median']:.1f} ms | "
                  f"{s['sample_ms_median']:.2f} ms |" for name, s in result["steps"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
