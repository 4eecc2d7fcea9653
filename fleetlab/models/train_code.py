"""Train the code model on a CPU: ``python -m fleetlab train-code [--draft] [--steps N] ...``.

One command does all of it, deterministically (same seed, same thread count, same Python
standard library -> the same files):

1. reads the corpus (:mod:`fleetlab.models.code_corpus`) and writes its manifest,
2. trains the byte-level BPE tokenizer (:mod:`fleetlab.models.bpe`) on the training split,
3. encodes the corpus (:func:`fleetlab.models.code_recipe.token_stream`),
4. trains the PaddleFormers ``LlamaForCausalLM`` of :data:`~fleetlab.models.code_recipe.TARGET`
   (or ``--draft``: :data:`~fleetlab.models.code_recipe.DRAFT`) on random ``seq_len``-token
   windows of the stream, AdamW with warm-up and cosine decay,
5. measures held-out loss and next-token accuracy and writes the checkpoint
   (:mod:`fleetlab.models.code_checkpoint`) with ``training.json``.

``--tokenizer-only`` stops after step 2. The shipped weights came from the same architecture
trained longer on a GPU (``tools/train_code_torch.py``): ``--export DIR`` writes that
script's inputs (the token streams and the recipe) and ``--import-gpu DIR`` turns its output
into the checkpoint, after checking that Paddle reproduces PyTorch's logits.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from fleetlab.models import bpe, code_corpus, code_recipe

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CodeTrainConfig:
    """Everything that decides the trained weights (plus where to write them)."""

    out_dir: str = str(code_recipe.CODE_DIR)
    draft: bool = False
    steps: int = 1200
    seed: int = 0
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 2e-3
    warmup_steps: int = 60
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    num_threads: int = 1
    eval_windows: int = 64
    max_files: int | None = None  # a corpus prefix (smoke runs); None: every file

    @property
    def dims(self) -> dict:
        return code_recipe.DRAFT if self.draft else code_recipe.TARGET


def prepare(cfg: CodeTrainConfig):
    """``(tokenizer, manifest, train, validation, held_out)``: steps 1-3 of the module docstring."""
    manifest = code_corpus.manifest()
    texts = [f.text for f in code_corpus.iter_files("train")][: cfg.max_files]
    tokenizer = bpe.train_bpe(texts)
    stream = np.concatenate([np.asarray(e.ids + [bpe.EOS_ID], np.uint16) for e in tokenizer.encode_batch(texts)])
    train, validation = code_recipe.validation_cut(stream)
    held_out = code_recipe.token_stream(tokenizer, "held_out")
    return tokenizer, manifest, train, validation, held_out


def build_model(cfg: CodeTrainConfig):
    """A freshly initialised ``LlamaForCausalLM`` of ``cfg.dims``, from ``cfg.seed``."""
    import paddle
    from paddleformers.transformers import LlamaForCausalLM

    paddle.seed(cfg.seed)
    return LlamaForCausalLM(code_recipe.llama_config(cfg.dims))


def lr_factor(step: int, steps: int, warmup: int) -> float:
    """Linear warm-up to 1, then cosine decay to 0.1 (shared with the GPU recipe)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def batch_starts(rng: np.random.Generator, stream_len: int, batch_size: int, seq_len: int) -> np.ndarray:
    """Random window starts; a window is ``seq_len + 1`` tokens (inputs and shifted labels)."""
    if stream_len <= seq_len + 1:
        raise ValueError(f"train-code: a stream of {stream_len} tokens is too short for seq_len={seq_len}")
    return rng.integers(0, stream_len - seq_len - 1, size=batch_size)


