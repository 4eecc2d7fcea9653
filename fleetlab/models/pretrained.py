"""Load and save trained models: the shipped tiny Llama and PaddleFormers checkpoints.

The shipped checkpoint lives in ``fleetlab/models/weights/`` and is written by
``python -m fleetlab train-tiny`` (see :mod:`fleetlab.models.train`):

- ``model.safetensors``: float32 weights under Hugging Face Llama names and layouts
  (projection matrices stored ``[out_features, in_features]``; Paddle keeps them
  ``[in, out]``, so they are transposed on save and load);
- ``config.json``: the PaddleFormers ``LlamaConfig``;
- ``tokenizer.json``: the :class:`~fleetlab.models.tokenizer.CharTokenizer` vocabulary.

It is also an ordinary PaddleFormers checkpoint directory, so
:func:`load_pretrained` reads it too. Greedy helpers (:func:`greedy_generate`,
:func:`complete`, :func:`addition_accuracy`) use the unpatched model's full forward
(``use_cache=False``, recomputed every step): the correctness oracle of the project.
"""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import paddle
from paddleformers.transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from safetensors.numpy import load_file, save_file

from fleetlab.models.tokenizer import CharTokenizer

logger = logging.getLogger(__name__)

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
DRAFT_WEIGHTS_DIR = WEIGHTS_DIR / "draft"
MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


def _is_transposed(model, key: str, ndim: int) -> bool:
    # PaddleFormers lists the projections whose Paddle layout is the transpose of the HF one.
    names = getattr(model, "transpose_weight_keys", None) or ()
    return ndim == 2 and any(f".{name}." in key for name in names)


def save_tiny(model, tokenizer: CharTokenizer, out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write ``model.safetensors``, ``config.json`` and ``tokenizer.json`` into ``out_dir``.

    Returns the paths written, by file kind (``"model"``, ``"config"``, ``"tokenizer"``).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for key, value in model.state_dict().items():
        array = value.numpy()
        tensors[key] = np.ascontiguousarray(array.T if _is_transposed(model, key, array.ndim) else array)
    save_file(tensors, str(out / MODEL_FILE), metadata={"format": "pt"})  # HF's tag for this layout
    os.chmod(out / MODEL_FILE, 0o644)  # safetensors creates it owner-only; it is package data
    # "architectures" is how PaddleFormers' AutoModel picks the class (save_pretrained sets it too).
    model.config.architectures = [type(model).__name__]
    model.config.to_json_file(str(out / CONFIG_FILE))
    tokenizer.save(out)
    return {"model": out / MODEL_FILE, "config": out / CONFIG_FILE, "tokenizer": out / "tokenizer.json"}


def load_tiny(path: str | os.PathLike | None = None):
    """The trained tiny Llama and its tokenizer: ``(LlamaForCausalLM in eval mode, CharTokenizer)``.

    ``path`` defaults to the checkpoint shipped in the package (``WEIGHTS_DIR``).
    """
    directory = Path(path) if path is not None else WEIGHTS_DIR
    if not (directory / MODEL_FILE).is_file():
        raise FileNotFoundError(
            f"load_tiny: no {MODEL_FILE} in {directory}; run `python -m fleetlab train-tiny` to create it"
        )
    return read_llama(directory), CharTokenizer.load(directory)


def read_llama(directory: Path):
    """The ``LlamaForCausalLM`` (eval mode) of a shipped checkpoint directory.

    Weights are read with ``safetensors.numpy`` (device-neutral) and copied into a model built
    from ``config.json`` on Paddle's current device; a tied ``lm_head`` may be absent from the
    file. Unlike ``from_pretrained`` this writes nothing into ``directory`` (package data).
    """
    with open(directory / CONFIG_FILE, encoding="utf-8") as f:
        config = LlamaConfig(**json.load(f))
    model = LlamaForCausalLM(config)
    weights = load_file(str(directory / MODEL_FILE))
    expected = model.state_dict()
    wanted = set(expected) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if set(weights) != wanted:
        missing, unexpected = sorted(wanted - set(weights)), sorted(set(weights) - wanted)
        raise RuntimeError(f"read_llama: {directory / MODEL_FILE} missing {missing}, unexpected {unexpected}")
    state = {}
    for key, array in weights.items():
        array = array.T if _is_transposed(model, key, array.ndim) else array
        if tuple(array.shape) != tuple(expected[key].shape):
            raise RuntimeError(f"read_llama: {key} has shape {array.shape}, model wants {expected[key].shape}")
        state[key] = np.ascontiguousarray(array)
    if config.tie_word_embeddings:  # the same tensor: given, so Paddle does not warn that it is missing
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.set_state_dict(state)
    model.eval()
    return model


def load_pretrained(path: str | os.PathLike):
    """A PaddleFormers causal LM from the checkpoint directory ``path``, in eval mode.

    Uses PaddleFormers' own ``AutoModelForCausalLM.from_pretrained`` on the local
    directory (no download). Note that PaddleFormers may write a small metadata file
    (``flex-ckpt.auto_generated.metadata``) into ``path`` the first time it reads it.
    """
    directory = Path(path)
    if not (directory / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"load_pretrained: {directory} has no {CONFIG_FILE}")
    model = AutoModelForCausalLM.from_pretrained(str(directory))
    model.eval()
    return model


def greedy_generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_token_id: int) -> list[list[int]]:
    """Greedy continuations of token-id ``prompts``, batched, with no KV cache.

    Prompts of equal length run as one ``[n, T]`` batch; every step recomputes the
    full forward (``use_cache=False``) and appends the argmax of the last position.
    A row stops after it emits ``eos_token_id`` (which is kept in its output).
    Returns one list of new token ids per prompt, in prompt order.
    """
    if max_new_tokens < 1:
        raise ValueError(f"greedy_generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    groups: dict[int, list[int]] = defaultdict(list)
    for index, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"greedy_generate: prompt {index} is empty")
        groups[len(prompt)].append(index)
    results: list[list[int]] = [[] for _ in prompts]
    was_training = model.training
    model.eval()
    try:
        with paddle.no_grad():
            for indices in groups.values():
                tokens = np.array([list(prompts[i]) for i in indices], dtype=np.int64)
                new = _greedy_group(model, tokens, max_new_tokens, eos_token_id)
                for row, i in enumerate(indices):
                    results[i] = new[row]
    finally:
        if was_training:
            model.train()
    return results


