"""``vllm-hisparse simulate``'s engine: vLLM's real ``Scheduler`` + both connector roles +
a synthetic DSA model (``engine.py``), over a generated tiny model config (``model.py``).

Nothing is imported here: ``model`` and ``engine`` import vLLM, and the CLI imports them lazily.
"""
