"""The wire contract (tierps.v1). The .proto files and their generated code land with the
shard-service issue; nothing of ours may be imported from here."""
