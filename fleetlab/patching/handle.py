"""The handle ``patch_model`` returns: runs the patched model and undoes the patch."""

from __future__ import annotations

from collections.abc import Callable

import paddle

from fleetlab.context import get_forward_context


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
      tp_rank, tp_size: this process's tensor-parallel rank and the number of ranks; with
        ``tp_size > 1``, ``num_kv_heads`` is this rank's share (set by ``fleetlab.distributed``).
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
        self.tp_rank, self.tp_size = 0, 1
        self.patched = True

    def compute_logits(self, input_ids: paddle.Tensor, positions: paddle.Tensor,
                       logits_indices: paddle.Tensor) -> paddle.Tensor:
        """Run the packed step and return logits at ``logits_indices`` only.

        input_ids, positions: int64 ``[1, T]``; logits_indices: int64 ``[B]`` indices into
        the ``T`` tokens (each row's last scheduled token). Returns float ``[B, vocab]``.
        Must be called inside ``forward_context``.
        """
        raise NotImplementedError

    def _check_step(self, input_ids, positions, logits_indices) -> None:
        """Raise, naming the problem, unless the handle is patched and the step is well formed.

        An unpatched model would still run -- on its own attention, over the whole packed
        batch, so requests would attend to each other: hence the error rather than logits.
        """
        if not self.patched:
            raise RuntimeError(f"{self.family}: compute_logits on an unpatched handle; patch the model again")
        if input_ids.ndim != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"{self.family}: input_ids must be one packed sequence [1, T] (batch > 1 is not "
                             f"supported); got {list(input_ids.shape)}")
        if list(positions.shape) != list(input_ids.shape):
            raise ValueError(f"{self.family}: positions {list(positions.shape)} must match input_ids "
                             f"{list(input_ids.shape)}")
        if logits_indices.ndim != 1:
            raise ValueError(f"{self.family}: logits_indices must be 1-D [B]; got {list(logits_indices.shape)}")
        metadata = get_forward_context().metadata
        if metadata.num_tokens != input_ids.shape[1]:
            raise ValueError(f"{self.family}: the forward context's metadata covers {metadata.num_tokens} tokens "
                             f"but input_ids has {input_ids.shape[1]}")

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
