"""Logits processors beside the core: each plugs into the sampler through the logits-processor
registry (``fleetlab.engine.logits_processor``) and owns the InputBatch fields it reads."""
