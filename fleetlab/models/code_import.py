"""Turn the GPU recipe's output (``tools/train_code_torch.py``) into the shipped checkpoint.

``python -m fleetlab train-code --import-gpu DIR [--draft]``:

1. writes ``model.safetensors`` and ``config.json`` from ``DIR/{which}_weights.npz`` (the
   PyTorch state dict already has Hugging Face's names and layouts) and the tokenizer files
   (the tokenizer is retrained: :func:`fleetlab.models.bpe.train_bpe` is deterministic);
2. loads the directory with PaddleFormers' ``from_pretrained`` and checks that Paddle's
   float32 logits on the held-out windows of ``{which}_reference.npz`` match PyTorch's (the
   proof that the export is right): :data:`PARITY_TOLERANCE` on the largest absolute
   difference, and the same argmax at every position;
3. measures held-out loss and next-token accuracy in Paddle, greedy samples from held-out
   prompts, and writes ``training.json`` with the GPU run's log.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fleetlab.models import bpe, code_corpus, code_recipe

PARITY_TOLERANCE = 2e-3
SAMPLE_PROMPTS = (
    "def dedent(text):\n    ",
    "class Fraction(numbers.Rational):\n    def __add__(self, other):\n        ",
    "import os\nimport sys\n\n\ndef main(argv):\n    ",
    "    def __repr__(self):\n        return ",
)
"""Prompts for the samples in ``training.json`` (the first two open held-out modules' code)."""


def import_gpu(directory: str, out_dir: str, draft: bool = False) -> dict:
    """Steps 1-3 of the module docstring; returns the record written to ``training.json``."""
    from fleetlab.models.checkpoints import from_pretrained
    from fleetlab.models.code_checkpoint import evaluate, write_weights

    which = "draft" if draft else "target"
    src = Path(directory)
    log = json.loads((src / f"{which}_log.json").read_text(encoding="utf-8"))
    dims = code_recipe.DRAFT if draft else code_recipe.TARGET
    if log["dims"] != dims:
        raise ValueError(f"import-gpu: {src / f'{which}_log.json'} trained dims {log['dims']}, not the recipe's {dims}")
    with np.load(src / f"{which}_weights.npz") as weights:
        tensors = {k: np.ascontiguousarray(weights[k], dtype=np.float32) for k in weights.files}
    write_weights(tensors, code_recipe.llama_config(dims), out_dir)
    tokenizer = bpe.train_bpe(code_corpus.documents("train"))
    bpe.save_tokenizer(tokenizer, out_dir)
    code_corpus.write_manifest(Path(out_dir) / "corpus.json", code_corpus.manifest())
    model, fast = from_pretrained(out_dir)
    parity = check_parity(model, src / f"{which}_reference.npz")
    held = evaluate(model, code_recipe.token_stream(tokenizer, "held_out"), seq_len=1024)
    record = {
        "trained_on": f"GPU ({log['device']}, torch {log['torch']}): tools/train_code_torch.py --which {which}, "
                      f"then python -m fleetlab train-code --import-gpu{' --draft' if draft else ''}",
        "dims": dims,
        "parameters": log["parameters"],
        "train_tokens": log["train_tokens"],
        "steps": log["steps"],
        "best_step_by_validation_loss": log["best_step"],
        "gpu_wall_s": log["wall_s"],
        "settings": log["settings"],
        "held_out": {"loss": held.loss, "perplexity": held.perplexity, "accuracy": held.accuracy,
                     "tokens": held.tokens, "seq_len": 1024, "measured": "Paddle, CPU"},  # fmt: skip
        "held_out_torch_gpu_float32": log["held_out_float32"],
        "export_parity": parity,
        "samples": samples(model, fast),
        "log": log["log"],
    }
    Path(out_dir, "training.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return {k: v for k, v in record.items() if k not in ("log", "settings", "dims")}


def check_parity(model, reference: Path) -> dict:
    """Paddle ``model``'s float32 logits against PyTorch's on the saved windows; raises
    ``RuntimeError`` past :data:`PARITY_TOLERANCE` or on any argmax that differs."""
    import paddle

    with np.load(reference) as ref:
        ids, want = ref["input_ids"], ref["logits"]
    with paddle.no_grad():
        got = model(input_ids=paddle.to_tensor(ids), return_dict=True).logits.numpy()
    diff = float(np.abs(got - want).max())
    same_argmax = float((got.argmax(-1) == want.argmax(-1)).mean())
    result = {"windows": int(ids.shape[0]), "tokens": int(ids.size), "max_abs_logit_diff": diff,
              "logit_scale": float(np.abs(want).max()), "argmax_agreement": same_argmax}  # fmt: skip
    if diff > PARITY_TOLERANCE or same_argmax < 1.0:
        raise RuntimeError(f"import-gpu: Paddle's logits differ from PyTorch's: {result}")
    return result


def samples(model, tokenizer, max_new_tokens: int = 40) -> list[dict]:
    """Greedy continuations (the unpatched model's full forward) of :data:`SAMPLE_PROMPTS`."""
    from fleetlab.models.pretrained import greedy_generate

    prompts = [tokenizer.encode(p) for p in SAMPLE_PROMPTS]
    outputs = greedy_generate(model, prompts, max_new_tokens, bpe.EOS_ID)
    return [{"prompt": p, "completion": tokenizer.decode(o, skip_special_tokens=True)}
            for p, o in zip(SAMPLE_PROMPTS, outputs)]  # fmt: skip
