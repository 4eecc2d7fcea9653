"""The request edge: every check of what users send, once, before anything is queued.

- :mod:`~fleetlab.edge.input_processor`: ``InputProcessor`` (tokenize, ids, the ``Request``),
  ``generate``'s arguments, ``prompt_embeds``;
- :mod:`~fleetlab.edge.sampling`: ``SamplingParams`` checked and bounded.

Above the engine core and its features, below the front door (``fleetlab.llm``) and the server:
no module of the engine, the KV cache, attention or the features imports it. The checks of one
scalar field are :mod:`fleetlab.fields` (anyone may use them); config checks live beside the
config dataclasses, and checks of what an extension returns beside its extension point.
"""
