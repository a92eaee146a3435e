"""Simulated engines: vLLM v1's scheduling and KV bookkeeping without a model, timed by AIConfigurator.

A pool with `engine.kind: simulated` runs SimulatedEngine (engine.py) behind the same runner,
replicas, router and metrics as a vLLM engine. One file each: config.py (the YAML sub-config),
timing.py (step time from AIConfigurator), step_table.py (the same step times interpolated from a
table sampled once, step_table_build.py, and cached on disk, step_table_cache.py), geometry.py
(KV bytes per token), blocks.py (block pool, prefix cache), kv_cache.py (per-request block tables), request.py, scheduler.py (vLLM's schedule()),
handoff.py (P/D transfer accounting), outputs.py (RequestOutput-likes), engine.py.
"""
