"""The README's reading guide: the files one request passes through, in order, with their size.

    python tools/read_the_engine.py            # print the table (Markdown) and the core's total
    python tools/read_the_engine.py --check    # exit 1 if README.md's table differs from it

"Code lines" leave out blank lines, comments and docstrings; "lines" are the file as it is.
The README carries the table between ``<!-- read-the-engine -->`` and ``<!-- /read-the-engine -->``.
"""

from __future__ import annotations

import argparse
import ast
import io
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
START, END = "<!-- read-the-engine -->", "<!-- /read-the-engine -->"

# (file, where the request is in it) in the order a request meets them: every module one decode step passes
# through (tests/test_read_the_engine.py traces a step and holds this list to it), the edge and the
# attention to read first beside them.
PATH = [
    ("fleetlab/llm.py", "`LLM.add_request`: the front door takes a prompt; `LLM.step` runs a step"),
    ("fleetlab/edge/input_processor.py", "`InputProcessor.process`: every check, once, at the edge"),
    ("fleetlab/engine/request.py", "`Request`: the scheduler's record of it"),
    ("fleetlab/engine/core.py", "`EngineCore.step`: schedule, execute, update"),
    ("fleetlab/engine/hooks.py", "`StepHooks`: the step's phases, and where observers see it"),
    ("fleetlab/engine/scheduler.py", "`Scheduler.schedule`: admitted under the token budget"),
    ("fleetlab/kv/manager.py", "`KVCacheManager.allocate_slots`: prefix-cache hits, then new blocks"),
    ("fleetlab/prefix_cache/__init__.py", "`PrefixCache`: what the pool calls (`hash_chain.py` by default)"),
    ("fleetlab/kv/block_pool.py", "`BlockPool`: reference counts, LRU free queue, the prefix cache's hooks"),
    ("fleetlab/kv_transfer/base.py", "`KVConnector`: the connector's calls in every step (the null one by default)"),
    ("fleetlab/engine/messages.py", "`SchedulerOutput`: the step's plan sent to the runner"),
    ("fleetlab/engine/model_runner.py", "`ModelRunner.execute`: the plan applied to the batch, the model run"),
    ("fleetlab/engine/input_batch.py", "`InputBatch`: its row, condensed and reordered decode-first"),
    ("fleetlab/engine/batch_fields.py", "`Field`: every per-request buffer, declared once"),
    ("fleetlab/device.py", "`upload_packed`: the step's host arrays to the device in one copy"),
    ("fleetlab/attention/metadata.py", "`AttentionMetadata.from_batch`: positions, `slot_mapping`, `block_tables`"),
    ("fleetlab/attention/context.py", "`forward_context`: how attention deep in the model finds the step"),
    ("fleetlab/patching/handle.py", "`PatchHandle`: the patched model, checked live and the step well formed"),
    ("fleetlab/patching/paddleformers.py", "the model's own forward, its attention routed to fleetlab's"),
    ("fleetlab/attention/backend.py", "`AttentionBackend.forward`: write K/V, then `attend`"),
    ("fleetlab/kv/paged_cache.py", "`PagedKVCache.write`: K/V into their slots"),
    ("fleetlab/attention/naive.py", "`naive_paged_attention`: the attention to read (`tiled.py` batches it)"),
    ("fleetlab/attention/tiled.py", "`TiledBackend.attend`: the default attention, rows batched into tiles"),
    ("fleetlab/engine/sampler.py", "`Sampler`: its next token, in the step's one device read"),
    ("fleetlab/engine/logits_processor.py", "`apply_processor`: each logits processor called, its result checked"),
    ("fleetlab/structured_output/processor.py", "grammar masks, a logits processor (no constraint: nothing to do)"),
    ("fleetlab/processors/penalties.py", "`PenaltiesProcessor`: penalties and `logit_bias`, a logits processor"),
    ("fleetlab/errors.py", "`refuse`, `call_extension`: a failure names what failed"),
    ("fleetlab/engine/outputs.py", "`RequestOutput`: what `Scheduler.update` hands back"),
    ("fleetlab/output/processor.py", "`OutputProcessor`: stop strings, logprobs, fan-in, text (beside the core)"),
    ("fleetlab/output/text.py", "`TextStream`: its text token by token, cut at a stop string"),
    ("fleetlab/output/detokenizer.py", "incremental detokenization: `DecodeStream`, or prefix and read offsets"),
    ("fleetlab/output/stop.py", "stop strings: the search, and what a stream holds back"),
    ("fleetlab/output/logprobs.py", "`LogprobsCollector`: the step's log-probabilities, by request"),
    ("fleetlab/inspect/recorder.py", "`StepRecorder`: a trace of every step (`record_traces=True`, beside the core)"),
]
# A request asking for more than one sequence or for logprobs also passes through these.
SAMPLING_PATH = [
    ("fleetlab/output/parallel_sampling.py", "`ParentRequest`: `n` children sharing the prompt's blocks"),
    ("fleetlab/engine/logprobs.py", "log-probabilities, in the step's one read"),
]
# With speculative decoding, the request also passes through these.
SPEC_PATH = [
    ("fleetlab/spec_decode/proposer.py", "`Proposer`: how many drafts a row may take"),
    ("fleetlab/spec_decode/ngram.py", "prompt lookup"),
    ("fleetlab/spec_decode/draft.py", "a draft model on its own paged cache"),
    ("fleetlab/spec_decode/proposer_batch.py",
     "`ProposerInputBatch`: the proposer's fields in the main batch, moved with its rows"),
    ("fleetlab/spec_decode/rejection.py", "`RejectionSampler`: drafts verified, the target's distribution kept"),
]
# The core as issue 31 counts it: engine/, kv/, attention/ (naive, metadata, backend; the tiled and
# Triton backends are plug-ins beside it, picked by name), its context.py, spec_decode/, the front door.
CORE = ["fleetlab/engine", "fleetlab/kv", "fleetlab/attention/naive.py",
        "fleetlab/attention/metadata.py", "fleetlab/attention/backend.py", "fleetlab/attention/context.py",
        "fleetlab/spec_decode", "fleetlab/llm.py", "fleetlab/registry.py"]


