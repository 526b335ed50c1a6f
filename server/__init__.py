"""tierps.server: the shard, its gRPC servicers, the daemon and the CLI."""
