"""P/D disaggregation, decode side: the composition check, the scheduler's landings of
imported requests, the workers' reads over NIXL, and the import orders between them."""