def train_steps(cfg: CodeTrainConfig, model, train: np.ndarray) -> list[float]:
    """Run ``cfg.steps`` optimiser steps on ``model``; return every step's training loss."""
    import paddle
    import paddle.nn.functional as F

    _set_threads(cfg.num_threads)
    schedule = paddle.optimizer.lr.LambdaDecay(cfg.lr, lambda s: lr_factor(s, cfg.steps, cfg.warmup_steps))
    optimizer = paddle.optimizer.AdamW(learning_rate=schedule, parameters=model.parameters(),
                                       weight_decay=cfg.weight_decay,
                                       grad_clip=paddle.nn.ClipGradByGlobalNorm(cfg.grad_clip))  # fmt: skip
    rng = np.random.default_rng(cfg.seed)
    losses: list[float] = []
    model.train()
    for step in range(cfg.steps):
        starts = batch_starts(rng, len(train), cfg.batch_size, cfg.seq_len)
        windows = np.stack([train[s : s + cfg.seq_len + 1] for s in starts]).astype(np.int64)
        logits = model(input_ids=paddle.to_tensor(windows[:, :-1]), return_dict=True).logits
        loss = F.cross_entropy(logits.reshape([-1, logits.shape[-1]]), paddle.to_tensor(windows[:, 1:].reshape(-1)))
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        schedule.step()
        losses.append(float(loss))
        if (step + 1) % 50 == 0 or step + 1 == cfg.steps:
            logger.info("step %d: loss %.4f, lr %.2e", step + 1, np.mean(losses[-50:]), schedule.get_lr())
    model.eval()
    return losses


def _set_threads(num_threads: int) -> None:
    import paddle

    # CPU kernels reduce in a thread-count-dependent order; fixing it keeps runs identical.
    set_num_threads = getattr(paddle.base.core, "set_num_threads", None)
    if set_num_threads is not None:
        set_num_threads(num_threads)


