"""Disaggregated serving: the prefill and the decode engine on two ranks, behind one OpenAI server.

The programs of it; the KV connector they use is :mod:`fleetlab.kv_transfer.paddle_distributed`.

- :mod:`~fleetlab.serving.disagg.cli`: ``python -m fleetlab disagg``, the launcher;
- :mod:`~fleetlab.serving.disagg.rank`: ``serve --kv-role prefill|decode``, one rank's role and the
  prefill rank's program;
- :mod:`~fleetlab.serving.disagg.proxy`: the client's one address in front of the two ranks;
- :mod:`~fleetlab.serving.disagg.prefill`: the prefill rank's loop;
- :mod:`~fleetlab.serving.disagg.parity`: a two-rank run checked against one engine;
- :mod:`~fleetlab.serving.disagg.mixed`: a mixed workload on the pair, against one engine.
"""