def _greedy_group(model, tokens: np.ndarray, max_new_tokens: int, eos_token_id: int) -> list[list[int]]:
    finished = np.zeros(len(tokens), dtype=bool)
    outputs: list[list[int]] = [[] for _ in range(len(tokens))]
    for _ in range(max_new_tokens):
        logits = model(input_ids=paddle.to_tensor(tokens), use_cache=False, return_dict=True).logits
        next_ids = paddle.argmax(logits[:, -1, :], axis=-1).numpy().astype(np.int64)
        for row, token in enumerate(next_ids):
            if not finished[row]:
                outputs[row].append(int(token))
        finished |= next_ids == eos_token_id
        if finished.all():
            break
        tokens = np.concatenate([tokens, next_ids[:, None]], axis=1)
    return outputs


def complete(model, tokenizer: CharTokenizer, prompts: Sequence[str], max_new_tokens: int = 8) -> list[str]:
    """Greedy text continuations of ``prompts`` (up to, not including, ``<eos>``).

    ``complete(model, tok, ["12+7="]) -> ["19"]`` for the shipped tiny Llama.
    """
    ids = [tokenizer.encode(p) for p in prompts]
    new = greedy_generate(model, ids, max_new_tokens, tokenizer.eos_token_id)
    return [tokenizer.decode(_until_eos(row, tokenizer.eos_token_id)) for row in new]


def _until_eos(ids: list[int], eos_token_id: int) -> list[int]:
    return ids[: ids.index(eos_token_id)] if eos_token_id in ids else ids


def addition_accuracy(model, tokenizer: CharTokenizer, pairs: Sequence[tuple[int, int]]) -> float:
    """Fraction of ``(a, b)`` for which greedy decoding of ``"a+b="`` gives ``str(a+b)`` then ``<eos>``."""
    if len(pairs) == 0:
        raise ValueError("addition_accuracy: pairs is empty")
    prompts = [tokenizer.encode(f"{a}+{b}=") for a, b in pairs]
    answers = [tokenizer.encode(str(a + b), add_bos=False, add_eos=True) for a, b in pairs]
    new = greedy_generate(model, prompts, max(len(x) for x in answers), tokenizer.eos_token_id)
    correct = sum(got == want for got, want in zip(new, answers))
    return correct / len(pairs)