def save_checkpoint(out_dir, model_tensors, config, tokenizer, manifest, record: dict) -> None:
    """Weights, config, tokenizer files, ``corpus.json`` and ``training.json`` into ``out_dir``."""
    from fleetlab.models.code_checkpoint import write_weights

    write_weights(model_tensors, config, out_dir)
    save_tokenizer_files(out_dir, tokenizer, manifest)
    Path(out_dir, "training.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def save_tokenizer_files(out_dir, tokenizer, manifest) -> None:
    bpe.save_tokenizer(tokenizer, out_dir)
    code_corpus.write_manifest(Path(out_dir) / "corpus.json", manifest)


def train(cfg: CodeTrainConfig) -> dict:
    """Steps 1-5 of the module docstring; returns the record written to ``training.json``."""
    from fleetlab.models.code_checkpoint import evaluate, paddle_state_to_hf

    started, cpu_started = time.perf_counter(), time.process_time()
    tokenizer, manifest, train_stream, validation, held_out = prepare(cfg)
    model = build_model(cfg)
    params = sum(int(np.prod(p.shape)) for p in model.parameters())
    logger.info("code model: %d parameters; %d training tokens", params, len(train_stream))
    losses = train_steps(cfg, model, train_stream)
    held = evaluate(model, held_out, cfg.seq_len, cfg.eval_windows)
    record = {
        "trained_on": "cpu (python -m fleetlab train-code)",
        "config": {k: v for k, v in asdict(cfg).items() if k != "out_dir"},
        "dims": cfg.dims,
        "parameters": params,
        "train_tokens": int(len(train_stream)),
        "losses_every_50": [float(np.mean(losses[i : i + 50])) for i in range(0, len(losses), 50)],
        "final_loss": float(np.mean(losses[-50:])),
        "held_out": asdict(held),
        "wall_s": time.perf_counter() - started,
        "cpu_s": time.process_time() - cpu_started,
    }
    save_checkpoint(cfg.out_dir, paddle_state_to_hf(model), model.config, tokenizer, manifest, record)
    return record


def evaluate_checkpoint(out_dir: str, seq_len: int) -> dict:
    """``--evaluate``: held-out loss and accuracy over every ``seq_len`` window of the held-out
    modules, and greedy samples; stored under ``"evaluation"`` in ``out_dir/training.json``."""
    from fleetlab.models.code_checkpoint import evaluate
    from fleetlab.models.code_import import samples
    from fleetlab.models.pretrained import read_llama

    # Not from_pretrained: it would write a metadata file into the (package's) directory.
    model, tokenizer = read_llama(Path(out_dir)), bpe.load_fast_tokenizer(out_dir)
    ids = [tokenizer.encode(text) + [bpe.EOS_ID] for text in code_corpus.documents("held_out")]
    held = evaluate(model, np.concatenate([np.asarray(i, np.int64) for i in ids]), seq_len)
    result = {"held_out": {**asdict(held), "perplexity": held.perplexity, "seq_len": seq_len,
                           "measured": "Paddle, CPU, every window"}, "samples": samples(model, tokenizer)}  # fmt: skip
    path = Path(out_dir, "training.json")
    record = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    record["evaluation"] = result
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return result


def export_inputs(directory: str) -> None:
    """``--export DIR``: the GPU recipe's inputs (token streams as ``.npy``, ``recipe.json``)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    cfg = CodeTrainConfig()
    tokenizer, manifest, train_stream, validation, held_out = prepare(cfg)
    for name, array in (("train", train_stream), ("validation", validation), ("held_out", held_out)):
        np.save(out / f"{name}.npy", array)
    recipe = {"target": code_recipe.TARGET, "draft": code_recipe.DRAFT}
    (out / "recipe.json").write_text(json.dumps(recipe, indent=2) + "\n", encoding="utf-8")
    logger.info("exported %d training tokens to %s", len(train_stream), out)


def parse_args(argv: Sequence[str] | None = None) -> tuple[CodeTrainConfig, argparse.Namespace]:
    defaults = CodeTrainConfig()
    parser = argparse.ArgumentParser(prog="fleetlab train-code", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="output directory (default: the package's code model)")
    parser.add_argument("--draft", action="store_true", help="the 2-layer draft (default out: code/draft)")
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len)
    parser.add_argument("--threads", type=int, default=defaults.num_threads, help="CPU threads (fixed for determinism)")
    parser.add_argument("--max-files", type=int, default=None, help="train on the first N files only (smoke runs)")
    parser.add_argument("--eval-windows", type=int, default=defaults.eval_windows)
    parser.add_argument("--tokenizer-only", action="store_true", help="write the tokenizer and manifest only")
    parser.add_argument("--export", metavar="DIR", help="write the GPU recipe's inputs to DIR and stop")
    parser.add_argument("--import-gpu", metavar="DIR", help="make the checkpoint from the GPU recipe's output DIR")
    parser.add_argument("--evaluate", action="store_true",
                        help="measure the checkpoint in --out on every held-out window, add samples; record both")
    args = parser.parse_args(argv)
    out = args.out or str(code_recipe.DRAFT_DIR if args.draft else code_recipe.CODE_DIR)
    cfg = CodeTrainConfig(out_dir=out, draft=args.draft, steps=args.steps, seed=args.seed, batch_size=args.batch_size,
                          seq_len=args.seq_len, num_threads=args.threads, max_files=args.max_files,
                          eval_windows=args.eval_windows)  # fmt: skip
    return cfg, args


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: see the module docstring and ``python -m fleetlab train-code --help``."""
    cfg, args = parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger(__name__).setLevel(logging.INFO)
    if args.export:
        export_inputs(args.export)
        return 0
    if args.import_gpu:
        from fleetlab.models.code_import import import_gpu

        print(json.dumps(import_gpu(args.import_gpu, cfg.out_dir, draft=cfg.draft), indent=2))
        return 0
    if args.evaluate:
        print(json.dumps(evaluate_checkpoint(cfg.out_dir, cfg.seq_len), indent=2))
        return 0
    if args.tokenizer_only:
        tokenizer, manifest = bpe.train_bpe(code_corpus.documents("train")), code_corpus.manifest()
        save_tokenizer_files(cfg.out_dir, tokenizer, manifest)
        print(f"wrote the tokenizer and corpus manifest to {cfg.out_dir}")
        return 0
    record = train(cfg)
    print(f"wrote {cfg.out_dir}: {record['parameters']} parameters, final training loss {record['final_loss']:.4f}, "
          f"held-out loss {record['held_out']['loss']:.4f}, next-token accuracy {record['held_out']['accuracy']:.3f}, "
          f"{record['wall_s']:.0f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