def code_lines(path: Path) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    source = path.read_text(encoding="utf-8")
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
                    first.value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    lines = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - docstrings)


def core_files() -> list[Path]:
    files = []
    for entry in CORE:
        path = ROOT / entry
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


def package_lines(folder: str) -> int:
    return sum(code_lines(p) for p in sorted((ROOT / folder).rglob("*.py")))


def table() -> str:
    """The reading guide as Markdown."""
    rows = ["| # | file | what happens to the request there | code lines | lines |", "|---|---|---|---|---|"]
    for i, (name, what) in enumerate(PATH + SAMPLING_PATH + SPEC_PATH, 1):
        path = ROOT / name
        note = (" (speculative decoding)" if (name, what) in SPEC_PATH else
                " (`n`, logprobs)" if (name, what) in SAMPLING_PATH else "")
        rows.append(f"| {i} | `{name}` | {what}{note} | {code_lines(path)} | "
                    f"{len(path.read_text(encoding='utf-8').splitlines())} |")
    files = core_files()
    total = sum(code_lines(p) for p in files)
    rows.append(f"\nThe whole core (engine/, kv/, attention's naive, metadata, backend and context, "
                f"spec_decode/, the front door and its registry): **{total} code lines in {len(files)} files**; the "
                f"checks at the edge (`fleetlab/edge/`) add {package_lines('fleetlab/edge')}; "
                f"beside it, the output side (`fleetlab/output/`) {package_lines('fleetlab/output')} and inspection "
                f"(`fleetlab/inspect/`) {package_lines('fleetlab/inspect')}, the tiled backend "
                f"(`fleetlab/attention/tiled.py`) {code_lines(ROOT / 'fleetlab/attention/tiled.py')} and the "
                f"logits processors (`fleetlab/processors/`) {package_lines('fleetlab/processors')}.")
    return "\n".join(rows)


def readme_table() -> str:
    text = README.read_text(encoding="utf-8")
    if START not in text or END not in text:
        raise SystemExit(f"README.md has no {START} ... {END} block")
    return text.split(START, 1)[1].split(END, 1)[0].strip()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with README.md; exit 1 if it differs")
    parser.add_argument("--write", action="store_true", help="write the table into README.md")
    args = parser.parse_args(argv)
    now = table()
    if args.write:
        text = README.read_text(encoding="utf-8")
        head, rest = text.split(START, 1)
        README.write_text(f"{head}{START}\n{now}\n{END}{rest.split(END, 1)[1]}", encoding="utf-8")
    elif args.check:
        if readme_table() != now:
            print("README.md's reading guide is out of date: run python tools/read_the_engine.py --write",
                  file=sys.stderr)
            return 1
    else:
        print(now)
    return 0


if __name__ == "__main__":
    sys.exit(main())
