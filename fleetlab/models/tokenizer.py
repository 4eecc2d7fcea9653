"""A character-level tokenizer with a fixed, tiny vocabulary.

The shipped tiny Llama reads and writes one character per token, so a reader can
check every generated token by eye ("12+7=" -> "19"). The vocabulary is four special
tokens followed by one token per character:

    id 0 ``<pad>``, 1 ``<bos>``, 2 ``<eos>``, 3 ``<unk>``, then ``DEFAULT_CHARS`` in order.

Characters outside the vocabulary (upper case, digits of other scripts, tabs...)
encode to ``<unk>``; decoding never produces them back.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
DEFAULT_CHARS = "0123456789abcdefghijklmnopqrstuvwxyz +-*/=,.?:!'()\n"
TOKENIZER_FILE = "tokenizer.json"


class CharTokenizer:
    """Maps text to token ids one character at a time (see the module docstring).

    ``encode(text) -> list[int]`` (with ``<bos>`` first by default) and
    ``decode(ids) -> str``; ``save(dir)`` / ``CharTokenizer.load(dir)`` round-trip
    the vocabulary through ``dir/tokenizer.json``.
    """

    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    unk_token_id = 3

    def __init__(self, chars: str = DEFAULT_CHARS):
        if len(set(chars)) != len(chars):
            raise ValueError(f"CharTokenizer: chars must be distinct, got {chars!r}")
        self.chars = chars
        self._char_to_id = {c: i + len(SPECIAL_TOKENS) for i, c in enumerate(chars)}
        self._id_to_token = list(SPECIAL_TOKENS) + list(chars)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included."""
        return len(self._id_to_token)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def special_token_ids(self) -> tuple[int, ...]:
        """Ids of ``<pad>``, ``<bos>``, ``<eos>``, ``<unk>``."""
        return tuple(range(len(SPECIAL_TOKENS)))

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        """Token ids of ``text``: ``[<bos>] + one id per character (+ [<eos>])``.

        Characters outside the vocabulary become ``unk_token_id``.
        """
        if not isinstance(text, str):
            raise TypeError(f"CharTokenizer.encode: text must be str, got {type(text).__name__}")
        ids = [self._char_to_id.get(c, self.unk_token_id) for c in text]
        if add_bos:
            ids.insert(0, self.bos_token_id)
        if add_eos:
            ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (a list, a 1-D numpy array or a 1-D Paddle tensor).

        Special tokens are dropped when ``skip_special_tokens`` and written as their
        names (``"<eos>"``) otherwise.
        """
        if hasattr(ids, "tolist"):  # numpy arrays and Paddle tensors
            ids = ids.tolist()
        pieces = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"CharTokenizer.decode: id {i} is outside [0, {self.vocab_size})")
            if skip_special_tokens and i < len(SPECIAL_TOKENS):
                continue
            pieces.append(self._id_to_token[i])
        return "".join(pieces)

    def save(self, directory: str | os.PathLike) -> str:
        """Write ``directory/tokenizer.json`` and return its path."""
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, TOKENIZER_FILE)
        payload = {"type": "char", "special_tokens": list(SPECIAL_TOKENS), "chars": self.chars}
        with open(path, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=2)
        return path

    @classmethod
    def load(cls, directory: str | os.PathLike) -> CharTokenizer:
        """Read a tokenizer written by :meth:`save` from ``directory``."""
        path = os.path.join(directory, TOKENIZER_FILE)
        with open(path, encoding="utf-8") as f:
            payload = json.load(f)
        if payload.get("type") != "char" or tuple(payload.get("special_tokens", ())) != SPECIAL_TOKENS:
            raise ValueError(f"CharTokenizer.load: {path} is not a fleetlab character tokenizer")
        return cls(payload["chars"])

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"
