"""Structured outputs: constrain a request's output to a JSON schema, a regex, a choice or a grammar.

At every step, a constrained request's **matcher** (its place in the grammar) says which tokens
may come next, as a row of a packed **token bitmask**; the sampler sets every other token's
logit to ``-inf`` before it picks. The grammar library does the hard part (llguidance, behind a
small interface; see ``backend.py``). The pieces, each in its own file:

- ``params.py``: :class:`StructuredOutputsParams`, vLLM's fields (``json``, ``regex``,
  ``choice``, ``grammar``, ``json_object``; exactly one set).
- ``backend.py``: the interface: :class:`GrammarBackend` (compile, per tokenizer),
  :class:`CompiledGrammar` (shared per constraint), :class:`GrammarMatcher` (per request:
  ``accept_tokens``, ``validate_tokens``, ``rollback``, ``fill_bitmask``, ``is_terminated``),
  and the registry of backends by name.
- ``guidance.py``: the llguidance backend (``"guidance"``), with adapters for fleetlab's
  ``CharTokenizer`` and for fast (Rust-backed) PaddleFormers / Hugging Face tokenizers.
- ``vocab_check.py``: a constraint the model's vocabulary cannot spell is refused when it
  compiles, naming the characters it lacks.
- ``manager.py``: :class:`~fleetlab.structured_output.manager.StructuredOutputManager`:
  validate on arrival, compile ahead on a thread pool, cache by constraint.
- ``bitmask.py``: ``apply_token_bitmask`` on the device, ``dead_rows`` on the host.
- ``examples.py``: bounded example schemas (tests, benchmark, notebooks).

**How the engine uses it** (the core's side is being written; these are the hooks):

1. *Arrival*: ``SamplingParams(structured_outputs=...)`` is checked by
   ``manager.validate(request_id, params)`` (a ``ValueError`` naming the request and the field:
   the server's 400), then ``manager.submit(...)`` starts the compile and returns at once.
2. *Scheduling*: a request whose grammar is not ready waits without holding up the others
   (``manager.is_ready``); one whose compile failed finishes with the error.
3. *The batch*: the request's matcher (``manager.matcher(request_id)``) is an object field of
   the InputBatch, so condense, decode-first reorder and swaps move it with its row.
4. *Before the forward*: the runner fills one bitmask row per scored position of each
   constrained row (``backend.fill_bitmasks``; a verify row of ``k`` drafts takes ``k + 1`` rows,
   ``matcher.fill_bitmask_with_drafts``), finishes rows that allow no token
   (``bitmask.dead_rows``) with an error, and uploads the step's masks once.
5. *Sampler*: ``apply_token_bitmask(logits, masks, rows)`` first, before penalties,
   temperature, top-k and top-p, for greedy, sampled and draft-verifying rows alike; rows
   without a constraint are not touched.
6. *After sampling*: each constrained request's matcher accepts the tokens it kept this step
   (``accept_tokens``; verified drafts and the bonus token). Drafts that verification rejected
   never entered the matcher; an engine that advances matchers through drafts first undoes
   the rejected ones with ``rollback(n)``.
7. *Preemption and resets*: a matcher kept with its request survives preemption (its tokens do);
   one lost with a reset runner is rebuilt by replaying the output tokens
   (``manager.matcher(request_id, replay=output_token_ids)``).
8. *The end*: a terminated matcher allows only EOS; ``manager.release(request_id)`` when done.

vLLM keeps the same state in ``vllm/v1/structured_output`` (a manager compiling on a thread
pool, one grammar object per request, the scheduler building each step's bitmask, the runner
applying it); FastDeploy builds its structured outputs on xgrammar.
"""

from fleetlab.structured_output.backend import (
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    get_grammar_backend,
    list_grammar_backends,
    make_grammar_backend,
    register_grammar_backend,
)
from fleetlab.structured_output.bitmask import apply_token_bitmask, dead_rows
from fleetlab.structured_output.manager import StructuredOutputManager
from fleetlab.structured_output.params import StructuredOutputsParams

__all__ = ["CompiledGrammar", "GrammarBackend", "GrammarError", "GrammarMatcher", "StructuredOutputManager",
           "StructuredOutputsParams", "apply_token_bitmask", "dead_rows", "get_grammar_backend",
           "list_grammar_backends", "make_grammar_backend", "register_grammar_backend"]
