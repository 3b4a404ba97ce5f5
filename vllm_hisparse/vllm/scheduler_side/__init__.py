"""The connector's scheduler role (``role.SchedulerRole``) and the parts it owns: the
engine geometry, the request book, admission, host-prefix hits, worker acks, draft
rollback, the residency-aware KV cache manager, the ``BlockPool`` adapter and the lockstep
coordinator. Nothing here imports ``worker_side``."""
