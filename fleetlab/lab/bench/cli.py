"""``python -m fleetlab bench [NAME] [options]``: benchmarks are commands, not tests.

Names: ``all`` (default: the engine benchmark), ``engine`` (fleetlab vs PaddleFormers
generate, KV memory, prefix caching, step-time breakdown; ``--async-scheduling`` adds the
overlapped engine as a third throughput side), ``reorder`` (condense +
decode-first reorder cost), ``attention`` (the tiled paged attention against the naive one,
one layer), ``triton`` (Triton paged-attention kernels: decode, multi-token decode, prefill;
needs a GPU with torch and triton), ``serve`` (an OpenAI-compatible server under Poisson
traffic: TTFT / TPOT / ITL and throughput per request rate), ``tp`` (one process vs two
tensor-parallel processes: step time and the share spent in all-reduce), ``spec``
(speculative decoding on the shipped tiny model with its draft, and ngram on a repetitive
workload: acceptance, target forwards per output token, engine steps, wall-clock speed-up),
``structured`` (structured outputs outside the model: grammar compile time per constraint,
bitmask fill per row, masking), ``prefix`` (prefix caching: hash chain, radix tree and none on
shared-prefix, multi-turn and unrelated prompts; fcfs against longest-prefix-first), ``code``
(the code model: prompt lookup and its draft on a code-editing workload, prefix caching over a
real header),
``kv`` (KV connectors: the offload tier's hit rate and TTFT
against the pool alone, a new engine loading from shared storage, bytes moved between a
prefill rank and a decode rank), ``overlap`` (overlap scheduling against the synchronous loop at
batch 64 on the shipped tiny model: step wall time against the forward + sampling, tok/s, TTFT).

Each but ``triton`` writes its figures to ``benchmarks/results/`` (``--out`` for another folder),
records the machine's threads and load there (:mod:`fleetlab.lab.bench.machine`), and shows a
progress bar per section on stderr (``-q``: none).
"""

from __future__ import annotations

import importlib
import sys

# name -> module with main(argv), imported only when that benchmark runs (``triton`` needs torch and
# triton, ``serve`` httpx: optional dependencies the others must not require).
BENCHES = {
    "engine": "fleetlab.lab.bench.engine",
    "reorder": "fleetlab.lab.bench.reorder",
    "attention": "fleetlab.lab.bench.attention",
    "triton": "fleetlab.lab.bench.triton_attention",
    "serve": "fleetlab.lab.bench.serving",
    "tp": "fleetlab.lab.bench.tp",
    "spec": "fleetlab.lab.bench.spec",
    "structured": "fleetlab.lab.bench.structured",
    "prefix": "fleetlab.lab.bench.prefix",
    "code": "fleetlab.lab.bench.code",
    "kv": "fleetlab.lab.bench.kv",
    "overlap": "fleetlab.lab.bench.overlap",
}


def main(argv=None) -> int:
    """Run benchmark ``argv[0]`` (default ``all``) with the remaining options; returns its exit code.

    ``-h``/``--help``/``help`` alone lists the benchmarks; ``NAME --help`` shows one's options.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"], ["help"]):
        print(__doc__)
        return 0
    name = argv.pop(0) if argv and not argv[0].startswith("-") else "all"
    if name == "all":
        name = "engine"
    if name not in BENCHES:
        print(f"unknown benchmark {name!r}; choose from: all, {', '.join(BENCHES)}", file=sys.stderr)
        return 2
    return int(importlib.import_module(BENCHES[name]).main(argv) or 0)
