"""What runs before either connector role exists: the extra config and its engine checks,
the walk over a ``kv_transfer_config``'s connector entries, the Offloading scope, host-pool
sharing, the KV planner, the readers of a finished plan and the capacity report."""
