"""Host time per output token of the ways to turn token ids into text, side by side.

    python benchmarks/detokenize.py [--rounds 7] [--out benchmarks/results/detokenize.json]

The text is real code (the standard library's ``textwrap.py``, one of the files every machine has)
tokenized by the code model's byte-level BPE; its tokens are fed one at a time, as an engine step
gains them, to:

- ``decode_stream``: :class:`~fleetlab.output.detokenizer.FastIncrementalDetokenizer` (the
  ``tokenizers`` library's ``DecodeStream``; what the engine uses for a fast tokenizer);
- ``offsets``: :class:`~fleetlab.output.detokenizer.SlowIncrementalDetokenizer` (prefix and read
  offsets over ``tokenizer.decode``; the engine's path for other tokenizers), on the same tokenizer;
- ``text_stream``: :class:`~fleetlab.output.text.TextStream` with two stop strings that never
  appear (detokenization, stop-string search and hold-back: the whole per-request text path);
- ``full_decode``: ``tokenizer.decode(ids[:n])`` after every token (what a stop-string check
  that re-decodes the output does; cost grows with the length).

Each round times every method once per length, in an order that alternates from round to round,
so all meet the same moments of a busy machine (with Python's garbage collector run before each
timing and off during it). Per token and length, the best of the rounds (``*_us_per_token``: the
cost with the least interference from the other processes of a busy machine) and the median are
printed (one JSON line per length) and written with the machine's load to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import inspect
import json
import statistics
import textwrap
import time

LENGTHS = (128, 512, 2048)


def methods(tok):
    from fleetlab.output.detokenizer import FastIncrementalDetokenizer, SlowIncrementalDetokenizer
    from fleetlab.output.text import TextStream

    def stream(cls):
        def run(ids):
            d = cls(tok, [1])
            for t in ids:
                d.push([t])
            d.flush()
        return run

    def text_stream(ids):
        s = TextStream(tok, [1], ["\x00never", "§§"])
        for t in ids:
            s.push([t])
        s.finish()

    def full_decode(ids):
        for n in range(1, len(ids) + 1):
            tok.decode(ids[:n], skip_special_tokens=True)

    return {"decode_stream": stream(FastIncrementalDetokenizer), "offsets": stream(SlowIncrementalDetokenizer),
            "text_stream": text_stream, "full_decode": full_decode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/results/detokenize.json")
    args = parser.parse_args()
    from fleetlab.lab.bench.machine import MachineRecord
    from fleetlab.models import load_code_tokenizer

    tok = load_code_tokenizer()
    ids = tok.encode(inspect.getsource(textwrap), add_special_tokens=False)
    ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    assert len(ids) >= max(LENGTHS), len(ids)
    runs = methods(tok)
    times = {(name, n): [] for name in runs for n in LENGTHS}
    with MachineRecord() as machine:
        for r in range(args.rounds):
            order = list(runs) if r % 2 == 0 else list(reversed(runs))
            for n in LENGTHS:
                for name in order:
                    gc.collect()  # a collection the previous method's garbage set off would land on this one
                    gc.disable()
                    t0 = time.perf_counter()
                    runs[name](ids[:n])
                    times[name, n].append((time.perf_counter() - t0) / n * 1e6)
                    gc.enable()
    rows = []
    for n in LENGTHS:
        row = {"tokens": n, **{f"{name}_us_per_token": round(min(times[name, n]), 2) for name in runs},
               **{f"{name}_us_per_token_median": round(statistics.median(times[name, n]), 2) for name in runs}}
        print(json.dumps(row))
        rows.append(row)
    result = {"command": f"python benchmarks/detokenize.py --rounds {args.rounds}", "rows": rows,
              "text": "inspect.getsource(textwrap), code tokenizer", "rounds": args.rounds,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine.info}
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
