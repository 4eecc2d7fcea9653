"""Write and evaluate code-model checkpoints in PaddleFormers' layout.

A checkpoint directory holds ``model.safetensors`` (float32, Hugging Face Llama names and
layouts: projections ``[out_features, in_features]``, the transpose of Paddle's; no
``lm_head.weight``, which is tied to the input embedding), ``config.json`` (a
``LlamaConfig`` naming ``LlamaForCausalLM``), the tokenizer files of
:func:`fleetlab.models.bpe.save_tokenizer` and the corpus manifest ``corpus.json``:
PaddleFormers' ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``
read it as they read a downloaded model.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MODEL_FILE = "model.safetensors"


def paddle_state_to_hf(model) -> dict[str, np.ndarray]:
    """``model``'s weights as Hugging Face-layout float32 arrays, the tied ``lm_head`` left out."""
    names = tuple(getattr(model, "transpose_weight_keys", None) or ())
    tensors = {}
    for key, value in model.state_dict().items():
        if key == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        array = value.numpy().astype(np.float32)
        if array.ndim == 2 and any(f".{n}." in key for n in names):
            array = array.T
        tensors[key] = np.ascontiguousarray(array)
    return tensors


def write_weights(tensors: dict[str, np.ndarray], config, out_dir: str | os.PathLike) -> Path:
    """Write ``model.safetensors`` and ``config.json`` (``config``: a ``LlamaConfig``) into ``out_dir``."""
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / MODEL_FILE), metadata={"format": "pt"})  # HF's tag for this layout
    os.chmod(out / MODEL_FILE, 0o644)  # safetensors creates it owner-only; it is package data
    config.architectures = ["LlamaForCausalLM"]
    config.to_json_file(str(out / "config.json"))
    return out / MODEL_FILE


@dataclass(frozen=True, slots=True)
class Evaluation:
    """Next-token loss (nats) and greedy next-token accuracy over ``tokens`` predicted tokens."""

    loss: float
    accuracy: float
    tokens: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)


def evaluate(model, stream: np.ndarray, seq_len: int, max_windows: int | None = None) -> Evaluation:
    """Loss and accuracy of ``model`` (Paddle, eval mode) on non-overlapping ``seq_len``-token
    windows of ``stream`` (at most ``max_windows`` of them, evenly spaced)."""
    import paddle
    import paddle.nn.functional as F

    count = (len(stream) - 1) // seq_len
    if count < 1:
        raise ValueError(f"evaluate: a stream of {len(stream)} tokens holds no window of {seq_len}")
    starts = np.arange(count) * seq_len
    if max_windows is not None and count > max_windows:
        starts = starts[np.linspace(0, count - 1, max_windows).astype(int)]
    total_loss, correct, n = 0.0, 0, 0
    with paddle.no_grad():
        for start in starts:
            window = stream[start : start + seq_len + 1].astype(np.int64)
            logits = model(input_ids=paddle.to_tensor(window[None, :-1]), return_dict=True).logits[0]
            labels = paddle.to_tensor(window[1:])
            total_loss += float(F.cross_entropy(logits, labels, reduction="sum"))
            correct += int((paddle.argmax(logits, axis=-1) == labels).astype("int64").sum())
            n += seq_len
    return Evaluation(total_loss / n, correct / n, n)
