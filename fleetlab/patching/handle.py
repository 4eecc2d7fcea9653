"""The handle ``patch_model`` returns: runs the patched model and undoes the patch."""

from __future__ import annotations

from collections.abc import Callable

import paddle


class PatchHandle:
    """A patched model, ready to run packed steps under ``forward_context``.

    Attributes:
      model: the patched model.
      family: the model family name (``"llama"``, ``"fleet"``, ...).
      backend: the attention backend instance every patched layer calls.
      layer_ids: ``{qualified layer name: 0-based layer id}`` for every patched attention.
      num_layers, num_kv_heads, head_dim, dtype, vocab_size, max_model_len: what the engine
        needs to size the paged cache and check requests.
      sliding_windows: ``{layer_id: window}`` for layers with a sliding window.
    """

    def __init__(self, model, family: str, backend, layer_ids: dict[str, int], undo: list[Callable[[], None]],
                 *, num_layers: int, num_kv_heads: int, head_dim: int, vocab_size: int,
                 max_model_len: int, dtype=None, sliding_windows: dict[int, int] | None = None,
                 eos_token_id=None):
        self.model = model
        self.family = family
        self.backend = backend
        self.layer_ids = dict(layer_ids)
        self._undo = list(undo)
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.sliding_windows = dict(sliding_windows or {})
        self.eos_token_id = eos_token_id
        self.patched = True

    def compute_logits(self, input_ids: paddle.Tensor, positions: paddle.Tensor,
                       logits_indices: paddle.Tensor) -> paddle.Tensor:
        """Run the packed step and return logits at ``logits_indices`` only.

        input_ids, positions: int64 ``[1, T]``; logits_indices: int64 ``[B]`` indices into
        the ``T`` tokens (each row's last scheduled token). Returns float ``[B, vocab]``.
        Must be called inside ``forward_context``.
        """
        raise NotImplementedError

    def unpatch(self) -> None:
        """Restore the model exactly as it was before ``patch_model``."""
        if not self.patched:
            return
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        self.patched = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.unpatch()

    def __repr__(self) -> str:
        state = "patched" if self.patched else "unpatched"
        return (f"<PatchHandle {self.family} {state}: {len(self.layer_ids)} attention layers -> "
                f"{type(self.backend).__name__}>")


def has_core_attention(model) -> bool:
    """True for Fleet/Megatron-style models: decoder layers hold a ``core_attention`` sub-layer."""
    return any(name.split(".")[-1] == "core_attention" for name, _ in model.named_sublayers())
