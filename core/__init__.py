"""tierps.core: the rules the client and the shards share - table configs, optimizers and
initializers, key hashing and ownership, input checks, the row layout, errors - on the
standard library, numpy and (optionally) numba only, so that a trainer imports no storage
engine."""
