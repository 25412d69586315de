"""Framework-neutral core: dtypes, N-d boxes and the shard contract. Depends on numpy only."""
