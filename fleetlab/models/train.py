"""Train the tiny Llama that fleetlab ships: ``python -m fleetlab train-tiny``.

Deterministic CPU training of a PaddleFormers ``LlamaForCausalLM`` on the synthetic
corpus of :mod:`fleetlab.models.corpus`, with the character tokenizer of
:mod:`fleetlab.models.tokenizer`. Same seed, same thread count, same machine ->
same weights.

Batches have a fixed shape ``[batch_size, seq_len]``: each row packs whole samples
(``<bos> line <eos>``) back to back and pads the rest. Samples never see each other:
``position_ids`` restart at 0 for every sample and a block-diagonal causal mask
(PaddleFormers' ``attn_mask_startend_row_indices``) stops attention at the sample's
end, so training sees exactly what inference sees (one prompt from position 0).

Next-token loss on every real token except the operands of arithmetic lines: a line
with ``=`` is scored from ``=`` on (its answer and ``<eos>``). The operands are drawn
at random, so predicting them only adds noise; masking them made the held-out accuracy
climb about twice as fast (98% after 600 steps against 41%). Sentences and counting
keep the full loss. Padding carries no loss.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import paddle
import paddle.nn.functional as F
from paddleformers.transformers import LlamaConfig, LlamaForCausalLM
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from fleetlab.models.corpus import CorpusMix, held_out_pairs, iter_lines
from fleetlab.models.pretrained import DRAFT_WEIGHTS_DIR, WEIGHTS_DIR, addition_accuracy, save_tiny
from fleetlab.models.tokenizer import CharTokenizer

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100


@dataclass(slots=True)
class TrainConfig:
    """Everything that decides the trained weights (plus where to write them)."""

    out_dir: str = str(WEIGHTS_DIR)
    steps: int = 800
    seed: int = 0
    batch_size: int = 16
    seq_len: int = 64
    lr: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    num_threads: int = 1
    hidden_size: int = 128
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 128
    mix: CorpusMix = field(default_factory=CorpusMix)
    answer_loss_only: bool = True  # see pack_batches
    log_every: int = 100
    monitor_pairs: int = 100  # held-out pairs checked at each log line (0: none)


TINY_OVERRIDES = dict(
    steps=2, batch_size=2, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, log_every=1, monitor_pairs=4,
)  # fmt: skip
"""``--tiny``: a seconds-long smoke run that exercises every part of the script."""

DRAFT_OVERRIDES = dict(
    out_dir=str(DRAFT_WEIGHTS_DIR), intermediate_size=256, num_hidden_layers=2,
)  # fmt: skip
"""``--draft``: the speculative-decoding draft shipped beside the tiny Llama (2 layers, a
narrower MLP, the same tokenizer and corpus; about a third of the parameters)."""


@dataclass(slots=True)
class PackedBatch:
    """One fixed-shape training batch; every array is ``[batch_size, seq_len]``.

    ``row_ends[b, j]`` is the end (exclusive) of the sample that token ``j`` belongs
    to: PaddleFormers masks rows ``>= row_ends`` of key column ``j``, which with the
    causal mask gives block-diagonal attention. ``labels`` are the next token within
    the same sample, ``IGNORE_INDEX`` at each sample's last token and on padding.
    """

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    row_ends: np.ndarray


@dataclass(slots=True)
class TrainResult:
    """What a training run measured."""

    steps: int
    final_loss: float  # mean training loss over the last `log_every` steps
    held_out_accuracy: float
    num_held_out: int
    num_params: int
    model_bytes: int
    wall_s: float
    cpu_s: float  # process CPU time: what wall time would be on an otherwise idle core
    out_dir: str


def pack_batches(
    lines: Iterator[str], tokenizer: CharTokenizer, batch_size: int, seq_len: int, answer_loss_only: bool = False
) -> Iterator[PackedBatch]:
    """Pack samples ``<bos> line <eos>`` from ``lines`` into fixed-shape batches.

    With ``answer_loss_only``, lines holding ``=`` get loss only from ``=`` on (the
    answer and its ``<eos>``): their operands are random, so predicting them is noise.
    """
    equals_id = tokenizer.encode("=", add_bos=False)[0]
    pending: list[int] | None = None
    while True:
        arrays = [np.zeros((batch_size, seq_len), np.int64) for _ in range(4)]
        input_ids, labels, position_ids, row_ends = arrays
        labels[:] = IGNORE_INDEX
        input_ids[:] = tokenizer.pad_token_id
        for b in range(batch_size):
            start = 0
            while True:
                sample = pending if pending is not None else tokenizer.encode(next(lines), add_eos=True)
                if len(sample) > seq_len:
                    raise ValueError(f"pack_batches: a sample of {len(sample)} tokens exceeds seq_len={seq_len}")
                if start + len(sample) > seq_len:
                    pending = sample  # the next row starts with it
                    break
                pending = None
                end = start + len(sample)
                input_ids[b, start:end] = sample
                labels[b, start : end - 1] = sample[1:]
                if answer_loss_only and equals_id in sample:
                    labels[b, start : start + sample.index(equals_id)] = IGNORE_INDEX
                position_ids[b, start:end] = np.arange(len(sample))
                row_ends[b, start:end] = end
                start = end
            # Padding: one pseudo-sample that attends only to itself and carries no loss.
            position_ids[b, start:] = np.arange(seq_len - start)
            row_ends[b, start:] = seq_len
        yield PackedBatch(input_ids, labels, position_ids, row_ends)


def build_model(cfg: TrainConfig, tokenizer: CharTokenizer):
    """A freshly initialised float32 ``LlamaForCausalLM`` for ``cfg`` (seed it first)."""
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        fuse_rms_norm=False,  # the fused RMSNorm kernel is GPU-only
        use_cache=False,
        tie_word_embeddings=False,
        dtype="float32",
    )
    return LlamaForCausalLM(config)


def _lr_schedule(cfg: TrainConfig):
    def factor(step: int) -> float:
        # Linear warm-up, then cosine decay to 10% of the peak.
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))

    return paddle.optimizer.lr.LambdaDecay(learning_rate=cfg.lr, lr_lambda=factor)


def _loss(model, batch: PackedBatch):
    logits = model(
        input_ids=paddle.to_tensor(batch.input_ids),
        position_ids=paddle.to_tensor(batch.position_ids),
        attn_mask_startend_row_indices=paddle.to_tensor(batch.row_ends.astype(np.int32)[:, None, :, None]),
        return_dict=True,
    ).logits
    return F.cross_entropy(
        logits.reshape([-1, logits.shape[-1]]),
        paddle.to_tensor(batch.labels).reshape([-1]),
        ignore_index=IGNORE_INDEX,
    )


def _set_threads(num_threads: int) -> None:
    # CPU kernels reduce in a thread-count-dependent order; fixing it keeps runs identical.
    set_num_threads = getattr(paddle.base.core, "set_num_threads", None)
    if set_num_threads is None:
        logger.warning("this Paddle build cannot set its thread count; set OMP_NUM_THREADS=%d", num_threads)
    else:
        set_num_threads(num_threads)


def train(cfg: TrainConfig) -> TrainResult:
    """Train the tiny Llama for ``cfg.steps`` steps, evaluate it, and save it to ``cfg.out_dir``."""
    if cfg.steps < 1:
        raise ValueError(f"train: steps must be >= 1, got {cfg.steps}")
    started, cpu_started = time.perf_counter(), time.process_time()
    _set_threads(cfg.num_threads)
    paddle.seed(cfg.seed)
    tokenizer = CharTokenizer()
    model = build_model(cfg, tokenizer)
    model.train()
    num_params = sum(int(np.prod(p.shape)) for p in model.parameters())
    logger.info("tiny Llama: %d parameters, %d steps of %dx%d tokens", num_params, cfg.steps,
                cfg.batch_size, cfg.seq_len)  # fmt: skip
    schedule = _lr_schedule(cfg)
    optimizer = paddle.optimizer.AdamW(
        learning_rate=schedule,
        parameters=model.parameters(),
        weight_decay=cfg.weight_decay,
        grad_clip=paddle.nn.ClipGradByGlobalNorm(cfg.grad_clip),
    )
    batches = pack_batches(iter_lines(cfg.seed, cfg.mix), tokenizer, cfg.batch_size, cfg.seq_len, cfg.answer_loss_only)
    held_out = held_out_pairs()
    monitor = held_out[:: max(1, len(held_out) // cfg.monitor_pairs)][: cfg.monitor_pairs]
    recent = _run_steps(cfg, model, tokenizer, optimizer, schedule, batches, monitor)
    accuracy = addition_accuracy(model, tokenizer, held_out)
    paths = save_tiny(model, tokenizer, cfg.out_dir)
    result = TrainResult(
        steps=cfg.steps,
        final_loss=float(np.mean(recent)),
        held_out_accuracy=accuracy,
        num_held_out=len(held_out),
        num_params=num_params,
        model_bytes=paths["model"].stat().st_size,
        wall_s=time.perf_counter() - started,
        cpu_s=time.process_time() - cpu_started,
        out_dir=str(cfg.out_dir),
    )
    logger.info("done: %s", result)
    return result


def _run_steps(cfg, model, tokenizer, optimizer, schedule, batches, monitor) -> list[float]:
    """The optimisation loop, with a progress bar; returns the losses of the last ``log_every`` steps."""
    recent: list[float] = []
    with logging_redirect_tqdm(), tqdm(range(cfg.steps), desc="train-tiny", unit="step") as bar:
        for step in bar:
            loss = _loss(model, next(batches))
            loss.backward()
            optimizer.step()
            optimizer.clear_grad()
            schedule.step()
            recent = (recent + [float(loss)])[-cfg.log_every :]
            bar.set_postfix(loss=f"{recent[-1]:.3f}")
            if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
                _log_progress(model, tokenizer, step + 1, recent, schedule.get_lr(), monitor)
    return recent


def _log_progress(model, tokenizer, step, recent, lr, monitor) -> None:
    message = f"step {step}: loss {np.mean(recent):.4f} (mean of last {len(recent)}), lr {lr:.2e}"
    if monitor:
        message += f", held-out addition accuracy {addition_accuracy(model, tokenizer, monitor):.3f}"
        message += f" on {len(monitor)} pairs"
    logger.info(message)


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """The :class:`TrainConfig` described by command-line ``argv``."""
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(prog="fleetlab train-tiny", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=defaults.out_dir, help="output directory (default: the package's)")
    parser.add_argument("--steps", type=int, default=None, help=f"training steps (default {defaults.steps})")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--threads", type=int, default=defaults.num_threads, help="CPU threads (fixed for determinism)")
    parser.add_argument("--tiny", action="store_true", help="a seconds-long smoke run of a 1-layer model")
    parser.add_argument("--draft", action="store_true",
                        help=f"train the 2-layer speculative-decoding draft (default out: {DRAFT_WEIGHTS_DIR})")
    args = parser.parse_args(argv)
    overrides = {**(DRAFT_OVERRIDES if args.draft else {}), **(TINY_OVERRIDES if args.tiny else {})}
    cfg = TrainConfig(**overrides)
    if args.out != defaults.out_dir or not args.draft:
        cfg.out_dir = args.out
    cfg.seed, cfg.lr, cfg.num_threads = args.seed, args.lr, args.threads
    if args.steps is not None:
        cfg.steps = args.steps
    if args.batch_size is not None:
        cfg.batch_size = args.batch_size
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m fleetlab train-tiny [--draft] [--out DIR] [--steps N] [--seed S] [--tiny]``."""
    cfg = parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger(__name__).setLevel(logging.INFO)
    result = train(cfg)
    record = {"config": asdict(cfg), "result": asdict(result)}
    for part in record.values():
        part.pop("out_dir")  # a path on the training machine: meaningless once shipped
    with open(Path(cfg.out_dir) / "training.json", "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
    print(
        f"wrote {cfg.out_dir}: {result.num_params} parameters, {result.model_bytes / 1e6:.2f} MB, "
        f"final loss {result.final_loss:.4f}, held-out two-digit addition accuracy "
        f"{result.held_out_accuracy:.3f} on {result.num_held_out} pairs, {result.wall_s:.0f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
