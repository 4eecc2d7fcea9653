"""Chat messages -> prompt token ids.

A chat model was trained on conversations laid out in one exact way (role markers, special
tokens, where the answer starts); the layout is its **chat template**. The server uses:

1. the tokenizer's own template, when it has one (a PaddleFormers / Hugging Face tokenizer with
   a ``chat_template``): ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``;
2. otherwise :data:`MINIMAL_TEMPLATE`, written for models with no chat training, such as the
   shipped tiny Llama and its character tokenizer: each message's text on its own line, roles
   not written, nothing appended. The tiny model was trained on bare lines (``12+7=19``), so a
   single user message ``"12+7="`` becomes the prompt ``"12+7="`` and is answered ``"19"``;
   earlier turns, if any, are lines above it.
"""

from __future__ import annotations

from collections.abc import Sequence

MINIMAL_TEMPLATE = "each message's text on its own line (roles not written); the answer follows the last line"
MINIMAL_TEMPLATE_JINJA = "{% for m in messages %}{{ m['content'] }}{% if not loop.last %}\n{% endif %}{% endfor %}"
"""The same layout as a Jinja chat template (``/tokenizer_info`` sends it, for clients that render prompts)."""


def has_chat_template(tokenizer) -> bool:
    """Whether ``tokenizer`` carries a chat template of its own."""
    return bool(getattr(tokenizer, "chat_template", None)) and hasattr(tokenizer, "apply_chat_template")


def render_minimal(messages: Sequence[dict]) -> str:
    """:data:`MINIMAL_TEMPLATE` applied to ``[{"role", "content"}, ...]`` (content: a string)."""
    return "\n".join(m["content"] for m in messages)


def chat_prompt_ids(tokenizer, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
    """Prompt token ids for ``messages`` (``[{"role": ..., "content": str}, ...]``).

    The tokenizer's own template when it has one, else :func:`render_minimal` encoded by the
    tokenizer (which adds its BOS, as for a completion prompt; it appends no generation prompt).
    """
    if has_chat_template(tokenizer):
        return _as_ids(tokenizer.apply_chat_template(list(messages), tokenize=True,
                                                     add_generation_prompt=add_generation_prompt))
    return encode_text(tokenizer, render_minimal(messages))


def chat_template_text(tokenizer) -> str:
    """The chat template the server renders with, as Jinja text."""
    return tokenizer.chat_template if has_chat_template(tokenizer) else MINIMAL_TEMPLATE_JINJA


def encode_text(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """``tokenizer.encode(text)`` as a list of ints (a tokenizer may return a dict or a batch);
    ``add_special_tokens=False``: without the BOS a tokenizer adds (Hugging Face's keyword, or
    fleetlab's ``CharTokenizer``'s ``add_bos``)."""
    if add_special_tokens:
        return _as_ids(tokenizer.encode(text))
    try:
        return _as_ids(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:  # not a Hugging Face-style tokenizer
        return _as_ids(tokenizer.encode(text, add_bos=False))


def _as_ids(ids) -> list[int]:
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    ids = list(ids)
    if ids and isinstance(ids[0], (list, tuple)):  # a batch of one
        ids = list(ids[0])
    return [int(t) for t in ids]
