"""The llguidance backend (registered as ``"guidance"``, vLLM's name for it).

llguidance (Microsoft's guidance project; Rust, Python bindings, CPU wheels, no dependency
beyond itself) compiles JSON schemas, regular expressions, choices and Lark grammars lazily
(an Earley parser over a derivative-based lexer), so compiling is cheap and a token mask costs
tens of microseconds. It takes any tokenizer given as the bytes of each token.

Two tokenizer adapters:

- **fleetlab's** ``CharTokenizer`` (one character per token): the vocabulary is given to
  llguidance token by token. Such a vocabulary cannot spell every character (the shipped tiny
  model's has no ``{``), and llguidance assumes any forced text can be tokenized, so the
  adapter adds one *stand-in token* past the model's vocabulary for every byte no token spells.
  The grammar then sees a vocabulary that can spell anything; the model can never produce a
  stand-in (its logits have no column for it), so a mask whose only allowed bits are
  stand-ins is a dead end, and the stand-ins name the missing characters.
- **PaddleFormers / Hugging Face fast tokenizers** (``tokenizer.backend_tokenizer``): handed
  to llguidance's own loader, which reads the Rust tokenizer's JSON. These spell every byte
  (byte-level BPE, or byte fallback); one that does not is refused when the backend is built.
"""

from __future__ import annotations

import copy
import json
import logging
import time

import numpy as np

from fleetlab.engine.structured_outputs_params import StructuredOutputsParams
from fleetlab.structured_output.backend import CompiledGrammar, GrammarBackend, GrammarError, GrammarMatcher
from fleetlab.structured_output.vocab_check import NO_OUTPUT, check_vocabulary, missing_characters

logger = logging.getLogger(__name__)

UTF8_BYTES = [b for b in range(256) if b not in (0xC0, 0xC1) and b < 0xF5]
"""Byte values that can occur in UTF-8 text (0xFF, never one, is llguidance's special-token marker)."""

MAX_CHOICES = 2000
"""llguidance's ``max_items_in_row`` (its default): a choice of n strings puts n + 1 items in a row."""

_LOG_LEVEL = 0  # llguidance's own messages off: errors come back through is_error()/get_error()


def _llguidance():
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - a dependency of fleetlab
        raise ImportError("the 'guidance' grammar backend needs llguidance: pip install llguidance") from exc
    return llguidance


class _CharVocabulary:
    """A ``CharTokenizer`` as llguidance's ``TokenizerWrapper`` wants it, plus stand-ins.

    Ids ``[0, len(tokenizer))`` are the tokenizer's, ``[len(tokenizer), vocab_size)`` the
    model's padding rows (empty: never allowed), ``[vocab_size, ...)`` one stand-in per byte
    that no single-character token spells.
    """

    def __init__(self, tokenizer, vocab_size: int):
        n = len(tokenizer)
        if vocab_size < n:
            raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {n} tokens")
        self.special_token_ids = list(tokenizer.special_token_ids)
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        texts = [tokenizer.decode([i], skip_special_tokens=False) for i in range(n)]
        self.char_to_id = {t: i for i, t in enumerate(texts) if i not in self.special_token_ids}
        self.tokens = [t.encode("utf-8") for t in texts] + [b""] * (vocab_size - n)
        single = {t[0] for i, t in enumerate(self.tokens) if len(t) == 1 and i not in self.special_token_ids}
        self.stand_in = {b: vocab_size + k for k, b in enumerate(b for b in UTF8_BYTES if b not in single)}
        self.tokens += [bytes([b]) for b in self.stand_in]
        self.is_tokenizer_wrapper = True

    def __call__(self, text) -> list[int]:
        """Token ids of ``text`` (str or UTF-8 bytes): characters the vocabulary lacks as stand-ins."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="surrogateescape")
        out = []
        for ch in text:
            tid = self.char_to_id.get(ch)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self.stand_in[b] for b in ch.encode("utf-8", errors="surrogateescape"))
        return out


def _is_char_tokenizer(tokenizer) -> bool:
    return hasattr(tokenizer, "chars") and hasattr(tokenizer, "special_token_ids")


def _hf_tokenizer(llg, tokenizer, vocab_size: int):
    """llguidance's tokenizer from a fast tokenizer's Rust JSON (what ``llguidance.hf`` does)."""
    backend = copy.copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return llg.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=tokenizer.eos_token_id)


def token_bytes_reader(tokenizer, vocab_size: int):
    """``f(token_id) -> bytes``: a fast tokenizer's token as its own bytes (a piece of a character
    included), as llguidance reads them from the tokenizer's JSON (byte-level, byte fallback...)."""
    lltok = _hf_tokenizer(_llguidance(), tokenizer, vocab_size)
    return lambda token_id: lltok.decode_bytes([int(token_id)])


