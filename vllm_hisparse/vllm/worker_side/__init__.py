"""The connector's worker role (``role.WorkerRole``) and the parts it owns: the lanes, the
read path at vLLM's top-k conversion sites, the score tap, the tracked requests, prefix
loads, the prefill guard and trace recording. Nothing here imports ``scheduler_side``."""
