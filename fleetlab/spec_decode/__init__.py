"""Speculative decoding: proposers that draft tokens, verified by the target in one step.

- :mod:`fleetlab.spec_decode.config`: ``SpeculativeConfig`` (``LLM(speculative_config={...})``);
- :mod:`fleetlab.spec_decode.proposer`: the ``Proposer`` interface and its lazy registry;
- :mod:`fleetlab.spec_decode.ngram`: prompt lookup (no model);
- :mod:`fleetlab.spec_decode.draft`: a small draft model with its own paged KV cache and its own
  :class:`~fleetlab.spec_decode.proposer_batch.ProposerInputBatch` (fields it registers on the
  main ``InputBatch``, moved with its rows);
- :mod:`fleetlab.spec_decode.rejection`: the verification (``RejectionSampler``, a ``Sampler``):
  the longest agreeing prefix plus a bonus token, rejection sampling when sampling.

The bookkeeping (``num_computed_tokens`` rolled back past rejected drafts) is the scheduler's
``update`` (:mod:`fleetlab.engine.scheduler`).
"""
