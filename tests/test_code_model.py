"""The shipped code model and its draft, real checkpoints through from_pretrained, and train-code."""

from __future__ import annotations

import json
import shutil

import numpy as np
import paddle
import pytest

from fleetlab import LLM, SamplingParams
from fleetlab.models import bpe, code_recipe, load, load_code, tiny
from fleetlab.models.small import TINY_FAMILIES
from fleetlab.patching.parity import reference_greedy

PROMPT = "def dedent(text):\n    \"\"\"Remove any common leading whitespace from every line in `text`.\"\"\"\n"


@pytest.fixture(scope="module")
def code():
    return load_code()


def _logits(model, ids):
    with paddle.no_grad():
        return model(input_ids=paddle.to_tensor([ids]), use_cache=False, return_dict=True).logits.numpy()


def test_code_model_is_a_small_llama_with_a_bpe_tokenizer(code):
    model, tok = code
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert model.config.vocab_size == len(tok) == bpe.VOCAB_SIZE
    assert (code_recipe.CODE_DIR / "model.safetensors").stat().st_size <= 16_000_000
    assert {k: model.config.get(k) if hasattr(model.config, "get") else getattr(model.config, k)
            for k in code_recipe.TARGET} == code_recipe.TARGET  # fmt: skip


def test_draft_is_smaller_and_shares_the_tokenizer(code):
    draft, tok = load_code(draft=True)
    assert draft.config.num_hidden_layers == 2 and draft.config.vocab_size == code[0].config.vocab_size
    shipped = (code_recipe.CODE_DIR / "tokenizer.json").read_bytes()
    assert (code_recipe.DRAFT_DIR / "tokenizer.json").read_bytes() == shipped
    draft_bytes = (code_recipe.DRAFT_DIR / "model.safetensors").stat().st_size
    assert draft_bytes < (code_recipe.CODE_DIR / "model.safetensors").stat().st_size / 3


def _unigram_baselines(ids: np.ndarray) -> tuple[float, float]:
    """``(share of the most frequent token, unigram entropy in nats)`` of ``ids``: the accuracy and
    loss of a model that learnt token frequencies and nothing else (knowing them from this very text)."""
    counts = np.bincount(ids)
    p = counts[counts > 0] / counts.sum()
    return float(counts.max() / counts.sum()), float(-(p * np.log(p)).sum())


@pytest.mark.parametrize("directory", [code_recipe.CODE_DIR, code_recipe.DRAFT_DIR], ids=["model", "draft"])
def test_recorded_held_out_figures_beat_token_frequencies(directory):
    from tokenizers import Tokenizer

    record = json.loads((directory / "training.json").read_text(encoding="utf-8"))["evaluation"]["held_out"]
    stream = code_recipe.token_stream(Tokenizer.from_file(str(directory / "tokenizer.json")), "held_out")
    top_share, entropy = _unigram_baselines(stream.astype(np.int64))
    assert record["tokens"] > 50_000 and record["loss"] < entropy - 0.5 and record["accuracy"] > 3 * top_share


def test_held_out_accuracy_reproduces_here(code):
    from fleetlab.models.code_checkpoint import evaluate
    from fleetlab.models.code_corpus import documents

    model, tok = code
    ids = np.asarray(tok.encode(documents("held_out", ["textwrap.py"])[0]), dtype=np.int64)
    result = evaluate(model, ids, seq_len=256, max_windows=4)
    top_share, entropy = _unigram_baselines(ids)
    assert result.accuracy > 3 * top_share and result.loss < entropy - 0.5


def test_shipped_directory_is_a_paddleformers_checkpoint(code, tmp_path):
    shutil.copytree(code_recipe.CODE_DIR, tmp_path / "code", ignore=shutil.ignore_patterns("draft"))
    model, tok = load(tmp_path / "code")  # AutoModelForCausalLM / AutoTokenizer.from_pretrained
    ids = tok.encode(PROMPT)
    assert ids == code[1].encode(PROMPT)
    np.testing.assert_array_equal(_logits(model, ids), _logits(code[0], ids))


def test_engine_greedy_equals_the_models_own_forward(code):
    model, tok = code
    prompts = [tok.encode(PROMPT), tok.encode("import os\n\n\ndef main():\n    ")]
    want, _ = reference_greedy(model, prompts, 12)
    llm = LLM(model, tok, block_size=16)
    try:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=12, ignore_eos=True),
                            use_tqdm=False)  # fmt: skip
    finally:
        llm.handle.unpatch()
    assert [o.token_ids for o in outs] == want
    assert all(o.text == tok.decode(o.token_ids) for o in outs)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_a_saved_checkpoint_of_each_family_with_a_bpe_tokenizer_loads_and_serves(family, tmp_path):
    model = tiny(family, vocab_size=bpe.VOCAB_SIZE)
    model.save_pretrained(str(tmp_path))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(code_recipe.CODE_DIR / name, tmp_path / name)
    loaded, tok = load(tmp_path)
    assert type(loaded) is type(model) and len(tok) == bpe.VOCAB_SIZE
    prompt = tok.encode("for i in range(10):\n")
    want, _ = reference_greedy(model, [prompt], 5)
    llm = LLM(loaded, tok, block_size=4)
    try:
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=5, ignore_eos=True),
                           use_tqdm=False)[0]  # fmt: skip
    finally:
        llm.handle.unpatch()
    assert out.token_ids == want[0]


