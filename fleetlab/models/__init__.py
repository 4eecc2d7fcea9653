"""Models that need no download: tiny random models of each family, a Fleet-style
decoder, and the tiny Llama that fleetlab trains and ships.

- ``tiny(family, seed=0, **overrides)``: a small random-init model in eval mode.
  Families: ``"llama"``, ``"ernie4_5"``, ``"phi3"``, ``"gemma3"``, ``"gpt_oss"`` (PaddleFormers)
  and ``"fleet"`` (fleetlab's own Fleet-style decoder).
- ``load_tiny()`` -> ``(model, tokenizer)``: the shipped trained tiny Llama.
- ``load_tiny_draft()`` -> ``(model, tokenizer)``: its 2-layer draft for speculative decoding.
- ``tiny_json(family="llama", seed=0)`` -> ``(model, tokenizer)``: a tiny random model whose
  character vocabulary can spell JSON (the shipped one cannot), for structured outputs.
- ``load_code(draft=False)`` -> ``(model, tokenizer)``: the code model trained on the Python
  standard library (byte-level BPE tokenizer), or its draft; ``load_code_tokenizer()``: the tokenizer.
- ``load(name_or_path)`` -> ``(model, tokenizer)``: a shipped name (``"tiny"``, ``"code"``, ...), a
  checkpoint directory or a model id, through PaddleFormers' ``from_pretrained``.
- ``load_pretrained(path)``: a PaddleFormers checkpoint directory from disk (the model only).
- ``CharTokenizer``: the character tokenizer of the shipped model and of ``tiny_json``.
- ``fleet_from_llama(model)``: a trained Llama's weights moved into the Fleet-style decoder.
"""

from __future__ import annotations

from fleetlab.models.tokenizer import CharTokenizer

# The builders and loaders below import their module when first called: those modules import
# Paddle and PaddleFormers (seconds), and ``fleetlab.models`` must stay as cheap to import as
# ``fleetlab`` itself, as must its light modules (``tokenizer``, ``corpus``).

__all__ = ["FAMILIES", "CharTokenizer", "FleetConfig", "FleetForCausalLM", "fleet_from_llama", "load", "load_code",
           "load_code_tokenizer", "load_pretrained", "load_tiny", "load_tiny_draft", "tiny", "tiny_json"]

FAMILIES = ("llama", "ernie4_5", "phi3", "gemma3", "gpt_oss", "fleet")


def tiny(family: str, seed: int = 0, **overrides):
    """A small random-init model of ``family`` in eval mode (see ``FAMILIES``)."""
    if family == "fleet":
        from fleetlab.models.fleet import tiny_fleet

        return tiny_fleet(seed=seed, **overrides)
    from fleetlab.models.small import tiny_paddleformers

    return tiny_paddleformers(family, seed=seed, **overrides)


def tiny_json(family: str = "llama", seed: int = 0, **overrides):
    """A tiny random ``family`` model over a JSON-capable character vocabulary:
    ``(model, tokenizer)`` (see :mod:`fleetlab.models.json_tiny`)."""
    from fleetlab.models.json_tiny import tiny_json as _tiny_json

    return _tiny_json(family, seed=seed, **overrides)


def load_tiny():
    """The tiny Llama trained by ``python -m fleetlab train-tiny``: ``(model, tokenizer)``."""
    from fleetlab.models.pretrained import load_tiny as _load

    return _load()


def load_tiny_draft():
    """The 2-layer draft trained by ``python -m fleetlab train-tiny --draft`` on the same corpus
    and tokenizer as ``load_tiny()``: ``(model, tokenizer)``, for ``speculative_config``'s ``model``."""
    from fleetlab.models import pretrained

    return pretrained.load_tiny(pretrained.DRAFT_WEIGHTS_DIR)


def load_code(draft: bool = False):
    """The code model (``draft=True``: its 2-layer draft) and its BPE tokenizer: ``(model, tokenizer)``
    (see :mod:`fleetlab.models.checkpoints`)."""
    from fleetlab.models.checkpoints import load_code as _load

    return _load(draft=draft)


def load_code_tokenizer():
    """The code model's byte-level BPE tokenizer (PaddleFormers' fast tokenizer)."""
    from fleetlab.models.checkpoints import load_code_tokenizer as _load

    return _load()


def load(name_or_path):
    """``(model, tokenizer)`` for ``"tiny"``, ``"tiny-draft"``, ``"code"``, ``"code-draft"``, a
    checkpoint directory or a model id, through PaddleFormers' ``from_pretrained``."""
    from fleetlab.models.checkpoints import load as _load

    return _load(name_or_path)


def load_pretrained(path):
    """Load a PaddleFormers causal-LM checkpoint directory from disk (eval mode)."""
    from fleetlab.models.pretrained import load_pretrained as _load

    return _load(path)


def __getattr__(name):
    if name == "fleet_from_llama":
        from fleetlab.models.convert import fleet_from_llama

        return fleet_from_llama
    if name in ("FleetConfig", "FleetForCausalLM"):
        from fleetlab.models import fleet

        return getattr(fleet, name)
    raise AttributeError(f"module 'fleetlab.models' has no attribute {name!r}")
