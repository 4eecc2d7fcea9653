"""Load real checkpoints: the shipped code model, and any PaddleFormers checkpoint by path or id.

Everything goes through PaddleFormers' own ``from_pretrained`` (``AutoModelForCausalLM`` for the
model, ``AutoTokenizer`` for the tokenizer), so a local directory written by ``save_pretrained``
and a model id on a machine with a network (for example ``baidu/ERNIE-4.5-0.3B-PT``, downloaded
on first use) load the same way. Names fleetlab ships need no download:

    ``"tiny"``        the arithmetic Llama (character tokenizer), :func:`fleetlab.models.load_tiny`
    ``"tiny-draft"``  its 2-layer draft
    ``"code"``        the code model trained on the Python standard library (byte-level BPE)
    ``"code-draft"``  its 2-layer draft, same tokenizer
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from fleetlab.models.code_recipe import CODE_DIR, DRAFT_DIR

SHIPPED = ("tiny", "tiny-draft", "code", "code-draft")


def load_code_tokenizer():
    """The code model's byte-level BPE tokenizer, through PaddleFormers' ``AutoTokenizer``
    (a fast tokenizer over ``fleetlab/models/code/tokenizer.json``)."""
    from fleetlab.models.bpe import load_fast_tokenizer

    return load_fast_tokenizer(CODE_DIR)


def load_code(draft: bool = False):
    """The shipped code model (or, ``draft=True``, its draft) and tokenizer: ``(model, tokenizer)``,
    the model a PaddleFormers ``LlamaForCausalLM`` in eval mode.

    The directory is a PaddleFormers checkpoint (``from_pretrained`` reads it, as :func:`load` does
    for a copy); the weights are read here without ``from_pretrained``, which would write a
    metadata file into the package.
    """
    from fleetlab.models.bpe import load_fast_tokenizer
    from fleetlab.models.pretrained import read_llama

    directory = DRAFT_DIR if draft else CODE_DIR
    if not (directory / "model.safetensors").is_file():
        raise FileNotFoundError(f"load_code: no model.safetensors in {directory}; "
                                f"run `python -m fleetlab train-code{' --draft' if draft else ''}`")  # fmt: skip
    return read_llama(directory), load_fast_tokenizer(directory)


def load(name_or_path: str | os.PathLike):
    """``(model, tokenizer)`` for a shipped name (:data:`SHIPPED`), a checkpoint directory, or a
    model id that PaddleFormers' ``from_pretrained`` downloads (see the module docstring)."""
    name = str(name_or_path)
    if name in ("tiny", "tiny-draft"):
        from fleetlab.models import pretrained

        return pretrained.load_tiny(pretrained.DRAFT_WEIGHTS_DIR if name == "tiny-draft" else None)
    if name in ("code", "code-draft"):
        return load_code(draft=name == "code-draft")
    path = Path(name).expanduser()
    looks_like_path = path.is_absolute() or name.startswith((".", "~")) or path.exists()
    if looks_like_path and not (path / "config.json").is_file():
        raise FileNotFoundError(f"load: {name!r} is not a checkpoint directory with config.json "
                                f"(nor one of {list(SHIPPED)})")  # fmt: skip
    return from_pretrained(path if looks_like_path else name)


def from_pretrained(name_or_path: str | os.PathLike):
    """PaddleFormers' ``AutoModelForCausalLM`` and tokenizer for ``name_or_path``, the model in
    eval mode. A directory holding fleetlab's character ``tokenizer.json`` gets a ``CharTokenizer``."""
    from paddleformers.transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(name_or_path))
    model.eval()
    if _is_char_tokenizer(Path(name_or_path)):
        from fleetlab.models.tokenizer import CharTokenizer

        return model, CharTokenizer.load(name_or_path)
    return model, AutoTokenizer.from_pretrained(str(name_or_path))


def _is_char_tokenizer(directory: Path) -> bool:
    file = directory / "tokenizer.json"
    if not file.is_file():
        return False
    try:
        return json.loads(file.read_text(encoding="utf-8")).get("type") == "char"
    except (ValueError, AttributeError):
        return False
