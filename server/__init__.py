"""tierps.server: the shard, its gRPC servicers, the daemon, the local cluster and the CLI.

Nothing is imported here: the `tierps` command (tierps.server.cli) must start on a
trainer's install, without the `server` extra, to run `tierps admin` and to say what a
command that runs shards needs. Import from the modules: tierps.server.cluster
(LocalCluster, wait_until_serving), tierps.server.config (ServerConfig),
tierps.server.daemon (ShardServer, create_server, serve), tierps.server.shard (Shard).
"""
