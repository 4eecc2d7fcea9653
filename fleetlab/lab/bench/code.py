"""Benchmark: speculation and prefix caching on the code model, over real code.

The code model (``fleetlab.models.load_code()``) and its draft, greedy, on prompts cut from the
held-out modules of its corpus (never trained on; :data:`fleetlab.models.code_corpus.HELD_OUT`):

- ``edit``: a code-editing workload. Each prompt holds one held-out function, a comment asking
  for the same function again with a new docstring, and the function's ``def`` line: the
  completion repeats the prompt's identifiers and lines, which prompt lookup (``ngram``)
  finds in the prompt. Run with speculation off, ``ngram`` at ``k`` in :data:`NGRAM_KS`, and
  the draft model at ``k`` in :data:`DRAFT_KS`;
- ``continue``: the same functions' first lines, continued: plain generation, where prompt
  lookup has less to find (the draft model's other workload);
- ``prefix``: requests sharing a real header (the imports and the class skeleton of a held-out
  module, several hundred tokens) each followed by its own method's ``def`` line, with prefix
  caching on (radix tree) and off: prefill tokens computed, hit rate, time.

Per speculative run (from :func:`fleetlab.lab.bench.spec.measure`): acceptance rate, tokens per
verify step, target forwards per output token (per request, from the step traces), and
whether the tokens equal speculation off (greedy: they must). ``off``'s ``repeated_4gram_share``
says how much of the output repeats itself: an undertrained model loops, and prompt lookup, which
reads the output too, predicts loops trivially. Times are single runs on a
fresh engine after a warm-up, so read them as indicative; the counts are exact.

Results: ``<out>/code.json`` (default ``benchmarks/results``).

Run: ``OMP_NUM_THREADS=1 python -m fleetlab bench code [--tiny] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import sys
import time
from pathlib import Path

from fleetlab import LLM, SamplingParams
from fleetlab.lab.bench.machine import MachineRecord, describe
from fleetlab.lab.bench.spec import measure, spec_config
from fleetlab.models import load_code
from fleetlab.models.code_corpus import documents, iter_files

DEFAULT_OUT = Path("benchmarks/results")
NGRAM_KS = (3, 5)
DRAFT_KS = (2, 4)
PRESETS = {"full": dict(num_prompts=12, max_tokens=64, header_requests=8, suffix_tokens=48),
           "tiny": dict(num_prompts=2, max_tokens=12, header_requests=2, suffix_tokens=4)}  # fmt: skip
HEADER_MODULE = "fractions.py"
EDIT_INSTRUCTION = "\n\n# The same function again, with a shorter docstring:\n"


def held_out_functions(limit: int, max_chars: int = 700) -> list[str]:
    """Top-level functions and methods of the held-out modules (source text, dedented), shortest
    first among those of 6 to ``max_chars`` characters, at most ``limit``; deterministic."""
    found: list[str] = []
    for f in iter_files("held_out"):
        lines = f.text.splitlines(keepends=True)
        for node in ast.walk(ast.parse(f.text)):
            if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno >= 5:
                body = "".join(lines[node.lineno - 1 - len(node.decorator_list) : node.end_lineno])
                indent = len(body) - len(body.lstrip(" "))
                text = "".join(line[indent:] for line in body.splitlines(keepends=True))
                if len(text) <= max_chars:
                    found.append(text)
    found.sort(key=lambda t: (len(t), t))
    step = max(1, len(found) // max(1, limit))
    return found[::step][:limit]


def edit_prompts(functions: list[str]) -> list[str]:
    """``function + instruction + its def line`` for each function (see the module docstring)."""
    return [fn + EDIT_INSTRUCTION + fn.splitlines(keepends=True)[0] for fn in functions]


def continue_prompts(functions: list[str]) -> list[str]:
    """Each function's first two lines."""
    return ["".join(fn.splitlines(keepends=True)[:2]) for fn in functions]


def header_and_suffixes(tok, num: int) -> tuple[str, list[str], int]:
    """The shared header (imports and the first class's skeleton of :data:`HEADER_MODULE`, up to
    its first method), ``num`` distinct method ``def`` lines of that module, and the header's tokens."""
    text = documents("held_out", [HEADER_MODULE])[0]
    tree = ast.parse(text)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef))
    methods = [n for n in cls.body if isinstance(n, ast.FunctionDef)]
    lines = text.splitlines(keepends=True)
    header = "".join(lines[: methods[0].lineno - 1])
    suffixes = [lines[m.lineno - 1] for m in methods[1 : num + 1]]
    return header, suffixes, len(tok.encode(header))


