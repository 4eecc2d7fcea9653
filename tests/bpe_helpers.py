"""A small byte-level BPE tokenizer, trained here in milliseconds, and a tiny random Llama over its
vocabulary: real text machinery (characters split over tokens, multi-character tokens) for tests.

The training text mixes code, JSON and multi-byte UTF-8 (accents, CJK, an emoji), so that the
merges make tokens that hold part of a character (``"日"`` is three bytes) and tokens that hold
several characters with a leading space.
"""

from __future__ import annotations

import functools

LINES = [
    "héllo wörld 日本語 🙂 naïve café — “quotes” ∑ ok",
    "def foo(x):\n    return x + 1\n\n\nclass Bar:\n    pass\n",
    '{"name": "alice", "age": 31, "tags": ["a", "b"], "ok": true}',
    "for i in range(10):\n    print(i, '日本')\n",
    "über straße ñandú — 東京 大阪 🙂🙃 ελληνικά русский",
]


@functools.cache
def bpe_tokenizer(vocab_size: int = 400):
    """A PaddleFormers fast tokenizer (``PreTrainedTokenizerFast``) over a byte-level BPE:
    ids 0 ``<pad>``, 1 ``<bos>``, 2 ``<eos>``, then the 256 byte tokens and the merges."""
    from paddleformers.transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(LINES * 40, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


def bpe_llama(seed: int = 0, **overrides):
    """``(model, tokenizer)``: a tiny random PaddleFormers Llama whose vocabulary is the BPE's."""
    from fleetlab.models import tiny

    tok = bpe_tokenizer()
    return tiny("llama", seed=seed, vocab_size=len(tok), **overrides), tok


def encode(tok, text: str) -> list[int]:
    """``text``'s ids, no special tokens."""
    ids = tok.encode(text, add_special_tokens=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def partial_tokens(tok) -> list[int]:
    """Ids of the tokens that hold part of a character (decoded alone: a U+FFFD)."""
    return [i for i in range(len(tok)) if "\ufffd" in tok.decode([i])]


def expected_text(tok, ids, stops=(), include=False, min_tokens=0):
    """``(tokens kept, text, stop string or None)`` for output ``ids`` with stop strings, from
    full decodes of its prefixes: after ``k`` tokens a stream has shown the decode of the longest
    prefix of at most ``k`` tokens that does not end in half a character (U+FFFD); when the
    sequence ends, the full decode. The first ``k >= min_tokens`` whose text holds a stop string
    (one that ends in text added by token ``min_tokens`` or later) ends it, cut at the earliest."""
    def decode(part):
        return tok.decode(list(part), skip_special_tokens=True)

    avail = [""]
    for k in range(1, len(ids) + 1):
        text = decode(ids[:k])
        avail.append(avail[-1] if text.endswith("\ufffd") else text)
    stages = [(k, avail[k]) for k in range(1, len(ids) + 1)] + [(len(ids), decode(ids))]
    floor = len(avail[min(min_tokens - 1, len(ids))]) if min_tokens > 0 else 0  # text not searched
    for k, text in stages:
        if k < min_tokens:
            continue
        hits = [(at, i, s) for i, s in enumerate(stops) if (at := text.find(s, max(0, floor - len(s) + 1))) >= 0]
        if hits:
            at, _, s = min(hits)
            return k, text[: at + len(s) if include else at], s
    return len(ids), decode(ids), None


def stops_inside_tokens(tok, ref):
    """Stop strings cut from ``ref``'s text that end inside one of its tokens (not at a token's end)."""
    ends, pos = set(), 0
    for k in range(1, len(ref) + 1):
        text = tok.decode(ref[:k], skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            ends.add(len(text))
            pos = len(text)
    text = tok.decode(ref, skip_special_tokens=True)
    return [text[a:b] for a in range(len(text)) for b in (a + 1, a + 2)
            if b <= pos and b not in ends and "\ufffd" not in text[a:b]][:3]
