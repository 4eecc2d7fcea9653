"""Overlap scheduling: the host plans and prepares step N+1 while the model runs step N.

``LLM(model, async_scheduling=True)`` (``serve --async-scheduling``) builds an
:class:`OverlapEngineCore` instead of the synchronous :class:`~fleetlab.engine.core.EngineCore`.
The pieces, each beside the core:

- :mod:`fleetlab.overlap.core`: the loop (the same three moves, one step apart);
- :mod:`fleetlab.overlap.gate`: whether to overlap at all, measured as the loop runs;
- :mod:`fleetlab.overlap.ahead`: the scheduler's view one step ahead, taken back at commit;
- :mod:`fleetlab.overlap.placeholders`: the tokens step N+1 reads before step N sampled them;
- :mod:`fleetlab.overlap.frozen`: a prepared step's own copy of the batch state it reads;
- :mod:`fleetlab.overlap.refusals`: what it does not do (refused, the option named);
- :mod:`fleetlab.overlap.timeline`: an observer of the host's and the model thread's phases.
"""

from fleetlab.overlap.core import OverlapEngineCore
from fleetlab.overlap.gate import OverlapGate
from fleetlab.overlap.refusals import RefusedStructuredOutputs, check_async_scheduling
from fleetlab.overlap.timeline import Timeline

__all__ = ["OverlapEngineCore", "OverlapGate", "RefusedStructuredOutputs", "Timeline", "check_async_scheduling"]
