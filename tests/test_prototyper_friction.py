"""What a prototyper meets first, made plain (#45 item 13): the extension classes exported, a
prefix cache that lacks a method named with it, every phase an observer hears listed in
``PHASES``, ``AttentionMetadata.extend`` documented, refusals that show the whole option,
``disagg --help``, and ``print()`` of a batch, a pool and an engine."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import random_prompts

import fleetlab
from fleetlab import LLM, SamplingParams
from fleetlab.engine.hooks import OVERLAP_PHASES, PHASES, STEP_PHASES
from fleetlab.engine.input_batch import InputBatch
from fleetlab.kv.block_pool import BlockPool
from fleetlab.prefix_cache import PrefixCache

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_the_extension_classes_are_exported_where_a_prototyper_looks():
    from fleetlab.attention import TiledMetadata as from_attention
    from fleetlab.attention.tiled import TiledMetadata
    from fleetlab.inspect import check_kv_manager, check_pool, pool_snapshot
    from fleetlab.inspect.pool import check_pool as home
    from fleetlab.kv_transfer import BlockStoreConnector, LoadError
    from fleetlab.kv_transfer.block_store import BlockStoreConnector as store_home

    assert fleetlab.BlockStoreConnector is BlockStoreConnector is store_home
    assert fleetlab.LoadError is LoadError and issubclass(LoadError, RuntimeError)
    assert fleetlab.TiledMetadata is TiledMetadata is from_attention
    assert check_pool is home and callable(check_kv_manager) and callable(pool_snapshot)
    assert {"BlockStoreConnector", "LoadError", "TiledMetadata"} <= set(dir(fleetlab))


def test_the_kv_connector_api_still_loads_no_paddle():
    code = "import sys, fleetlab.kv_transfer; print(sorted(m for m in sys.modules if m.split('.')[0] == 'paddle'))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


class Bare(PrefixCache):
    name = "bare"


@pytest.mark.parametrize("call", ["lookup", "cache_blocks", "uncache", "is_cached", "num_cached_blocks"])
def test_a_prefix_cache_lacking_a_method_is_named_with_it(call):
    cache = Bare(4)
    calls = {"lookup": lambda: cache.lookup([1, 2, 3]), "cache_blocks": lambda: cache.cache_blocks([1] * 4, [0], 0, 1),
             "uncache": lambda: cache.uncache([0]), "is_cached": lambda: cache.is_cached(0),
             "num_cached_blocks": lambda: cache.num_cached_blocks}
    with pytest.raises(NotImplementedError, match=rf"prefix cache 'Bare' does not implement {call}\(\)"):
        calls[call]()


def test_the_prefix_cache_interface_is_documented_whole():
    for name in ("lookup", "cache_blocks", "uncache", "is_cached", "lookup_partial"):
        assert getattr(PrefixCache, name).__doc__, name
    assert PrefixCache.num_cached_blocks.__doc__
    row = next(line for line in README.splitlines() if line.startswith("| which blocks share a prefix"))
    for name in ("lookup", "cache_blocks", "uncache", "is_cached", "num_cached_blocks"):
        assert f"`{name}`" in row, name


def _phase_names_in_the_source() -> set[str]:
    """Every literal name passed to ``...phase("name")`` anywhere in the package."""
    names = set()
    for path in (ROOT / "fleetlab").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if called == "phase":
                    names.add(node.args[0].value)
    return names


class Phases:
    def __init__(self):
        self.heard = set()

    def on_phase(self, name, seconds):
        self.heard.add(name)


def test_every_phase_an_observer_hears_is_in_PHASES(fleet_model):
    assert _phase_names_in_the_source() == set(PHASES) == set(STEP_PHASES) | set(OVERLAP_PHASES)
    heard = {}
    for overlap in (False, True):
        llm = LLM(fleet_model, block_size=4, max_num_batched_tokens=16, async_scheduling=overlap)
        listener = Phases()
        llm.hooks.attach(listener)
        llm.generate(prompt_token_ids=random_prompts([5, 9], seed=2),
                     sampling_params=SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        heard[overlap] = listener.heard
        llm.close()
    assert heard[False] <= set(STEP_PHASES) and {"fill", "freeze", "wait"} <= heard[True] <= set(PHASES)


def test_extend_is_how_a_backend_adds_fields_and_it_is_documented():
    from fleetlab.attention.metadata import AttentionMetadata

    @dataclass(slots=True)
    class PlannedMetadata(AttentionMetadata):
        plan: tuple = ()

    md = AttentionMetadata.build([2, 1], [0, 3], [[0, -1], [1, 2]], 4)
    planned = md.extend(PlannedMetadata, plan=("split", 1))
    assert isinstance(planned, PlannedMetadata) and planned.plan == ("split", 1)
    assert planned.num_decodes == md.num_decodes and planned.max_seq_len == md.max_seq_len == 4
    assert "build_metadata" in AttentionMetadata.extend.__doc__ and ">>>" in AttentionMetadata.extend.__doc__
    row = next(line for line in README.splitlines() if line.startswith("| attention |"))
    assert "metadata.extend(" in row and "fleetlab.TiledMetadata" in row


@pytest.mark.parametrize("option, value, shown", [
    ("speculative_config", {"method": "ngram", "num_speculative_tokens": 2},
     "speculative_config={'method': 'ngram', 'num_speculative_tokens': 2}: "),
    ("kv_transfer_config", {"connector": "shared_storage", "role": "both", "path": "/tmp/fleetlab-never/" + "d" * 80},
     "kv_transfer_config=KVTransferConfig(connector='shared_storage', "),
])
def test_a_refusal_shows_the_option_whole_or_cut_between_items(fleet_model, option, value, shown):
    with pytest.raises(ValueError) as info:
        LLM(fleet_model, async_scheduling=True, **{option: value})
    text = str(info.value)
    assert shown in text, text
    value_shown = text.split(f"{option}=", 1)[1].rsplit(": ", 1)[0]  # the reason follows the last ": "
    assert value_shown.count("(") == value_shown.count(")") and value_shown.count("{") == value_shown.count("}")
    assert value_shown.count("'") % 2 == 0, value_shown  # no string cut in half


def test_disagg_help_prints_its_options(capsys):
    from fleetlab.serving.disagg.cli import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m fleetlab disagg")
    for option in ("--host HOST", "--port PORT", "--model MODEL", "--max-num-seqs", "--shutdown-timeout"):
        assert option in out, option
    assert "[--kv-role" not in out and "  --kv-role" not in out  # disagg sets it on each rank


def test_print_shows_the_batch_the_pool_and_the_engine_not_addresses(fleet_model):
    batch = InputBatch(max_num_seqs=4, max_model_len=16, max_blocks_per_seq=4)
    for i, prompt in enumerate([[5, 6, 7], [8, 9], [1, 2, 3, 4, 5]]):
        batch.add_request(f"r{i}", prompt, block_ids=[i, 3] if i == 2 else [i])
    batch.remove_request("r1")
    text = repr(batch)
    assert text.splitlines() == [
        f"InputBatch(2 requests in rows [0, 3) of 4, holes at rows [1]; {len(batch.fields)} fields)",
        "  row 0: 'r0' prompt 3, tokens 3, computed 0, scheduled 0, blocks [0]",
        "  row 1: (hole)",
        "  row 2: 'r2' prompt 5, tokens 5, computed 0, scheduled 0, blocks [2, 3]"]
    pool = BlockPool(8, 4)
    pool.allocate(3)
    assert repr(pool) == "BlockPool(8 blocks of 4 tokens: 3 in use, 5 free, no prefix cache)"
    with LLM(fleet_model, block_size=4, num_blocks=16, max_num_seqs=3) as llm:
        llm.add_request(prompt_token_ids=[5, 6, 7, 8, 9], sampling_params=SamplingParams(max_tokens=2))
        text = repr(llm)
        assert re.fullmatch(r"LLM\(\w+, backend \w+, BlockPool\(16 blocks of 4 tokens: 0 in use, 16 free, 0 holding "
                            r"a cached prefix \(HashChainCache\)\), max_num_seqs=3, max_num_batched_tokens=\d+, "
                            r"max_model_len=\d+, async_scheduling=False; 0 running, 1 waiting\)", text), text
        assert " at 0x" not in text + repr(llm.pool) + repr(llm.runner.batch)
