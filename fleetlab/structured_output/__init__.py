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
- ``request.py``: :class:`~fleetlab.structured_output.request.StructuredOutputRequest`, one
  request's grammar state (its compile's future, its matcher), the object its batch row holds.
- ``processor.py``: :class:`~fleetlab.structured_output.processor.StructuredOutputsProcessor`,
  the engine's side: a logits processor every ``LLM`` has.
- ``examples.py``: bounded example schemas (tests, benchmark, notebooks).

**How the engine uses it**, in the order of a request's life:

1. *Arrival* (``fleetlab.edge``): ``SamplingParams(structured_outputs=...)`` is checked
   (a ``ValueError`` naming the request and the field; ``ignore_eos`` refused beside it), the
   backend validates it, and its compile starts on the manager's thread
   (``StructuredOutputsProcessor.start``). ``LLM.generate`` and the server wait for the compile
   before queueing anything, so a vocabulary that cannot spell the constraint is refused at once.
2. *Scheduling*: the request waits on its compile (``Request.waiting_on``); the scheduler admits
   the requests behind it meanwhile. A step never compiles.
3. *The batch*: its ``StructuredOutputRequest`` sits in the ``structured_output`` object field,
   so condense, decode-first reorder, swaps and preemption (the request is resent in full, with
   the same object) move it with its row.
4. *Sampling*: the processor brings each scored row's matcher to the row's committed output,
   fills one mask per scored position (a verify row of ``k`` drafts takes ``k + 1``), writes
   them into the row's ``grammar_bitmask`` field, uploads the step's masks once and applies them
   before temperature, top-k and top-p. A row left with no allowed token stops with an error.
5. *Speculative decoding*: a draft the grammar refuses is refused by its own position's mask,
   so verification rejects it; the drafts the grammar allows enter the matcher only while their
   masks are filled (and are rolled back at once), and the matcher is advanced only by the
   tokens the scheduler committed.

vLLM keeps the same state in ``vllm/v1/structured_output`` (a manager compiling on a thread
pool, one ``StructuredOutputRequest`` per request, the scheduler building each step's bitmask,
the runner applying it); FastDeploy builds its structured outputs on xgrammar.
"""

from fleetlab.lazy import lazy_getattr

# Names load lazily, so that importing the plain StructuredOutputsParams dataclass loads no Paddle.
_LAZY = {name: "fleetlab.structured_output.backend" for name in (
    "CompiledGrammar", "GrammarBackend", "GrammarError", "GrammarMatcher", "get_grammar_backend",
    "list_grammar_backends", "make_grammar_backend", "register_grammar_backend")}
_LAZY.update(apply_token_bitmask="fleetlab.structured_output.bitmask", dead_rows="fleetlab.structured_output.bitmask",
             StructuredOutputManager="fleetlab.structured_output.manager",
             StructuredOutputsParams="fleetlab.engine.structured_outputs_params",
             StructuredOutputRequest="fleetlab.structured_output.request")


__getattr__ = lazy_getattr(__name__, _LAZY)


__all__ = ["CompiledGrammar", "GrammarBackend", "GrammarError", "GrammarMatcher", "StructuredOutputManager",
           "StructuredOutputRequest", "StructuredOutputsParams", "apply_token_bitmask", "dead_rows",
           "get_grammar_backend", "list_grammar_backends", "make_grammar_backend", "register_grammar_backend"]