class GuidanceMatcher(GrammarMatcher):
    """A request's llguidance ``LLMatcher`` behind fleetlab's matcher interface."""

    def __init__(self, matcher, vocab_size: int, eos_token_id: int, limit: int | None = None):
        self._m = matcher
        self._limit = vocab_size if limit is None else limit  # ids accepted: the model's (+ stand-ins)
        self._eos = eos_token_id
        self._num_tokens = 0
        self._eos_unrecorded = 0  # an EOS taken after the grammar stopped: llguidance does not record it

    def _real(self, token_ids) -> list[int]:
        """``token_ids`` up to the first id the model cannot produce (a stand-in, or out of range)."""
        ids = [int(t) for t in token_ids]
        for i, t in enumerate(ids):
            if not 0 <= t < self._limit:
                return ids[:i]
        return ids

    def accept_tokens(self, token_ids) -> bool:
        ids = self._real(token_ids)
        if len(ids) < len(token_ids) or self.validate_tokens(ids) < len(ids):
            return False
        for t in ids:
            if self._m.is_stopped() and t == self._eos:
                self._eos_unrecorded += 1
            elif not self._m.consume_token(t):  # validated, but a parser limit can still be hit here
                # a ValueError: the processor stops this request with it, the others go on
                raise ValueError(f"llguidance stopped at token {t}: {_one_line(self._m.get_error())}")
            self._num_tokens += 1
        return True

    def validate_tokens(self, token_ids) -> int:
        ids = self._real(token_ids)
        if not ids:
            return 0
        if self._m.is_stopped():  # only EOS may follow a complete match, and it ends the output
            return 1 if ids[0] == self._eos else 0
        return self._m.validate_tokens(ids)

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._num_tokens:
            raise ValueError(f"rollback({num_tokens}): the matcher holds {self._num_tokens} tokens")
        unrecorded = min(num_tokens, self._eos_unrecorded)
        self._eos_unrecorded -= unrecorded
        if num_tokens > unrecorded and not self._m.rollback(num_tokens - unrecorded):
            raise RuntimeError(f"llguidance rollback({num_tokens - unrecorded}) failed: {self._m.get_error()}")
        self._num_tokens -= num_tokens

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        _check_row(bitmask, row)
        address = bitmask.__array_interface__["data"][0] + row * bitmask.strides[0]  # (.ctypes costs 10 us)
        self._m.unsafe_compute_mask_ptr(address, bitmask.shape[1] * 4)
        if self._m.is_error():  # no token can continue (llguidance then allows EOS alone): a dead row
            bitmask[row] = 0

    @property
    def error(self) -> str:
        message = self._m.get_error()
        return _one_line(message) if message else ""

    def is_terminated(self) -> bool:
        return self._m.is_stopped()

    @property
    def num_accepted_tokens(self) -> int:
        return self._num_tokens


def _check_row(bitmask: np.ndarray, row: int) -> None:
    if bitmask.dtype != np.int32 or bitmask.ndim != 2 or not bitmask.flags["C_CONTIGUOUS"]:
        raise ValueError(f"bitmask must be a C-contiguous int32 [rows, words] array, got {bitmask.dtype} "
                         f"{bitmask.shape}")
    if not 0 <= row < bitmask.shape[0]:
        raise IndexError(f"bitmask row {row} outside [0, {bitmask.shape[0]})")


