"""Compile (or load from numba's cache) every host kernel a shard runs, before its first
call: the host tier's (storage/host_kernels.py, run through a real tier), the checks shared
with the client (core/compiled.py) and the key-ownership check of its data calls
(core/ownership.py). A shard runs it when it starts; deploy/Dockerfile runs it at build
time, so that a container starts with the cache filled."""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from tierps.core import compiled, optim, ownership
from tierps.core.config import TableConfig
from tierps.storage import host_kernels
from tierps.storage.hash_table import HashTable
from tierps.storage.tiers import CacheTier, DirectTier, Spill

log = logging.getLogger(__name__)


def warm_up() -> float:
    """Compile every host kernel for the array layouts the tier and the data calls use;
    returns the seconds it took (0 without the host kernels)."""
    if host_kernels.host_launcher() is None:
        return 0.0
    started = time.perf_counter()
    keys = np.arange(1, 9, dtype=np.int64)
    table = HashTable(16)
    table.insert(keys)
    table.reserve(64)  # a rebuild (growth), as a table's first calls make
    table.find(keys)
    table.find_rows(keys, np.zeros((8, 4), np.float32))
    for optimizer in optim.OPTIMIZERS.values():  # each one's training loop
        for steps in (0, 4):
            config = TableConfig("warm_up", 4, optimizer=optimizer(), steps_to_live=steps)
            tier = CacheTier(config, 1 << 20, trains_in_place=True)
            rows = host_kernels.initial_rows(config, keys)
            if steps:
                rows = np.concatenate([rows, np.zeros((8, 2), np.float32)], axis=1)

            def below(spill: Spill) -> None:
                raise AssertionError("warm-up: nothing spills")

            tier.insert(keys, rows, np.ones(8, bool), below)
            stamp = np.zeros(2, np.float32) if steps else None  # a first touch's rows
            tier.insert_initial(keys + 8, np.empty((8, 4), np.float32), stamp)
            tier.find(keys)
            tier.train_resident(keys[:4], np.ones((4, 4), np.float32), 1, 1 if steps else None)
            # a refused push: its trained rows are made again by the loop over row ids
            tier.train_resident(keys[4:], np.full((4, 4), np.inf, np.float32), 1, None)
            direct = DirectTier(
                dataclasses.replace(config, use_hashtable=False, capacity=16), compiled=True
            )  # a direct table's find and its training loop over row ids
            direct.insert(keys, rows, np.ones(8, bool), below)
            direct.find_into(keys, None, 4)
            direct.train_resident(keys[:4], np.ones((4, 4), np.float32), 1, 1 if steps else None)
            direct.close()
    compiled.warm_up()
    ownership.warm_up()
    seconds = time.perf_counter() - started
    log.info("tierps host kernels ready in %.2f s", seconds)
    return seconds
