"""What the server refuses: request fields it knows but does not apply, and why.

A client that sends ``min_p=0.1`` or ``guided_choice=["yes", "no"]`` expects its answer to
change. A server that drops the field answers as if it had not been sent, and nobody
notices. So every field fleetlab does not apply is answered 400, naming the field and saying
why, as OpenAI answers a field it does not know ("Unrecognized request argument supplied").

Each entry of :data:`COMPLETION` and :data:`CHAT` is a :class:`Refusal`: the values that change
nothing (accepted: ``min_p=0``, ``modalities=["text"]``, ``tools=[]``...) and the reason
given for any other value. A field in neither table and not a field of the request model is
refused as unrecognized. :func:`check_fields` applies them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fleetlab.serving.errors import BadRequest


@dataclass(frozen=True, slots=True)
class Refusal:
    """``no_op(value)``: True when the value changes nothing (it is accepted); ``reason``: why any
    other value is refused."""

    no_op: Callable[[Any], bool]
    reason: str


def unset_or(*no_op_values) -> Callable[[Any], bool]:
    """A ``no_op`` test: None, or equal to one of ``no_op_values`` (``0`` never equals ``False``)."""

    def test(value) -> bool:
        return value is None or any(_same(value, v) for v in no_op_values)

    return test


def _same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):  # in Python 0 == False and 1 == True
        return a is b
    return a == b


_PROMPT_LOGPROBS = "a vLLM extension; the prompt's log-probabilities come with echo=true and logprobs (OpenAI's way)"
_SAMPLER = ("fleetlab's sampler does not implement it (it applies temperature, top_k, top_p, seed, the "
            "penalties and logit_bias)")
_GUIDED = ("vLLM removed its guided_* fields in 0.12: send structured outputs as structured_outputs={{{!r}: ...}} "
           "(or response_format)")
_STRUCTURAL_TAG = "fleetlab's structured outputs do not implement structural tags (json, regex, choice, grammar do)"
_TOOLS = "tool and function calling are not supported"
_TEXT_ONLY = "fleetlab's models read and write text only"
_TEMPLATE = "the server renders messages with its own chat template (the tokenizer's, or fleetlab's minimal one)"
_VLLM = "a vLLM extension that fleetlab does not implement"
_STORAGE = "fleetlab stores nothing and has no service tiers"

_NO_OP_FALSE = unset_or(False)
_NO_OP_NONE = unset_or()

# Fields both endpoints may receive (OpenAI's, then vLLM's extras).
_COMMON = {
    "prompt_logprobs": Refusal(_NO_OP_NONE, _PROMPT_LOGPROBS),
    "min_p": Refusal(unset_or(0), _SAMPLER),
    "use_beam_search": Refusal(_NO_OP_FALSE, _SAMPLER),
    "length_penalty": Refusal(unset_or(1), _SAMPLER),
    "allowed_token_ids": Refusal(_NO_OP_NONE, _SAMPLER),
    "bad_words": Refusal(unset_or([]), _SAMPLER),
    "logits_processors": Refusal(_NO_OP_NONE, _SAMPLER),
    "guided_json": Refusal(_NO_OP_NONE, _GUIDED.format("json")),
    "guided_regex": Refusal(_NO_OP_NONE, _GUIDED.format("regex")),
    "guided_choice": Refusal(_NO_OP_NONE, _GUIDED.format("choice")),
    "guided_grammar": Refusal(_NO_OP_NONE, _GUIDED.format("grammar")),
    "guided_whitespace_pattern": Refusal(_NO_OP_NONE, _GUIDED.format("whitespace_pattern")),
    "guided_decoding_backend": Refusal(_NO_OP_NONE, "vLLM removed guided_decoding_backend in 0.12 (the server "
                                                    "chooses the grammar backend): remove it"),
    "structural_tag": Refusal(_NO_OP_NONE, _STRUCTURAL_TAG),
    "skip_special_tokens": Refusal(unset_or(True), _VLLM + " (special tokens are always skipped)"),
    "spaces_between_special_tokens": Refusal(unset_or(True), _VLLM),
    "truncate_prompt_tokens": Refusal(_NO_OP_NONE, _VLLM),
    "priority": Refusal(unset_or(0), _VLLM),
    "request_id": Refusal(_NO_OP_NONE, _VLLM),
    "cache_salt": Refusal(_NO_OP_NONE, _VLLM),
    "kv_transfer_params": Refusal(_NO_OP_NONE, _VLLM),
    "vllm_xargs": Refusal(_NO_OP_NONE, _VLLM),
    "return_tokens_as_token_ids": Refusal(_NO_OP_FALSE, _VLLM),
    "mm_processor_kwargs": Refusal(_NO_OP_NONE, _TEXT_ONLY),
    "metadata": Refusal(_NO_OP_NONE, _STORAGE),
    "store": Refusal(_NO_OP_FALSE, _STORAGE),
    "service_tier": Refusal(unset_or("auto", "default"), _STORAGE),
}

COMPLETION = {
    **_COMMON,
    "suffix": Refusal(unset_or(""), "fleetlab's models do not fill in the middle"),
    "add_special_tokens": Refusal(unset_or(True), _VLLM),
    "prompt_embeds": Refusal(_NO_OP_NONE, _VLLM + " over HTTP (LLM.add_request takes prompt_embeds)"),
}
"""``POST /v1/completions``: field -> :class:`Refusal`."""

CHAT = {
    **_COMMON,
    "echo": Refusal(_NO_OP_FALSE, _VLLM + " for chat (OpenAI's echo is a completions field)"),
    "tools": Refusal(unset_or([]), _TOOLS),
    "tool_choice": Refusal(unset_or("none", "auto"), _TOOLS),
    "parallel_tool_calls": Refusal(lambda v: v is None or isinstance(v, bool), _TOOLS),
    "functions": Refusal(unset_or([]), _TOOLS),
    "function_call": Refusal(unset_or("none", "auto"), _TOOLS),
    "modalities": Refusal(unset_or(["text"]), _TEXT_ONLY),
    "audio": Refusal(_NO_OP_NONE, _TEXT_ONLY),
    "prediction": Refusal(_NO_OP_NONE, "predicted outputs are not supported"),
    "reasoning_effort": Refusal(_NO_OP_NONE, "fleetlab's models do not reason in a separate channel"),
    "web_search_options": Refusal(_NO_OP_NONE, "fleetlab does not search the web"),
    "chat_template": Refusal(_NO_OP_NONE, _TEMPLATE),
    "chat_template_kwargs": Refusal(unset_or({}), _TEMPLATE),
    "add_generation_prompt": Refusal(unset_or(True), _TEMPLATE),
    "continue_final_message": Refusal(_NO_OP_FALSE, _TEMPLATE),
    "add_special_tokens": Refusal(_NO_OP_FALSE, _TEMPLATE),
    "documents": Refusal(_NO_OP_NONE, _TEMPLATE),
}
"""``POST /v1/chat/completions``: field -> :class:`Refusal`."""

MESSAGE = {
    "name": Refusal(_NO_OP_NONE, _TEMPLATE + ", which does not write participant names"),
    "tool_calls": Refusal(unset_or([]), _TOOLS),
    "tool_call_id": Refusal(_NO_OP_NONE, _TOOLS),
    "function_call": Refusal(_NO_OP_NONE, _TOOLS),
    "refusal": Refusal(_NO_OP_NONE, "refusal messages are not rendered by the chat template"),
    "audio": Refusal(_NO_OP_NONE, _TEXT_ONLY),
}
"""One chat message (``messages[i]``): field -> :class:`Refusal`."""


def check_fields(fields: dict, table: dict[str, Refusal], where: str = "") -> None:
    """Raise :class:`BadRequest` for the first of ``fields`` (``{name: value}``, the request's
    fields that are not applied) that changes something; ``where`` prefixes the field's name
    (``"messages[2]."``)."""
    for name, value in fields.items():
        param = f"{where}{name}"
        refusal = table.get(name)
        if refusal is None:
            raise BadRequest(f"unrecognized request field {param!r}: fleetlab does not apply it; remove it",
                             param, "unsupported")
        if not refusal.no_op(value):
            raise BadRequest(f"{param}={_show(value)} is not supported: {refusal.reason}", param, "unsupported")


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
