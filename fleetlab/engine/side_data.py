"""Per-request side data: embeddings that replace some prompt tokens' own embeddings.

A vision-language request carries image features bound to prompt positions (the image's
placeholder tokens), ``(positions int64 [m], embeddings float32 [m, hidden])`` once checked
(``fleetlab.edge.input_processor.normalize_prompt_embeds``). The engine keeps them with the request
and in its InputBatch row (an object field, moved by every condense and reorder like any
other field), slices them to each prefill chunk, and, after a preemption, recomputes with
them again. Blocks from the first replaced position on are never shared through the prefix
cache: their K/V depend on more than the token ids the cache keys on.
"""

from __future__ import annotations


def chunk_embeds(prompt_embeds, row_start: int, num_computed: int, num_scheduled: int):
    """The replacements that fall in one prefill chunk: ``(packed token indices, vectors)``.

    ``row_start``: the row's first token in the packed step; the chunk covers positions
    ``[num_computed, num_computed + num_scheduled)``.
    """
    positions, values = prompt_embeds
    inside = (positions >= num_computed) & (positions < num_computed + num_scheduled)
    return row_start + positions[inside] - num_computed, values[inside]