class GuidanceBackend(GrammarBackend):
    """llguidance behind :class:`GrammarBackend` (see the module docstring)."""

    name = "guidance"

    def __init__(self, tokenizer, vocab_size: int | None = None, *, fill_threads: int = 1):
        super().__init__(tokenizer, vocab_size)
        self.fill_threads = fill_threads
        llg = self._llg = _llguidance()
        if _is_char_tokenizer(tokenizer):
            words = _CharVocabulary(tokenizer, self.vocab_size)
            self._lltok = llg.LLTokenizer(llg.TokenizerWrapper(words), n_vocab=len(words.tokens))
            self._stand_in_bytes = {tid: b for b, tid in words.stand_in.items()}
            self._eos = words.eos_token_id
            self._alphabet_class = "[" + "".join(f"\\x{{{ord(c):x}}}" for c in words.char_to_id) + "]"
        elif hasattr(tokenizer, "backend_tokenizer"):
            self._lltok = _hf_tokenizer(llg, tokenizer, self.vocab_size)
            self._stand_in_bytes = {}
            self._eos = int(tokenizer.eos_token_id)
            self._alphabet_class = None
            unspelled = [b for b in UTF8_BYTES if self._lltok.decode_bytes(self._lltok.tokenize_bytes(bytes([b])))
                         != bytes([b])]
            if unspelled:
                raise ValueError(f"grammar backend 'guidance': tokenizer {type(tokenizer).__name__} cannot spell "
                                 f"{len(unspelled)} byte values (e.g. {unspelled[:8]}); fleetlab needs a "
                                 "byte-level tokenizer, or one with byte fallback, or a CharTokenizer")
        else:
            raise TypeError(f"grammar backend 'guidance' supports fleetlab's CharTokenizer and fast (Rust-backed) "
                            f"PaddleFormers / Hugging Face tokenizers, not {type(tokenizer).__name__}")
        self._width = -(-self._lltok.vocab_size // 32)
        self._executor = None
        # llguidance's default limits, but errors without the parser state and the whole grammar
        # (a 1,500-property schema's message was 40 KB)
        self._limits = llg.LLParserLimits(verbose_errors=False)

    @property
    def bitmask_width(self) -> int:
        return self._width

    @property
    def eos_token_id(self) -> int:
        return self._eos

    @property
    def spells_every_byte(self) -> bool:
        """False when some characters have only stand-in tokens (see the module docstring)."""
        return not self._stand_in_bytes

    def tokenize(self, text: str) -> list[int]:
        return self._lltok.tokenize_str(text)

    def token_text(self, token_id: int) -> str:
        if token_id in self._stand_in_bytes:
            return bytes([self._stand_in_bytes[token_id]]).decode("utf-8", errors="backslashreplace")
        return self._lltok.decode_str([token_id])

    def grammar_text(self, params: StructuredOutputsParams, *, whitespace: bool = True,
                     spelled_only: bool = True) -> str:
        """llguidance's grammar for a validated constraint. ``whitespace=False`` compiles JSON
        with no whitespace between tokens (the vocabulary check's variant). A regex is
        intersected with the vocabulary's alphabet where it lacks characters, unless
        ``spelled_only=False``."""
        llg, kind = self._llg, params.kind
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else params.json
            schema = {} if schema is True else schema  # JSON Schema's "anything": options need an object
            options = {"whitespace_flexible": whitespace and not params.disable_any_whitespace}
            if whitespace and params.whitespace_pattern is not None:
                options["whitespace_pattern"] = params.whitespace_pattern
            return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=options)
        if kind == "choice":
            return llg.grammar_from("choice", json.dumps(params.choice))
        if kind == "regex":
            if self._alphabet_class is None or not spelled_only:
                return llg.grammar_from("regex", params.regex)
            # the regex's language intersected with what the vocabulary spells: no dead ends
            return llg.grammar_from("lark", f"start: OUT\nOUT: /{llg.regex_to_lark(params.regex)}/ & "
                                            f"/{self._alphabet_class}*/\n")
        try:
            return llg.grammar_from("grammar", params.grammar)  # Lark, or GBNF turned into Lark
        except ValueError as exc:
            raise GrammarError("grammar", f"is not a valid grammar: {exc}") from None

    def validate(self, params: StructuredOutputsParams) -> None:
        if params.kind == "choice" and len(params.choice) >= MAX_CHOICES:
            raise GrammarError("choice", f"has {len(params.choice)} strings; llguidance's parser takes at most "
                                         f"{MAX_CHOICES - 1} (a row of its parser holds {MAX_CHOICES} items)")
        grammar = self.grammar_text(params, spelled_only=False)  # errors then quote the user's own regex
        is_error, messages = self._llg.LLMatcher.validate_grammar_with_warnings(grammar, None, limits=self._limits)
        if is_error:
            raise GrammarError(params.kind, f"cannot be compiled: {_one_line(messages[0])}")

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        t0 = time.perf_counter()
        template = self._matcher(params, self.grammar_text(params))
        t1 = time.perf_counter()
        if params.kind == "choice":
            for i, choice in enumerate(params.choice):
                lacking = missing_characters(self, choice)
                if lacking:
                    raise GrammarError(f"choice[{i}]", f"{choice!r} cannot be spelled by the model's vocabulary: "
                                                       f"it has no {_chars(lacking)}")
        elif not self.spells_every_byte:
            search = self._matcher(params, self.grammar_text(params, whitespace=False))  # never needs whitespace
            plain = self.grammar_text(params, whitespace=False, spelled_only=False)

            def new_matcher(stand_ins: bool) -> GuidanceMatcher:
                if stand_ins:  # for the example in the message: every character allowed
                    return GuidanceMatcher(self._matcher(params, plain), self.vocab_size, self._eos,
                                           limit=self.bitmask_width * 32)
                return GuidanceMatcher(search.deep_copy(), self.vocab_size, self._eos)

            try:
                check_vocabulary(self, params.kind, new_matcher)
            except GrammarError:
                raise
            except ValueError as exc:  # a parser limit hit while searching: the constraint is refused
                raise GrammarError(params.kind, f"cannot be served: {exc}") from None
        elif self._allows_nothing(template):  # a byte-complete vocabulary spells any output: one that has none
            raise GrammarError(params.kind, NO_OUTPUT)
        t2 = time.perf_counter()
        grammar = CompiledGrammar(key=params.cache_key(), kind=params.kind, compile_time_s=t2 - t0, backend=self,
                                  handle=template, check_time_s=t2 - t1)
        logger.debug("compiled a %s grammar in %.2f ms", params.kind, grammar.compile_time_s * 1e3)
        return grammar

    def _allows_nothing(self, template) -> bool:
        """Whether a matcher at the grammar's start allows no token at all, EOS included (llguidance
        finds an unsatisfiable regex or a schema that only refers to itself there, at its first mask)."""
        row = self.allocate_bitmask(1)
        GuidanceMatcher(template.deep_copy(), self.vocab_size, self._eos).fill_bitmask(row, 0)
        return not row.any()

    def _matcher(self, params: StructuredOutputsParams, grammar: str):
        m = self._llg.LLMatcher(self._lltok, grammar, log_level=_LOG_LEVEL, limits=self._limits)
        if m.is_error():
            raise GrammarError(params.kind, f"cannot be compiled: {_one_line(m.get_error())}")
        return m

    def new_matcher(self, grammar: CompiledGrammar) -> GuidanceMatcher:
        return GuidanceMatcher(grammar.handle.deep_copy(), self.vocab_size, self._eos)

    def fill_bitmasks(self, rows, bitmask: np.ndarray) -> None:
        """Every ``(matcher, row)``: one by one, or with ``fill_threads > 1`` on llguidance's
        own thread pool (no GIL held; on 2 busy cores here it was slower than one by one)."""
        if self.fill_threads <= 1 or len(rows) < 2:
            return super().fill_bitmasks(rows, bitmask)
        if self._executor is None:
            self._executor = self._llg.LLExecutor(num_threads=self.fill_threads)
        for _, row in rows:
            _check_row(bitmask, row)
        address = bitmask.__array_interface__["data"][0]
        self._executor.unsafe_compute_mask_ptr([(m._m, row) for m, row in rows], address, bitmask.shape[1] * 4,
                                               bitmask.shape[0])
        for m, row in rows:
            if m._m.is_error():  # as in GuidanceMatcher.fill_bitmask: a dead row allows nothing
                bitmask[row] = 0

    def close(self) -> None:
        self._executor = None


def _one_line(message: str, limit: int = 300) -> str:
    text = " ".join(message.replace("<non-verbose/>", "").split()) or "(no message)"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _chars(chars) -> str:
    return ", ".join(repr(c) for c in sorted(chars))

