"""The byte-level BPE tokenizer of the shipped code model.

Trained with Hugging Face ``tokenizers`` (the library behind PaddleFormers' fast tokenizers) on
the training split of :mod:`fleetlab.models.code_corpus`: GPT-2's byte-level scheme (every byte
is a base token, so any text encodes, and merges are learnt over bytes, so one UTF-8 character
may span several tokens and one token may hold parts of two characters) with
:data:`VOCAB_SIZE` tokens. Ids 0, 1, 2 are ``<pad>``, ``<bos>``, ``<eos>``; encoding with
special tokens puts ``<bos>`` first (Llama's convention), as the model was trained.

:func:`save_tokenizer` writes ``tokenizer.json`` plus the ``tokenizer_config.json`` and
``special_tokens_map.json`` with which PaddleFormers' ``AutoTokenizer.from_pretrained(dir)``
builds a ``PreTrainedTokenizerFast`` over it. ``clean_up_tokenization_spaces`` is off: it
would delete the space in ``x .y`` and ``f( 'a' )`` when decoding, and code keeps them.
The model has no chat training, so no chat template is saved: the server's chat route then
uses its minimal template (messages' text on lines of their own; see
:mod:`fleetlab.serving.chat_template`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

VOCAB_SIZE = 4096
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
MODEL_MAX_LENGTH = 1024


def train_bpe(texts: Iterable[str], vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE ``tokenizers.Tokenizer`` with ``vocab_size`` tokens learnt from ``texts``.

    Deterministic for the same texts in the same order (the trainer runs in the library's
    Rust code; ties between equally frequent pairs are broken by the pair itself).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    for token, expected in zip(SPECIAL_TOKENS, (PAD_ID, BOS_ID, EOS_ID)):
        assert tokenizer.token_to_id(token) == expected  # the trainer adds special tokens first
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", BOS_ID)]
    )
    return tokenizer


def tokenizer_config() -> dict:
    """``tokenizer_config.json`` for PaddleFormers' / Hugging Face's ``AutoTokenizer``."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": False,
        "padding_side": "left",
    }


def save_tokenizer(tokenizer, directory: str | os.PathLike) -> list[Path]:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``
    into ``directory``; return their paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = tokenizer_config()
    special = {k: config[k] for k in ("bos_token", "eos_token", "pad_token")}
    paths = [out / "tokenizer.json", out / "tokenizer_config.json", out / "special_tokens_map.json"]
    for path, payload in zip(paths[1:], (config, special)):
        path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    return paths


def load_fast_tokenizer(directory: str | os.PathLike):
    """PaddleFormers' ``AutoTokenizer`` over the tokenizer saved in ``directory``."""
    from paddleformers.transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))
