"""What the shipped code model is: its architecture, its draft's, and its token stream.

Shared by the CPU trainer (``python -m fleetlab train-code``, Paddle) and the GPU recipe
(``tools/train_code_torch.py``, PyTorch), so both train the same PaddleFormers
``LlamaForCausalLM`` on the same tokens:

- :data:`TARGET` and :data:`DRAFT`: ``LlamaConfig`` fields (RMSNorm, rotary embeddings,
  SwiGLU MLP, grouped-query attention, input and output embeddings tied);
- :func:`token_stream`: a split's files encoded by the BPE tokenizer, each as
  ``<bos> text <eos>``, concatenated (``uint16``: the vocabulary has 4,096 ids);
- :func:`validation_cut`: the last part of the training stream kept out of the batches,
  to choose the checkpoint by (the held-out modules are only ever reported on).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fleetlab.models import bpe, code_corpus

CODE_DIR = Path(__file__).resolve().parent / "code"
DRAFT_DIR = CODE_DIR / "draft"

_COMMON = {
    "vocab_size": bpe.VOCAB_SIZE,
    "head_dim": 32,
    "max_position_embeddings": bpe.MODEL_MAX_LENGTH,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "pad_token_id": bpe.PAD_ID,
    "bos_token_id": bpe.BOS_ID,
    "eos_token_id": bpe.EOS_ID,
}
TARGET = {**_COMMON, "hidden_size": 256, "intermediate_size": 640, "num_hidden_layers": 4,
          "num_attention_heads": 8, "num_key_value_heads": 4}  # fmt: skip
"""About 3.8 M parameters: 15 MB in float32."""
DRAFT = {**_COMMON, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
"""About 0.9 M parameters, the same tokenizer: the speculative-decoding draft."""

VALIDATION_FRACTION = 0.01


def llama_config(dims: dict):
    """A PaddleFormers ``LlamaConfig`` (float32, unfused RMSNorm so it runs on a CPU) for ``dims``."""
    from paddleformers.transformers import LlamaConfig

    return LlamaConfig(**dims, fuse_rms_norm=False, use_cache=False, dtype="float32")


def token_stream(tokenizer, split: str) -> np.ndarray:
    """``split``'s files (:func:`fleetlab.models.code_corpus.iter_files`) as one ``uint16``
    array: ``<bos> file <eos>`` per file, in path order. ``tokenizer``: a ``tokenizers.Tokenizer``."""
    texts = [f.text for f in code_corpus.iter_files(split)]
    pieces = [np.asarray(e.ids + [bpe.EOS_ID], dtype=np.uint16) for e in tokenizer.encode_batch(texts)]
    return np.concatenate(pieces) if pieces else np.zeros(0, np.uint16)


def validation_cut(stream: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(train, validation)``: the stream split at ``1 - VALIDATION_FRACTION`` of its length."""
    cut = int(len(stream) * (1 - VALIDATION_FRACTION))
    return stream[:cut], stream[cut:]