def test_load_refuses_a_directory_that_is_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint directory"):
        load(tmp_path)
    with pytest.raises(FileNotFoundError, match="checkpoint directory"):
        load(str(tmp_path / "absent"))


def test_odd_input_is_refused_naming_the_request_and_field(code):
    model, tok = code
    llm = LLM(model, tok, block_size=16)
    try:
        sp = SamplingParams(max_tokens=2)
        with pytest.raises(ValueError, match=r"request '\w+': prompt_token_ids \[4103\] outside the vocabulary"):
            llm.generate(prompt_token_ids=[[1, bpe.VOCAB_SIZE + 7]], sampling_params=sp, use_tqdm=False)
        with pytest.raises(ValueError, match=r"request '\w+': prompt is empty"):
            llm.generate(prompt_token_ids=[[]], sampling_params=sp, use_tqdm=False)
        with pytest.raises(ValueError, match=r"request '\w+': prompt is not valid UTF-8 text: a lone surrogate"):
            llm.generate(prompts=["x = '\udcff'"], sampling_params=sp, use_tqdm=False)
        # Empty text is not an empty prompt: the tokenizer puts <bos> first, and the model starts from it.
        assert llm.generate(prompts=[""], sampling_params=sp, use_tqdm=False)[0].prompt_token_ids == [bpe.BOS_ID]
    finally:
        llm.handle.unpatch()


# --- train-code ----------------------------------------------------------------------------


def _train(tmp_path, name):
    from fleetlab.models.train_code import main

    out = tmp_path / name
    args = ["--steps", "2", "--max-files", "12", "--seq-len", "32", "--batch-size", "2", "--eval-windows", "2",
            "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    return json.loads((out / "training.json").read_text(encoding="utf-8")), out


def test_train_code_runs_and_a_rerun_gives_the_same_loss(tmp_path):
    first, out = _train(tmp_path, "a")
    second, _ = _train(tmp_path, "b")
    assert first["final_loss"] == second["final_loss"] and first["held_out"] == second["held_out"]
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    model, tok = load(out)  # what it wrote is a PaddleFormers checkpoint
    assert model.config.num_hidden_layers == code_recipe.TARGET["num_hidden_layers"] and len(tok) == bpe.VOCAB_SIZE


def test_serve_loads_the_code_model_its_draft_and_renders_chat_without_a_template(code):
    from fleetlab.serving.chat_template import chat_prompt_ids, has_chat_template
    from fleetlab.serving.loader import load_draft, load_model

    model, tok = load_model("code")
    assert type(model).__name__ == "LlamaForCausalLM" and len(tok) == bpe.VOCAB_SIZE
    assert load_draft("code").config.num_hidden_layers == 2
    assert not has_chat_template(tok)  # no chat training: the minimal template, messages' text on lines
    messages = [{"role": "user", "content": "import os"}, {"role": "user", "content": "def f():"}]
    assert chat_prompt_ids(tok, messages) == tok.encode("import os\ndef f():")


@pytest.mark.slow
def test_import_gpu_makes_a_checkpoint_and_refuses_logits_that_differ(tmp_path):
    """The GPU recipe's output, stood in for by a random draft's weights in PyTorch's layout (HF names,
    [out, in]) and its own logits: imported, loaded by from_pretrained, checked; wrong logits refused."""
    from fleetlab.models.code_checkpoint import paddle_state_to_hf
    from fleetlab.models.code_import import import_gpu
    from fleetlab.models.train_code import CodeTrainConfig, build_model

    model = build_model(CodeTrainConfig(draft=True, seed=3))
    model.eval()
    src = tmp_path / "gpu"
    src.mkdir()
    np.savez(src / "draft_weights.npz", **paddle_state_to_hf(model))
    ids = np.arange(3, 3 + 2 * 16, dtype=np.int64).reshape(2, 16)
    with paddle.no_grad():
        logits = model(input_ids=paddle.to_tensor(ids), return_dict=True).logits.numpy()
    np.savez(src / "draft_reference.npz", input_ids=ids, logits=logits)
    log = {"dims": code_recipe.DRAFT, "device": "stand-in", "torch": "none", "parameters": 1, "train_tokens": 1,
           "steps": 1, "best_step": 1, "wall_s": 0.0, "settings": {}, "held_out_float32": {}, "log": []}  # fmt: skip
    (src / "draft_log.json").write_text(json.dumps(log))
    record = import_gpu(str(src), str(tmp_path / "out"), draft=True)
    assert record["export_parity"]["argmax_agreement"] == 1.0 and record["export_parity"]["max_abs_logit_diff"] < 1e-4
    assert load(tmp_path / "out")[0].config.num_hidden_layers == code_recipe.DRAFT["num_hidden_layers"]
    np.savez(src / "draft_reference.npz", input_ids=ids, logits=logits + 0.01)
    with pytest.raises(RuntimeError, match="differ from PyTorch's"):
        import_gpu(str(src), str(tmp_path / "again"), draft=True)
