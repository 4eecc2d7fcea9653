"""The code model's corpus and byte-level BPE tokenizer (fleetlab/models/code/)."""

from __future__ import annotations

import json
import platform

import pytest

from fleetlab.models import bpe, code_corpus, code_recipe
from fleetlab.models.checkpoints import load_code_tokenizer

SHIPPED_MANIFEST = json.loads((code_recipe.CODE_DIR / "corpus.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def tok():
    return load_code_tokenizer()


def test_paddleformers_loads_the_shipped_tokenizer_with_its_special_tokens(tok):
    assert len(tok) == bpe.VOCAB_SIZE
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert [tok.convert_ids_to_tokens(i) for i in range(3)] == ["<pad>", "<bos>", "<eos>"]
    assert tok.encode("x = 1")[0] == bpe.BOS_ID
    assert tok.encode("x = 1", add_special_tokens=False)[0] != bpe.BOS_ID


@pytest.mark.parametrize("text", [
    "def f(x):\n    return x .y + f( 'a' )\n",  # spaces that clean-up would eat
    "\t\tif a  ==  b :  pass\r\n",
    "naïve café — 日本語 😀 \u200b",
    "",
])  # fmt: skip
def test_any_text_round_trips(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_tokens_are_merges_not_characters(tok):
    text = "    def __init__(self, name):\n        self.name = name\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) < len(text) / 2.5
    # A multi-byte character is split over byte tokens: decoding one of them alone is not the character.
    emoji = tok.encode("😀", add_special_tokens=False)
    assert len(emoji) > 1 and tok.decode(emoji[:1]) != "😀"


def test_manifest_describes_the_held_out_split():
    held = [e for e in SHIPPED_MANIFEST["files"] if e["split"] == "held_out"]
    assert sorted(e["path"] for e in held) == sorted(code_corpus.HELD_OUT)
    assert SHIPPED_MANIFEST["held_out_missing"] == []
    assert SHIPPED_MANIFEST["train_files"] > 1000 and SHIPPED_MANIFEST["train_bytes"] > 10_000_000


def test_held_out_modules_are_never_in_the_training_split():
    train = {f.path for f in code_corpus.iter_files("train")}
    assert train.isdisjoint(code_corpus.HELD_OUT)
    with pytest.raises(ValueError, match="split"):
        next(code_corpus.iter_files("everything"))


@pytest.mark.skipif(platform.python_version() != SHIPPED_MANIFEST["python"],
                    reason="another Python reads another standard library")  # fmt: skip
def test_this_python_reads_the_shipped_corpus_and_retrains_the_same_tokenizer(tmp_path):
    assert code_corpus.compare_manifest(SHIPPED_MANIFEST, code_corpus.manifest())["same"] == len(
        SHIPPED_MANIFEST["files"])
    bpe.save_tokenizer(bpe.train_bpe(code_corpus.documents("train")), tmp_path)
    shipped = (code_recipe.CODE_DIR / "tokenizer.json").read_text(encoding="utf-8")
    assert (tmp_path / "tokenizer.json").read_text(encoding="utf-8") == shipped
