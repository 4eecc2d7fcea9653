"""The shipped tiny Llama, its tokenizer, corpus, training script and loaders."""

from __future__ import annotations

import shutil

import numpy as np
import paddle
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetlab.models.corpus import generate_lines, held_out_pairs, is_held_out
from fleetlab.models.pretrained import (
    WEIGHTS_DIR,
    addition_accuracy,
    complete,
    load_pretrained,
    load_tiny,
    save_tiny,
)
from fleetlab.models.tokenizer import DEFAULT_CHARS, CharTokenizer
from fleetlab.models.train import TINY_OVERRIDES, TrainConfig, build_model, main, pack_batches

# Held-out two-digit additions (see fleetlab.models.corpus), measured on the shipped
# checkpoint (seed 0, 800 steps): 99.6% of all 1,393 held-out pairs (1,387 right) and
# 99.1% of the 108-pair sample below (107 right); seed 1 gave 99.9% on all of them.
# The bar is the 90%.
HELD_OUT_BAR = 0.9


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


def _logits(model, ids):
    with paddle.no_grad():
        return model(input_ids=paddle.to_tensor([ids]), use_cache=False, return_dict=True).logits.numpy()


# --- tokenizer ---------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(st.text(alphabet=DEFAULT_CHARS, max_size=40))
def test_tokenizer_round_trip(text):
    tok = CharTokenizer()
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1
    assert tok.decode(ids) == text


def test_tokenizer_specials_unknowns_and_save(tmp_path):
    tok = CharTokenizer()
    assert {tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id} == {0, 1, 2, 3}
    assert tok.vocab_size == 4 + len(DEFAULT_CHARS)
    assert tok.encode("A+1", add_bos=False, add_eos=True) == [tok.unk_token_id, *tok.encode("+1", False), 2]
    assert tok.decode([1, *tok.encode("7", False), 2], skip_special_tokens=False) == "<bos>7<eos>"
    with pytest.raises(ValueError):
        tok.decode([tok.vocab_size])
    tok.save(tmp_path)
    again = CharTokenizer.load(tmp_path)
    assert again.vocab_size == tok.vocab_size and again.encode("9-4=5") == tok.encode("9-4=5")


# --- corpus ------------------------------------------------------------------------------


def test_corpus_is_deterministic_and_never_holds_held_out_pairs():
    lines = generate_lines(seed=3, n=4000)
    assert lines == generate_lines(seed=3, n=4000)
    assert lines != generate_lines(seed=4, n=4000)
    held = set(held_out_pairs())
    assert len(held) == 1393 and all(is_held_out(a, b) and is_held_out(b, a) for a, b in held)
    seen = set()
    for line in lines:
        if "+" in line:
            left, total = line.split("=")
            a, b = map(int, left.split("+"))
            assert a + b == int(total)
            seen.add((a, b))
    two_digit = {p for p in seen if 10 <= min(p) and max(p) <= 99}
    assert len(two_digit) > 1000 and not two_digit & held


def test_packing_matches_separate_forwards():
    paddle.seed(0)
    tok = CharTokenizer()
    cfg = TrainConfig(**{**TINY_OVERRIDES, "hidden_size": 32, "num_attention_heads": 2})
    model = build_model(cfg, tok)
    model.eval()
    batch = next(pack_batches(iter(generate_lines(0, 50)), tok, batch_size=2, seq_len=40))
    with paddle.no_grad():
        packed = model(
            input_ids=paddle.to_tensor(batch.input_ids),
            position_ids=paddle.to_tensor(batch.position_ids),
            attn_mask_startend_row_indices=paddle.to_tensor(batch.row_ends.astype(np.int32)[:, None, :, None]),
            return_dict=True,
        ).logits.numpy()
    checked = 0
    for row in range(2):
        start = 0
        while start < 40 and batch.input_ids[row, start] == tok.bos_token_id:
            end = batch.row_ends[row, start]
            alone = _logits(model, batch.input_ids[row, start:end].tolist())[0]
            np.testing.assert_allclose(packed[row, start:end], alone, atol=1e-4)
            assert batch.labels[row, end - 1] == -100 and batch.position_ids[row, start] == 0
            start, checked = end, checked + 1
    assert checked >= 3


def test_answer_loss_only_scores_answers_and_keeps_sentences():
    tok = CharTokenizer()
    batch = next(pack_batches(iter(["12+7=19", "a cow is red."] * 4), tok, 1, 24, answer_loss_only=True))
    scored = [tok.decode([t]) for t in batch.labels[0] if t >= 0]
    # "12+7=19": only "19" and <eos> ("" once decoded); the sentence: every next character.
    assert "".join(scored[:3]) == "19" and scored[3:] == list("a cow is red.") + [""]


