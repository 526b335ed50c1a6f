"""The host synchronisations and copies of the GPU tier's calls, from torch.profiler's CUPTI
trace (it records cupy's CUDA calls too): for each call (find, insert, train_resident, a
flush's dirty_keys + dirty_rows) of 16,384 keys at dim 32 with Adam, as bench_gpu_shard
--quick, the host's wall time per call, the GPU kernels' time, and each memcpy (direction,
pageable or pinned), stream synchronisation and kernel launch with its count.

    python -m tests.bench.profile_gpu_syncs      # on a machine with cupy and torch on CUDA

Without a GPU it runs the same calls on numpy and prints their wall times only.
"""

import sys
import time
import traceback
from collections import Counter, defaultdict

import numpy as np

try:
    import cupy as xp
except ImportError:
    xp = np
from torch.profiler import ProfilerActivity, profile

from tierps.core.config import TableConfig
from tierps.storage import optim
from tierps.storage.tiers import CacheTier

N, DIM = 16384, 32
config = TableConfig("t", DIM, optimizer=optim.Adam())
tier = CacheTier(
    config, 256 << 20, xp=xp, name="gpu", trains_in_place=True, preallocate=xp is not np
)
rng = np.random.default_rng(0)
keys = rng.choice(10**7, N, replace=False).astype(np.int64)
rows = config.initial_rows(keys)
grads = rng.standard_normal((N, DIM), dtype=np.float32)
dirty = np.ones(N, bool)
fresh = iter(range(10**8, 10**9, N))


def below(spill):
    return None


def new_keys():
    start = next(fresh)
    return np.arange(start, start + N, dtype=np.int64)


tier.insert(keys, rows, dirty, below)
calls = {
    "find (all hits)": lambda: tier.find(keys),
    "find (all misses)": lambda: tier.find(new_keys()),
    "insert (new keys)": lambda: tier.insert(new_keys(), rows, dirty, below),
    "insert (present keys)": lambda: tier.insert(keys, rows, dirty, below),
    "train_resident": lambda: tier.train_resident(keys, grads, 2, None),
    "dirty_keys+dirty_rows": lambda: tier.dirty_rows(tier.dirty_keys()),
}


def sync():
    if xp is not np:
        xp.cuda.Device().synchronize()


for name, fn in calls.items():
    try:
        for _ in range(3):
            fn()
        sync()
        started = time.perf_counter()
        for _ in range(20):
            fn()
        sync()
        wall = (time.perf_counter() - started) / 20 * 1e3
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            sync()
        counts, times = Counter(), defaultdict(float)
        kernel_us = 0.0
        for event in prof.events():
            label = event.name
            device = str(getattr(event, "device_type", "")).endswith("CUDA")
            if device and "emcpy" not in label and "emset" not in label:
                kernel_us += event.device_time_total if hasattr(event, "device_time_total") else 0
                counts["kernels (GPU)"] += 1
                continue
            kinds = ("Memcpy", "emcpy", "ynchronize", "LaunchKernel", "Memset", "alloc", "Malloc")
            for key in kinds:
                if key in label:
                    counts[label] += 1
                    times[label] += event.cpu_time_total if not device else event.device_time_total
                    break
        print(
            f"\n## {name}: {wall:.3f} ms a call (host wall, 20 calls); "
            f"GPU kernels {kernel_us / 1e3:.3f} ms"
        )
        for label, count in sorted(counts.items(), key=lambda kv: -kv[1]):
            print(f"   {count:4d} x {label}  ({times[label] / 1e3:.3f} ms)")
        table = prof.key_averages().table(sort_by="count", row_limit=14, max_name_column_width=48)
        print("\n".join(line[:140] for line in table.splitlines()))
    except Exception:
        traceback.print_exc(file=sys.stdout)
