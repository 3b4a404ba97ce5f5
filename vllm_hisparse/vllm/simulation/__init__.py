"""``vllm-hisparse simulate``: vLLM's real ``Scheduler`` and both connector roles around a
synthetic DSA model, over a generated tiny model config.

* ``spec.py``: what a simulation is (geometry, device pool, workload, tokens);
* ``model.py``: the generated model directory, ``VllmConfig`` and per-layer KV cache specs;
* ``synthetic_attention.py``: the model stand-in (KV writes, top-k, conversions, CPU twins);
* ``ground_truth.py``: what every row must hold, and the check of what was read;
* ``engine.py``: the driving loop (scheduler, model runner tables, connector, counters);
* ``probe.py``: hooks per run, step and layer (``vllm-hisparse bench connector`` times
  through them).

Nothing is imported here: the modules import vLLM, and the CLI imports them lazily.
"""