def spec_runs(model, draft, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """Speculation off, ngram at NGRAM_KS, draft at DRAFT_KS on ``prompts`` (greedy, EOS honoured)."""
    sampling = SamplingParams(max_tokens=max_tokens)
    configs = [("off", None)]
    configs += [(f"ngram k={k}", spec_config("ngram", k, prompt_lookup_min=2, prompt_lookup_max=4)) for k in NGRAM_KS]
    configs += [(f"draft k={k}", spec_config("draft", k, draft=draft)) for k in DRAFT_KS]
    runs = [measure(model, prompts, sampling, spec=spec, name=name, block_size=16) for name, spec in configs]
    off_tokens = runs[0]["token_ids"]
    runs[0]["repeated_4gram_share"] = repeated_ngram_share(off_tokens, 4)
    for run in runs:
        run["identical_to_off"] = run["token_ids"] == off_tokens
        run["forwards_per_token_vs_off"] = run["forwards_per_token"] / runs[0]["forwards_per_token"]
        for key in ("token_ids", "forwards_per_token_by_request", "num_forwards_by_request", "num_tokens_by_request"):
            run.pop(key)
    return runs


def repeated_ngram_share(outputs: list[list[int]], n: int) -> float:
    """Share of the outputs' ``n``-grams that already occurred earlier in the same output: how
    much of the text is loops (which prompt lookup, reading the output too, predicts trivially)."""
    repeated = total = 0
    for ids in outputs:
        seen: set[tuple[int, ...]] = set()
        for i in range(len(ids) - n + 1):
            gram = tuple(ids[i : i + n])
            repeated += gram in seen
            seen.add(gram)
            total += 1
    return repeated / max(1, total)


def prefix_runs(model, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """The shared-header requests with the radix prefix cache and with none, after one warm-up each."""
    results = []
    for cache in ("radix", None):
        for _warm_then_timed in range(2):
            with LLM(model, block_size=16, max_num_seqs=8, prefix_cache=cache) as llm:
                start = time.perf_counter()
                outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=max_tokens,
                                    ignore_eos=True), use_tqdm=False)  # fmt: skip
                seconds, s = time.perf_counter() - start, llm.stats()
        lens = sum(len(p) for p in prompts)
        computed = s["prefix_cache_query_tokens"] - s["prefix_cache_hit_tokens"] if cache else lens
        results.append({"prefix_cache": cache or "none", "prompt_tokens": lens,
                        "prefill_tokens_computed": int(computed),
                        "hit_rate": s["prefix_cache_hit_rate"] if cache else 0.0, "seconds": seconds,
                        "tokens": [o.token_ids for o in outs]})  # fmt: skip
    same = results[0].pop("tokens") == results[1].pop("tokens")
    for r in results:
        r["identical_tokens"] = same
    return results


def run_bench(preset: str) -> dict:
    p = PRESETS[preset]
    machine = MachineRecord()
    model, tok = load_code()
    draft, _ = load_code(draft=True)
    functions = held_out_functions(p["num_prompts"])
    encode = lambda texts: [tok.encode(t) for t in texts]  # noqa: E731
    header, suffixes, header_tokens = header_and_suffixes(tok, p["header_requests"])
    result = {
        "preset": preset, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m fleetlab bench code" + (" --tiny" if preset == "tiny" else ""),
        "edit": spec_runs(model, draft, encode(edit_prompts(functions)), p["max_tokens"]),
        "continue": spec_runs(model, draft, encode(continue_prompts(functions)), p["max_tokens"]),
        "prefix": {"header_module": HEADER_MODULE, "header_tokens": header_tokens,
                   "runs": prefix_runs(model, encode([header + s for s in suffixes]), p["suffix_tokens"])},
        "sample_edit": {"prompt": edit_prompts(functions[:1])[0]},
    }  # fmt: skip
    with LLM(model, tok, block_size=16) as llm:
        out = llm.generate(edit_prompts(functions[:1]), SamplingParams(max_tokens=p["max_tokens"]), use_tqdm=False)
    result["sample_edit"]["completion"] = out[0].text
    result["machine"] = machine.close()
    return result


def table(result: dict) -> str:
    rows = []
    for workload in ("edit", "continue"):
        for r in result[workload]:
            rows.append(f"{workload:9s} {r['name']:11s} acceptance {r['acceptance_rate']:.2f}  tokens/verify "
                        f"{r['mean_acceptance_length']:.2f}  forwards/token {r['forwards_per_token']:.3f} "
                        f"({r['forwards_per_token_vs_off']:.2f}x off) same tokens {r['identical_to_off']}")  # fmt: skip
        rows.append(f"{workload:9s} output 4-grams repeated within the output: "
                    f"{result[workload][0]['repeated_4gram_share']:.2f}")
    for r in result["prefix"]["runs"]:
        rows.append(f"prefix    {r['prefix_cache']:6s} header {result['prefix']['header_tokens']} tokens: prefill "
                    f"{r['prefill_tokens_computed']}/{r['prompt_tokens']} tokens, hit rate {r['hit_rate']:.2f}, "
                    f"{r['seconds']:.2f} s")  # fmt: skip
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fleetlab bench code", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a seconds-long smoke run")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    result = run_bench("tiny" if args.tiny else "full")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "code.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(table(result))
    print(describe(result["machine"]))
    print(f"wrote {out / 'code.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

