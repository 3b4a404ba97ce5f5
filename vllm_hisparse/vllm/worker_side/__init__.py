"""The connector's worker role (``role.WorkerRole``) and the parts it owns: the lanes, the
read path at vLLM's top-k conversion sites, the score tap, host-prefix loads and the prefill
guard. Nothing here imports ``scheduler_side``."""
