"""The handle ``patch_model`` returns: runs the patched model and undoes the patch."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import paddle

from fleetlab.attention.context import get_forward_context

PATCH_ATTR = "_fleetlab_patch"  # the live patch's root, kept on the patched model


@dataclass(eq=False)
class PatchRoot:
    """One live patch of a model, shared by every handle on it.

    undo: how to revert every change, in order; users: handles still holding it (the model
    is restored when the last one unpatches); retired_by: set when a later ``patch_model``
    with another backend replaced this patch (its handles then refuse to run); first: the
    handle that made the patch (new sharers are copies of it).
    """

    undo: list[Callable[[], None]] = field(default_factory=list)
    users: int = 1
    retired_by: str | None = None
    first: PatchHandle | None = None

    def share(self) -> PatchHandle:
        """Another handle on this live patch. The model is restored once every handle let go."""
        if self.retired_by is not None or not self.undo:
            raise RuntimeError("cannot share a patch that is no longer live")
        other = copy.copy(self.first)
        other.patched = True
        self.users += 1
        return other

    def restore(self, model) -> None:
        for undo in reversed(self.undo):
            undo()
        self.undo.clear()
        if model.__dict__.get(PATCH_ATTR) is self:
            del model.__dict__[PATCH_ATTR]


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
        self._root = PatchRoot(list(undo), first=self)
        model.__dict__[PATCH_ATTR] = self._root
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
                       logits_indices: paddle.Tensor, inputs_embeds: paddle.Tensor | None = None) -> paddle.Tensor:
        """Run the packed step and return logits at ``logits_indices`` only.

        input_ids, positions: int64 ``[1, T]``; logits_indices: int64 ``[B]`` indices into
        the ``T`` tokens (each row's last scheduled token). ``inputs_embeds`` ``[1, T, hidden]``
        replaces the model's own token embeddings (side data such as image features, see
        :meth:`embed`). Returns float ``[B, vocab]``. Must be called inside ``forward_context``.
        """
        raise NotImplementedError

    def embed(self, input_ids: paddle.Tensor) -> paddle.Tensor:
        """The model's own input embeddings ``[1, T, hidden]`` of ``input_ids [1, T]``."""
        raise NotImplementedError

    @functools.cached_property
    def hidden_size(self) -> int:
        """Width of the input embeddings (what ``prompt_embeds`` vectors must have; measured once)."""
        return int(self.embed(paddle.zeros([1, 1], dtype="int64")).shape[-1])

    def _check_step(self, input_ids, positions, logits_indices) -> None:
        """Raise, naming the problem, unless the handle is patched and the step is well formed.

        An unpatched model would still run -- on its own attention, over the whole packed
        batch, so requests would attend to each other: hence the error rather than logits.
        """
        self.check_live()
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

    def check_live(self) -> None:
        """Raise RuntimeError, saying why, unless this handle can run the model."""
        if not self.patched:
            raise RuntimeError(f"{self.family}: this handle (or the LLM holding it) was unpatched/closed; "
                               "patch the model again")
        if self._root.retired_by is not None:
            raise RuntimeError(f"{self.family}: this model was re-patched with {self._root.retired_by} after this "
                               "handle (or LLM) was made, so it no longer runs on this handle's backend; build a "
                               "new LLM, or close the newer one and patch again")

    def retire(self, reason: str) -> None:
        """Restore the model now for every sharer (a new patch with another backend takes
        over); handles of this patch then refuse to run, naming ``reason``."""
        self._root.retired_by = reason
        self._root.restore(self.model)

    def unpatch(self) -> None:
        """Let go of the patch; the model is exactly as before ``patch_model`` once every
        handle sharing the patch has let go."""
        if not self.patched:
            return
        self.patched = False
        self._root.users -= 1
        if self._root.users == 0 and self._root.retired_by is None:
            self._root.restore(self.model)

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
