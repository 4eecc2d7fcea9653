"""Greedy decoding two ways, for parity checks: the unpatched model's own full forward
(the oracle) and the patched model through the paged cache.

The oracle recomputes the whole sequence each step with the library cache off: it is
slow, but it is the model itself, with no cache logic of anyone's to trust.
"""

from __future__ import annotations

import numpy as np
import paddle

from fleetlab.attention.context import forward_context
from fleetlab.attention.metadata import AttentionMetadata
from fleetlab.kv.paged_cache import PagedKVCache
from fleetlab.patching.families import library_fixes
from fleetlab.patching.handle import has_core_attention


def full_forward_logits(model, token_ids) -> np.ndarray:
    """Logits ``[len(token_ids), vocab]`` of one sequence from the model's own forward."""
    ids = paddle.to_tensor([list(token_ids)], dtype="int64")
    if has_core_attention(model):
        with paddle.no_grad():
            return model(ids)[0].astype("float32").numpy()
    # library_fixes mends known library bugs for the duration (PaddleFormers 1.2's GPT-OSS
    # experts mix routing weights across tokens), so the oracle is the model as intended.
    with paddle.no_grad(), library_fixes(model):
        logits = model(input_ids=ids, use_cache=False, return_dict=True).logits
    return logits[0].astype("float32").numpy()


def reference_greedy(model, prompts, max_new_tokens: int):
    """Greedy tokens and per-step logits from the unpatched model's full forward.

    Returns ``(tokens, logits)``: ``tokens[i]`` the ``max_new_tokens`` new ids of prompt
    ``i``; ``logits[i]`` a ``[max_new_tokens, vocab]`` array, row ``s`` the logits that
    chose new token ``s``.
    """
    all_tokens, all_logits = [], []
    for prompt in prompts:
        seq, rows = list(prompt), []
        for _ in range(max_new_tokens):
            last = full_forward_logits(model, seq)[-1]
            rows.append(last)
            seq.append(int(last.argmax()))
        all_tokens.append(seq[len(prompt):])
        all_logits.append(np.stack(rows))
    return all_tokens, all_logits


def paged_greedy(handle, prompts, max_new_tokens: int, block_size: int = 4, seed: int = 0):
    """Greedy decoding of ``prompts`` through a patched model and a fresh paged cache.

    Step 0 prefills every prompt in one packed batch; each later step decodes one token
    per prompt. Physical block ids are shuffled (``seed``) so that a layout bug cannot
    hide behind blocks that happen to be contiguous. Same return shape as
    :func:`reference_greedy`.
    """
    lens = [len(p) + max_new_tokens for p in prompts]
    per_req = [-(-n // block_size) for n in lens]
    ids = np.random.default_rng(seed).permutation(sum(per_req) + 1)
    tables = np.full((len(prompts), max(per_req)), -1, dtype=np.int32)
    start = 0
    for i, n in enumerate(per_req):
        tables[i, :n] = ids[start:start + n]
        start += n
    kv_cache = PagedKVCache.for_handle(handle, num_blocks=len(ids), block_size=block_size)

    seqs = [list(p) for p in prompts]
    num_computed = np.zeros(len(prompts), dtype=np.int64)
    logits_per_req = [[] for _ in prompts]
    for _ in range(max_new_tokens):
        query_lens = np.array([len(s) for s in seqs]) - num_computed
        md = AttentionMetadata.build(query_lens, num_computed, tables, block_size)
        flat = [t for s, c in zip(seqs, num_computed) for t in s[c:]]
        input_ids = paddle.to_tensor([flat], dtype="int64")
        positions = md.positions.reshape([1, -1])
        last = paddle.to_tensor(md.cu_seqlens_q_host[1:] - 1, dtype="int64")
        with paddle.no_grad(), forward_context(md, kv_cache):
            logits = handle.compute_logits(input_ids, positions, last).astype("float32").numpy()
        num_computed += query_lens
        for i, row in enumerate(logits):
            logits_per_req[i].append(row)
            seqs[i].append(int(row.argmax()))
    tokens = [s[len(p):] for s, p in zip(seqs, prompts)]
    return tokens, [np.stack(rows) for rows in logits_per_req]
