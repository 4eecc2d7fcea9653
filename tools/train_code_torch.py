"""GPU recipe of the shipped code model: PaddleFormers' Llama, re-written in PyTorch, trained on a GPU.

The architecture is exactly ``paddleformers.transformers.LlamaForCausalLM`` for the dims in
``recipe.json`` (``fleetlab/models/code_recipe.py``): RMSNorm computed in float32, rotary
embeddings with the rotate-half layout, grouped-query attention (each KV head serving
consecutive query heads), a SwiGLU MLP, the output projection tied to the input embedding.
Parameter names are Hugging Face's, so the weights need no renaming (only Paddle's
``[in, out]`` transposition, which ``from_pretrained`` does on load).

Inputs (``python -m fleetlab train-code --export DIR``): ``train.npy``, ``validation.npy``,
``held_out.npy`` (uint16 token streams), ``recipe.json``. Outputs in ``--out``:
``{which}_weights.npz`` (float32, the checkpoint with the lowest validation loss),
``{which}_reference.npz`` (held-out windows and this model's float32 logits on them: the
export check), ``{which}_log.json`` (the run's settings, losses, timings, device).
``python -m fleetlab train-code --import-gpu OUT [--draft]`` makes the PaddleFormers checkpoint.

Training: random windows of the training stream, AdamW (betas 0.9/0.95, decay on matrices),
linear warm-up then cosine decay to 10% (``fleetlab.models.train_code.lr_factor``), bfloat16
autocast on a GPU. ``--steps 0`` sizes the run to ``--time-budget`` seconds from the speed of
steps 11 to 30 (the chosen count is logged, so a re-run can name it).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class Attention(nn.Module):
    def __init__(self, d: dict):
        super().__init__()
        h, kv, hd = d["num_attention_heads"], d["num_key_value_heads"], d["head_dim"]
        self.h, self.kv, self.hd = h, kv, hd
        self.q_proj = nn.Linear(d["hidden_size"], h * hd, bias=False)
        self.k_proj = nn.Linear(d["hidden_size"], kv * hd, bias=False)
        self.v_proj = nn.Linear(d["hidden_size"], kv * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d["hidden_size"], bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.h, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = self.h // self.kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.hd**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.h * self.hd))


class MLP(nn.Module):
    def __init__(self, d: dict):
        super().__init__()
        self.gate_proj = nn.Linear(d["hidden_size"], d["intermediate_size"], bias=False)
        self.up_proj = nn.Linear(d["hidden_size"], d["intermediate_size"], bias=False)
        self.down_proj = nn.Linear(d["intermediate_size"], d["hidden_size"], bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, d: dict):
        super().__init__()
        self.self_attn = Attention(d)
        self.mlp = MLP(d)
        self.input_layernorm = RMSNorm(d["hidden_size"], d["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(d["hidden_size"], d["rms_norm_eps"])

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Inner(nn.Module):
    def __init__(self, d: dict):
        super().__init__()
        self.embed_tokens = nn.Embedding(d["vocab_size"], d["hidden_size"])
        self.layers = nn.ModuleList(Layer(d) for _ in range(d["num_hidden_layers"]))
        self.norm = RMSNorm(d["hidden_size"], d["rms_norm_eps"])


class Llama(nn.Module):
    """``LlamaForCausalLM`` with tied embeddings; ``state_dict`` keys are Hugging Face's."""

    def __init__(self, d: dict):
        super().__init__()
        assert d["tie_word_embeddings"], "this recipe ties the output projection to the embedding"
        self.model = Inner(d)
        hd = d["head_dim"]
        inv_freq = 1.0 / (d["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device).float()
        emb = torch.cat([torch.outer(pos, self.inv_freq)] * 2, dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos.to(x.dtype), sin.to(x.dtype))
        x = self.model.norm(x)
        return x @ self.model.embed_tokens.weight.to(x.dtype).T


def lr_factor(step: int, steps: int, warmup: int) -> float:
    # The same schedule as fleetlab.models.train_code.lr_factor (this script runs without fleetlab).
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def windows(stream: np.ndarray, starts: np.ndarray, seq: int, device) -> torch.Tensor:
    return torch.from_numpy(np.stack([stream[s : s + seq + 1] for s in starts]).astype(np.int64)).to(device)


@torch.no_grad()
def evaluate(model, stream, seq, device, max_windows=64, autocast=True):
    count = (len(stream) - 1) // seq
    starts = np.arange(count) * seq
    if count > max_windows:
        starts = starts[np.linspace(0, count - 1, max_windows).astype(int)]
    loss, correct, n = 0.0, 0, 0
    for i in range(0, len(starts), 8):
        batch = windows(stream, starts[i : i + 8], seq, device)
        with torch.autocast(device.type, torch.bfloat16, enabled=autocast and device.type == "cuda"):
            logits = model(batch[:, :-1]).float()
        loss += float(F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum"))
        correct += int((logits.argmax(-1) == batch[:, 1:]).sum())
        n += batch[:, 1:].numel()
    return {"loss": loss / n, "accuracy": correct / n, "tokens": n}


def train(args, dims, data, device):
    torch.manual_seed(args.seed)
    model = Llama(dims).to(device)
    decay = [p for p in model.parameters() if p.ndim == 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")  # fmt: skip
    rng = np.random.default_rng(args.seed)
    train_stream = data["train"]
    steps, log, best, started = args.steps, [], None, time.perf_counter()
    step = 0
    while steps == 0 or step < steps:
        for group in opt.param_groups:
            group["lr"] = args.lr * lr_factor(step, steps or 10**9, args.warmup)
        batch = windows(train_stream, rng.integers(0, len(train_stream) - args.seq - 1, args.batch), args.seq, device)
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if steps == 0 and step in (10, 30):  # size the run to the time budget from steps 11-30
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step == 10:
                warm = time.perf_counter()
            else:
                per_step = (time.perf_counter() - warm) / 20
                steps = max(40, int((args.time_budget - (warm - started)) / per_step / 1.08))  # 8%: evaluations
                print(f"{args.which}: {per_step * 1e3:.1f} ms/step -> {steps} steps", flush=True)
        if step % args.eval_every == 0 or step == steps:
            model.eval()
            val = evaluate(model, data["validation"], args.seq, device, max_windows=32)
            model.train()
            log.append({"step": step, "train_loss": float(loss.detach()), "validation": val,
                        "lr": opt.param_groups[0]["lr"], "elapsed_s": time.perf_counter() - started})  # fmt: skip
            print(f"{args.which}: {log[-1]}", flush=True)
            if best is None or val["loss"] < best[1]:
                best = (step, val["loss"], {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()})
    model.load_state_dict(best[2])
    model.eval()
    return model, steps, best[0], log, time.perf_counter() - started


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--which", choices=["target", "draft"], default="target")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=0, help="0: as many as --time-budget allows")
    parser.add_argument("--time-budget", type=float, default=200.0)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--wd", type=float, default=0.1)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    data_dir, out = Path(args.data), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dims = json.loads((data_dir / "recipe.json").read_text())[args.which]
    data = {k: np.load(data_dir / f"{k}.npy") for k in ("train", "validation", "held_out")}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    model, steps, best_step, log, wall = train(args, dims, data, device)
    held = evaluate(model, data["held_out"], args.seq, device, max_windows=10**6, autocast=False)
    state = {k: v.float().cpu().numpy() for k, v in model.state_dict().items()}
    np.savez(out / f"{args.which}_weights.npz", **state)
    starts = np.array([0, 5000, 20000, 40000]) % max(1, len(data["held_out"]) - 65)
    ref_ids = np.stack([data["held_out"][s : s + 64] for s in starts]).astype(np.int64)
    with torch.no_grad():
        ref_logits = model(torch.from_numpy(ref_ids).to(device)).float().cpu().numpy()
    np.savez(out / f"{args.which}_reference.npz", input_ids=ref_ids, logits=ref_logits)
    record = {"which": args.which, "dims": dims, "settings": vars(args), "steps": steps, "best_step": best_step,
              "wall_s": wall, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "parameters": sum(v.size for v in state.values()),
              "train_tokens": int(len(data["train"])), "held_out_float32": held, "log": log}  # fmt: skip
    (out / f"{args.which}_log.json").write_text(json.dumps(record, indent=1))
    print(f"{args.which}: done, {steps} steps, best {best_step}, held-out {held}", flush=True)


if __name__ == "__main__":
    main()
