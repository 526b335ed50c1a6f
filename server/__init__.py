"""tierps.server: the shard, its gRPC servicers, the daemon, the local cluster and the CLI."""

from tierps.server.cluster import LocalCluster, wait_until_serving
from tierps.server.config import ServerConfig
from tierps.server.daemon import ShardServer, create_server, serve
from tierps.server.shard import Shard

__all__ = [
    "LocalCluster",
    "ServerConfig",
    "Shard",
    "ShardServer",
    "create_server",
    "serve",
    "wait_until_serving",
]
