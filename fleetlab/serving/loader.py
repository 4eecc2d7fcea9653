"""What ``serve --model ... --model-impl ...`` loads: a model and its tokenizer.

``--model``:
  ``tiny``  the trained tiny Llama shipped in ``fleetlab/models/weights`` (character tokenizer);
  ``code``  the code model shipped in ``fleetlab/models/code`` (byte-level BPE tokenizer);
  ``tiny-json``  a tiny random Llama whose characters can spell JSON
            (:func:`fleetlab.models.tiny_json`): it writes noise unless a request constrains it
            (``response_format``, ``structured_outputs``);
  PATH      a checkpoint directory: PaddleFormers' ``AutoModelForCausalLM`` reads it, and its
            tokenizer is fleetlab's ``CharTokenizer`` when ``tokenizer.json`` says so, else
            PaddleFormers' ``AutoTokenizer`` (nothing is downloaded: both read the directory);
  ID        a model id (``baidu/ERNIE-4.5-0.3B-PT``): PaddleFormers' ``from_pretrained``
            downloads it, on a machine with a network (:func:`fleetlab.models.load`).
``--model-impl``:
  ``auto`` / ``paddleformers``  the PaddleFormers model, its attention patched through
            PaddleFormers' attention interface;
  ``fleet`` / ``paddlefleet``  the same weights moved into fleetlab's Fleet-style model
            (:func:`fleetlab.models.convert.fleet_from_llama`, Llama checkpoints only), whose
            ``core_attention`` layers are swapped for paged attention: the path of a
            Fleet/Megatron model in a production engine (``paddlefleet`` is that engine's
            spelling of the same choice).
"""

from __future__ import annotations

from pathlib import Path

MODEL_IMPLS = ("auto", "paddleformers", "fleet", "paddlefleet")


def load_model(model: str, model_impl: str = "auto"):
    """``(model, tokenizer)`` for ``--model`` / ``--model-impl`` (see the module docstring).

    Raises ``ValueError`` for an unknown impl or a model the impl cannot hold, and
    ``FileNotFoundError`` for a path that is not a checkpoint directory.
    """
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"--model-impl {model_impl!r}: choose from {list(MODEL_IMPLS)}")
    if model == "tiny-json":
        from fleetlab.models import tiny_json

        net, tokenizer = tiny_json()
    else:
        from fleetlab.models import load

        net, tokenizer = load(model)
    if model_impl in ("fleet", "paddlefleet"):
        from fleetlab.models.convert import fleet_from_llama

        net = fleet_from_llama(net)
    return net, tokenizer


def load_draft(model: str):
    """The draft model a speculative config names: ``"tiny"`` / ``"code"`` are the shipped
    drafts of those models (``fleetlab.models.load_tiny_draft``, ``load_code(draft=True)``),
    anything else a checkpoint directory."""
    if model in ("tiny", "code"):
        from fleetlab.models import load

        return load(f"{model}-draft")[0]
    return _checkpoint("speculative_config model", model)


def _checkpoint(what: str, model: str):
    """The PaddleFormers model in checkpoint directory ``model``; ``FileNotFoundError`` naming
    ``what`` when it is not one."""
    path = Path(model)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{what} {model!r}: not 'tiny', 'code' or a checkpoint directory with config.json")
    from fleetlab.models import load_pretrained

    return load_pretrained(path)