# --- the shipped model -------------------------------------------------------------------


def test_load_tiny_is_small_and_in_eval_mode(tiny):
    model, tok = tiny
    assert not model.training
    assert model.config.vocab_size == tok.vocab_size and model.config.eos_token_id == tok.eos_token_id
    assert (WEIGHTS_DIR / "model.safetensors").stat().st_size <= 10 * 2**20
    assert sum(int(np.prod(p.shape)) for p in model.parameters()) < 3_000_000


def test_tiny_adds_held_out_pairs(tiny):
    model, tok = tiny
    sample = held_out_pairs()[::13]  # a fixed, spread-out sample of 108 held-out pairs
    assert len(sample) >= 100
    assert addition_accuracy(model, tok, sample) >= HELD_OUT_BAR


def test_tiny_prints_checkable_text(tiny):
    model, tok = tiny
    # The example, and a held-out pair chosen before training.
    assert is_held_out(11, 24) and not is_held_out(12, 7)
    assert complete(model, tok, ["12+7=", "11+24="]) == ["19", "35"]


# --- loaders and the training script ------------------------------------------------------


def test_load_pretrained_round_trip_gives_identical_logits(tmp_path):
    paddle.seed(1)
    tok = CharTokenizer()
    model = build_model(TrainConfig(**TINY_OVERRIDES), tok)
    model.eval()
    model.save_pretrained(str(tmp_path / "pf"))  # PaddleFormers' own writer
    save_tiny(model, tok, tmp_path / "ours")  # fleetlab's writer (the shipped format)
    ids = tok.encode("345+28=")
    want = _logits(model, ids)
    for loaded in (
        load_pretrained(tmp_path / "pf"),
        load_pretrained(tmp_path / "ours"),
        load_tiny(tmp_path / "ours")[0],
    ):
        assert not loaded.training
        np.testing.assert_array_equal(_logits(loaded, ids), want)


def test_shipped_checkpoint_is_a_paddleformers_checkpoint(tiny, tmp_path):
    shutil.copytree(WEIGHTS_DIR, tmp_path / "w")
    ids = tiny[1].encode("21+21=")
    np.testing.assert_array_equal(_logits(load_pretrained(tmp_path / "w"), ids), _logits(tiny[0], ids))


def test_train_script_runs_and_writes_a_loadable_checkpoint(tmp_path):
    assert main(["--tiny", "--steps", "2", "--out", str(tmp_path)]) == 0
    for name in ("model.safetensors", "config.json", "tokenizer.json", "training.json"):
        assert (tmp_path / name).is_file()
    model, tok = load_tiny(tmp_path)
    assert model.config.num_hidden_layers == TINY_OVERRIDES["num_hidden_layers"]
    assert _logits(model, tok.encode("1+1=")).shape == (1, 5, tok.vocab_size)


def test_training_is_deterministic(tmp_path):
    for name in ("a", "b"):
        assert main(["--tiny", "--steps", "3", "--seed", "5", "--out", str(tmp_path / name)]) == 0
    first = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert first == (tmp_path / "b" / "model.safetensors").read_bytes()
    main(["--tiny", "--steps", "3", "--seed", "6", "--out", str(tmp_path / "c")])
    assert first != (tmp_path / "c" / "model.safetensors").read_bytes()


# --- the shipped draft (speculative decoding) ---------------------------------------------


def test_the_shipped_draft_is_small_shares_the_tokenizer_and_adds(tiny):
    from fleetlab.models import load_tiny_draft
    from fleetlab.models.pretrained import DRAFT_WEIGHTS_DIR
    from fleetlab.models.train import DRAFT_OVERRIDES, parse_args

    draft, tok = load_tiny_draft()
    assert draft.config.num_hidden_layers == 2 and not draft.training
    assert tok.vocab_size == tiny[1].vocab_size == draft.config.vocab_size
    assert (DRAFT_WEIGHTS_DIR / "model.safetensors").stat().st_size <= 2 * 2**20
    # Measured on the shipped draft: 98.0% of all 1,393 held-out pairs (seed 0, 800 steps).
    assert addition_accuracy(draft, tok, held_out_pairs()[::13]) >= HELD_OUT_BAR
    cfg = parse_args(["--draft"])  # the command that made it: `python -m fleetlab train-tiny --draft`
    assert cfg.out_dir == str(DRAFT_WEIGHTS_DIR) and cfg.num_hidden_layers == DRAFT_OVERRIDES["num_hidden_layers"]
