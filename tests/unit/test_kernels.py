"""The CUDA kernels (storage/kernels.py) checked against the generic array code.

No GPU is needed for most of this. The kernel source is compiled with the host C++ compiler
through a shim (SHIM below) that stands in for CUDA's built-ins: a launch runs every thread
of the grid one after another, in index order, reversed, or a random permutation, or -
"interleaved" - as coroutines (ucontext) in waves of up to 64 threads, switching to a
random thread of the wave before every atomicCAS, so threads read a free slot, lose it to
another thread and go on from what that one wrote, as they do on a GPU. The emulated
kernels run on numpy arrays through the very Python functions the GPU path uses, so the
glue (argument types, lanes, strides, counts) is tested too.

The oracles are the generic numpy HashTable (storage/hash_table.py with kernels=False), a
dict model, numpy indexing, and optimizer.apply (core/optim.py) on gathered rows.

The same tests run on cupy against numpy where a GPU is usable; nvcc, where installed,
compiles the source for sm_80 and sm_90.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from tests.contract import test_tier_setups as contract
from tests.optimizers import each, kind_id
from tests.unit import test_tombstones as tombstones
from tierps.core.hashing import hash_keys
from tierps.core.xp import to_host
from tierps.storage import EmbeddingStore, host_kernels, kernels, optim
from tierps.storage.hash_table import EMPTY, TOMBSTONE, HashTable
from tierps.storage.tiers import CacheTier

I64_MAX = int(np.iinfo(np.int64).max)

# --------------------------------------------------------------------------- host emulation

SHIM = r"""
/* Host stand-ins for the CUDA built-ins the kernels use. */
#include <math.h>
#include <stdlib.h>
#include <functional>
#include <vector>
#if defined(__has_include)
#if __has_include(<ucontext.h>)
#include <ucontext.h>
#define EMU_INTERLEAVE 1
#endif
#endif

struct emu_dim3 { unsigned int x, y, z; };
static emu_dim3 threadIdx, blockIdx, blockDim, gridDim;
struct alignas(16) float4 { float x, y, z, w; };
#define __global__
#define __device__
#define __forceinline__ inline

static long long emu_block = 1, emu_blocks = 1;
static std::function<void()> emu_call;   /* the kernel with its arguments bound */
static unsigned long long emu_cas_failures = 0;

static void emu_set_thread(long long t) {
    blockIdx.x = (unsigned int)(t / emu_block);
    threadIdx.x = (unsigned int)(t % emu_block);
    blockIdx.y = blockIdx.z = threadIdx.y = threadIdx.z = 0;
    blockDim.x = (unsigned int)emu_block;
    gridDim.x = (unsigned int)emu_blocks;
    blockDim.y = blockDim.z = gridDim.y = gridDim.z = 1;
}

#ifdef EMU_INTERLEAVE
struct EmuThread { ucontext_t context; long long index; bool done; };
static ucontext_t emu_scheduler;
static std::vector<EmuThread> emu_wave;
static std::vector<char> emu_stacks;
static long long emu_current = -1;
static const size_t EMU_STACK = 1 << 16;

static void emu_entry() {
    emu_call();
    emu_wave[emu_current].done = true;   /* then uc_link resumes the scheduler */
}
static void emu_yield() {
    if (emu_current >= 0) swapcontext(&emu_wave[emu_current].context, &emu_scheduler);
}
/* A coroutine that starts in emu_entry on its own stack (getcontext returns once here:
   the context is only ever entered through makecontext's entry point). */
static void emu_prepare(EmuThread& th, char* stack, long long index) {
    getcontext(&th.context);
    th.context.uc_stack.ss_sp = stack;
    th.context.uc_stack.ss_size = EMU_STACK;
    th.context.uc_link = &emu_scheduler;
    makecontext(&th.context, emu_entry, 0);
    th.index = index;
    th.done = false;
}
#else
static void emu_yield() {}
#endif

/* Another thread may run between a thread's read of a slot and its CAS on it. */
static unsigned long long atomicCAS(unsigned long long* address, unsigned long long expected,
                                    unsigned long long desired) {
    emu_yield();
    const unsigned long long old = *address;
    if (old == expected) *address = desired; else ++emu_cas_failures;
    return old;
}

extern "C" unsigned long long emu_cas_failure_count() { return emu_cas_failures; }
extern "C" int emu_can_interleave() {
#ifdef EMU_INTERLEAVE
    return 1;
#else
    return 0;
#endif
}

/* Run the bound kernel over a grid of ceil(threads / block) blocks: in `order` (a
   permutation of every thread of the grid; null: index order), one thread after another,
   or, with wave > 1, as coroutines in waves of `wave` threads taken in that order, switching
   to a random unfinished thread of the wave at every atomic. */
static void emu_run(long long threads, long long block, const long long* order, long long wave,
                    unsigned long long seed) {
    emu_block = block;
    emu_blocks = (threads + block - 1) / block;
    const long long total = emu_blocks * block;
#ifdef EMU_INTERLEAVE
    if (wave > 1) {
        unsigned long long rng = seed * 0x9E3779B97F4A7C15ULL + 1;
        emu_stacks.resize((size_t)wave * EMU_STACK);
        for (long long start = 0; start < total; start += wave) {
            const long long count = total - start < wave ? total - start : wave;
            emu_wave.assign((size_t)count, EmuThread());
            for (long long j = 0; j < count; ++j)
                emu_prepare(emu_wave[j], &emu_stacks[(size_t)j * EMU_STACK],
                            order ? order[start + j] : start + j);
            for (long long live = count; live > 0;) {
                rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;   /* xorshift64 */
                long long j = (long long)(rng % (unsigned long long)count);
                while (emu_wave[j].done) j = (j + 1) % count;
                emu_current = j;
                emu_set_thread(emu_wave[j].index);
                swapcontext(&emu_scheduler, &emu_wave[j].context);
                if (emu_wave[j].done) --live;
            }
            emu_current = -1;
        }
        return;
    }
#endif
    for (long long k = 0; k < total; ++k) {
        emu_set_thread(order ? order[k] : k);
        emu_call();
    }
}
"""

_KERNEL = re.compile(r'extern "C" __global__ void (\w+)\(([^)]*)\)', re.S)
_SCALARS = {"long long": (ctypes.c_longlong, np.int64), "int": (ctypes.c_int, np.int32)}
_SCALARS["float"] = (ctypes.c_float, np.float32)
_POINTEES = {"long long": np.int64, "float": np.float32, "bool": np.bool_}
_POINTEES["unsigned char"] = np.uint8


@dataclass(frozen=True)
class Param:
    name: str
    base: str  # "long long", "float", ... without const / __restrict__ / *
    pointer: bool


def kernel_signatures(source: str) -> dict[str, list[Param]]:
    """Every kernel's parameters, read from the source itself."""
    out: dict[str, list[Param]] = {}
    for name, params in _KERNEL.findall(source):
        parsed = []
        for text in params.split(","):
            text = " ".join(text.split())
            pname = re.findall(r"\w+", text)[-1]
            kind = text[: text.rindex(pname)]
            base = " ".join(
                w for w in re.findall(r"\w+", kind) if w not in {"const", "__restrict__"}
            )
            assert base in _SCALARS or base in _POINTEES, f"{name}: unknown type in {text!r}"
            parsed.append(Param(pname, base, "*" in kind))
        out[name] = parsed
    return out


def emulation_source() -> str:
    """Shim + kernel source + one extern "C" runner per kernel, emu_<kernel>(threads, block,
    order, wave, seed, <the kernel's parameters>)."""
    runners = []
    for name, params in kernel_signatures(kernels.SOURCE).items():
        decl = ", ".join(f"{p.base}{'*' if p.pointer else ''} {p.name}" for p in params)
        call = ", ".join(p.name for p in params)
        runners.append(
            f'extern "C" void emu_{name}(long long threads, long long block, '
            f"const long long* order, long long wave, unsigned long long seed, {decl}) {{\n"
            f"    emu_call = [=]() {{ {name}({call}); }};\n"
            f"    emu_run(threads, block, order, wave, seed);\n}}\n"
        )
    return SHIM + kernels.SOURCE + "\n".join(runners)


def host_compiler() -> str | None:
    for name in ("c++", "g++", "clang++"):
        found = shutil.which(name)
        if found:
            return found
    return None


class EmuLauncher:
    """kernels.Launcher running the host-compiled kernels over numpy arrays. order:
    "index", "reverse" or "shuffle"; wave > 1 interleaves threads (see SHIM)."""

    def __init__(
        self, lib: ctypes.CDLL, order: str = "index", wave: int = 0, seed: int = 0, block: int = 32
    ) -> None:
        self.lib, self.order, self.wave, self.block = lib, order, wave, block
        self.signatures = kernel_signatures(kernels.SOURCE)
        self.rng = np.random.default_rng(seed)
        self.calls = 0

    def __call__(self, name: str, threads: int, args: Any) -> None:
        params = self.signatures[name]
        assert len(args) == len(params), f"{name}: {len(args)} arguments for {len(params)}"
        c_args: list[Any] = []
        for param, arg in zip(params, args, strict=True):
            if param.pointer:
                if arg is None:
                    c_args.append(None)
                    continue
                # cupy checks nothing either: the glue must pass exactly these dtypes.
                assert isinstance(arg, np.ndarray), f"{name}.{param.name}: {type(arg)}"
                assert arg.dtype == _POINTEES[param.base], f"{name}.{param.name}: {arg.dtype}"
                c_args.append(ctypes.c_void_p(arg.ctypes.data))
            else:
                c_type, np_type = _SCALARS[param.base]
                assert type(arg) is np_type, f"{name}.{param.name}: {type(arg)} for {np_type}"
                c_args.append(c_type(arg.item()))
        self.calls += 1
        if threads <= 0:
            return
        total = -(-threads // self.block) * self.block
        order = {
            "index": None,
            "reverse": np.arange(total - 1, -1, -1, dtype=np.int64),
            "shuffle": self.rng.permutation(total).astype(np.int64),
        }[self.order]
        seed = int(self.rng.integers(1, 2**63))
        getattr(self.lib, f"emu_{name}")(
            ctypes.c_longlong(threads),
            ctypes.c_longlong(self.block),
            None if order is None else ctypes.c_void_p(order.ctypes.data),
            ctypes.c_longlong(self.wave),
            ctypes.c_ulonglong(seed),
            *c_args,
        )


@pytest.fixture(scope="module")
def emu_lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    compiler = host_compiler()
    if compiler is None:
        pytest.skip("no host C++ compiler (c++, g++ or clang++) to build the kernel emulation")
    folder = tmp_path_factory.mktemp("kernels")
    source, lib_path = folder / "emu.cpp", folder / "libemu.so"
    source.write_text(emulation_source())
    # No FMA contraction, no fast math: the kernels must round as numpy does.
    flags = ["-std=c++14", "-O1", "-shared", "-fPIC", "-fno-strict-aliasing"]
    flags += ["-ffp-contract=off", "-fno-fast-math"]
    # e.g. "-fsanitize=address,undefined -g" (then run pytest with LD_PRELOAD=libasan.so)
    flags += os.environ.get("TIERPS_EMU_CXXFLAGS", "").split()
    done = subprocess.run(
        [compiler, *flags, "-o", str(lib_path), str(source)], capture_output=True, text=True
    )
    assert done.returncode == 0, f"host build of the kernels failed:\n{done.stderr}"
    lib = ctypes.CDLL(str(lib_path))
    lib.emu_cas_failure_count.restype = ctypes.c_ulonglong
    return lib


# --------------------------------------------------------------------------- backends


@dataclass
class Backend:
    """Where the kernels run: the emulation on numpy arrays, or cupy on a GPU."""

    name: str
    xp: ModuleType
    launch: Any  # a Launcher; None: kernels' own cupy launcher

    def dev(self, array: np.ndarray) -> Any:
        """The array where the kernels read it: a copy, as on a GPU, and contiguous (a host
        table's columns are strided views; CUDA kernels and their emulation take raw
        pointers)."""
        return np.ascontiguousarray(array) if self.xp is np else self.xp.asarray(array)

    @property
    def table_kernels(self) -> Any:
        """HashTable's kernels= argument for this backend."""
        return True if self.launch is None else self.launch


def _cupy_or_skip() -> ModuleType:
    try:
        import cupy
    except ImportError:
        pytest.skip("cupy is not installed: GPU tests skipped")
    if not cupy.is_available():
        pytest.skip("cupy finds no usable GPU: GPU tests skipped")
    if kernels.cupy_launcher() is None:
        pytest.fail(f"GPU present but the kernels are unusable: {kernels.unavailable_reason()}")
    return cupy


EMU_ORDERS = {
    "emu-index": ("index", 0),
    "emu-reverse": ("reverse", 0),
    "emu-shuffle": ("shuffle", 0),
    "emu-interleaved": ("shuffle", 64),
}


def make_backend(name: str, request: pytest.FixtureRequest, seed: int = 0) -> Backend:
    if name == "cupy":
        return Backend(name, _cupy_or_skip(), None)
    if name == "numba":  # the host tier's compiled twins (storage/host_kernels.py)
        launcher = host_kernels.host_launcher()
        if launcher is None:
            pytest.skip(f"host kernels unavailable: {host_kernels.unavailable_reason()}")
        return Backend(name, np, launcher)
    lib = request.getfixturevalue("emu_lib")
    order, wave = EMU_ORDERS[name]
    if wave and not lib.emu_can_interleave():
        pytest.skip("no ucontext on this platform: interleaved emulation skipped")
    return Backend(name, np, EmuLauncher(lib, order=order, wave=wave, seed=seed))


@pytest.fixture(params=["emu-index", "numba", "cupy"])
def backend(request: pytest.FixtureRequest) -> Backend:
    """Deterministic kernels (find, rows, optimizers): thread order cannot matter."""
    return make_backend(request.param, request)


@pytest.fixture(params=[*EMU_ORDERS, "numba", "cupy"])
def racing_backend(request: pytest.FixtureRequest) -> Backend:
    """Kernels whose threads compete for slots: every emulated order, and the GPU."""
    return make_backend(request.param, request, seed=7)


# --------------------------------------------------------------------------- helpers


def home_of(keys: np.ndarray, slots: int) -> np.ndarray:
    return (hash_keys(np.asarray(keys, dtype=np.int64)) & np.uint64(slots - 1)).astype(np.int64)


def keys_with_home(count: int, slots: int, home: int, start: int = 0) -> np.ndarray:
    """The first `count` keys >= start whose home slot in a `slots`-slot table is `home`."""
    cand = np.arange(start, start + count * slots * 8, dtype=np.int64)
    hit = cand[home_of(cand, slots) == home]
    assert hit.size >= count
    return hit[:count]


def generic_table(capacity: int, rng: np.random.Generator, rounds: int = 6) -> HashTable:
    """A numpy HashTable (array code) with a history of inserts and erases: tombstones."""
    table = HashTable(capacity, kernels=False)
    pool = rng.choice(2**40, capacity * 3, replace=False).astype(np.int64) - 2**39
    for _ in range(rounds):
        batch = rng.choice(pool, capacity // 3)
        slots, inserted = table.insert(batch)
        table.values[slots[inserted]] = rng.integers(0, 1000, int(inserted.sum()))
        table.erase(rng.choice(pool, capacity // 6))
    assert (table._keys == TOMBSTONE).any(), "the history left no tombstone"
    return table


def kernel_twin(table: HashTable, backend: Backend) -> HashTable:
    """A table with the same state as `table`, whose find/insert/claim run on the backend."""
    twin = HashTable(
        16,
        eviction=table.eviction,
        max_load=table.max_load,
        xp=backend.xp,
        kernels=backend.table_kernels,
    )
    twin._keys, twin.values = backend.dev(table._keys.copy()), backend.dev(table.values.copy())
    twin._scores, twin._mask = backend.dev(table._scores.copy()), table._mask
    twin._size, twin._used, twin._tick = table._size, table._used, table._tick
    return twin


def assert_probe_invariant(table_keys: np.ndarray, keys: np.ndarray, slots: np.ndarray) -> None:
    """Linear probing's invariant: every slot from a key's home up to (not including) its own
    holds a live key, so a find walking from the home cannot stop early, and the key did not
    pass a free slot."""
    size = table_keys.shape[0]
    for key, slot in zip(keys.tolist(), slots.tolist(), strict=True):
        pos = int(home_of(np.array([key]), size)[0])
        while pos != slot:
            assert table_keys[pos] > TOMBSTONE, f"key {key} at {slot} passed free slot {pos}"
            pos = (pos + 1) % size


# --------------------------------------------------------------------------- compile checks


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_source_compiles_with_nvcc(arch: str, tmp_path: Path) -> None:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found: the device compile check is skipped")
    source = tmp_path / "kernels.cu"
    source.write_text(kernels.SOURCE)
    ptx = tmp_path / "kernels.ptx"
    done = subprocess.run(
        [nvcc, "-ptx", f"-arch={arch}", *kernels.NVRTC_OPTIONS, "-o", str(ptx), str(source)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    text = ptx.read_text()
    for name in kernels.KERNEL_NAMES:
        assert f".entry {name}(" in text, f"{name} missing from the PTX"


def test_every_kernel_is_listed() -> None:
    assert sorted(kernel_signatures(kernels.SOURCE)) == sorted(kernels.KERNEL_NAMES)


# --------------------------------------------------------------------------- find


def test_find_matches_reference(backend: Backend) -> None:
    rng = np.random.default_rng(1)
    table = generic_table(3000, rng)
    live, _ = table.export()
    erased = table._keys[table._keys == TOMBSTONE]  # only a count: erased keys come next
    assert erased.size
    queries = np.concatenate(
        [
            live,
            rng.choice(2**40, 2000).astype(np.int64) - 2**39,  # mostly absent, some erased
            np.array([EMPTY, TOMBSTONE, -1, 0, I64_MAX], dtype=np.int64),
        ]
    )
    rng.shuffle(queries)
    expected = table.find(queries)
    got = kernels.find_slots(
        backend.dev(table._keys), table._mask, backend.dev(queries), launch=backend.launch
    )
    np.testing.assert_array_equal(to_host(got), expected)
    assert (expected[: live.size] >= 0).any()


def test_find_wraps_past_the_end_and_through_tombstones(backend: Backend) -> None:
    """A chain that starts at the last slots and wraps to slot 0, with tombstones inside."""
    table = HashTable(32, kernels=False)  # 64 slots
    size = table.slots
    chain = keys_with_home(20, size, size - 3)
    table.insert(chain)
    table.values[table.find(chain)] = np.arange(20)
    table.erase(chain[[2, 9, 15]])
    assert (table._keys[:10] > TOMBSTONE).any(), "the chain did not wrap"
    queries = np.concatenate([chain, keys_with_home(4, size, size - 3, start=int(chain[-1]) + 1)])
    expected = table.find(queries)
    assert (expected[[2, 9, 15]] == -1).all() and (expected[:20] >= 0).sum() == 17
    got = kernels.find_slots(
        backend.dev(table._keys), table._mask, backend.dev(queries), launch=backend.launch
    )
    np.testing.assert_array_equal(to_host(got), expected)


def test_find_terminates_on_a_table_without_empty_slots(backend: Backend) -> None:
    """HashTable never fills up (the array code would loop forever); the kernel's probe bound
    turns a full table into misses instead of a hung GPU."""
    size = 16
    table_keys = np.arange(100, 100 + size, dtype=np.int64)
    table_keys[[3, 11]] = TOMBSTONE
    present = table_keys[table_keys > TOMBSTONE]
    queries = np.concatenate([present, np.array([5, 7, 100 + 3], dtype=np.int64)])
    got = to_host(
        kernels.find_slots(
            backend.dev(table_keys), size - 1, backend.dev(queries), launch=backend.launch
        )
    )
    np.testing.assert_array_equal(got[: present.size], np.nonzero(table_keys > TOMBSTONE)[0])
    assert (got[present.size :] == -1).all()


# --------------------------------------------------------------------------- claim and insert


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_claim_matches_reference(racing_backend: Backend, seed: int) -> None:
    """The claim kernel against HashTable._claim's array code from the same state: the same
    keys placed (once each, duplicates sharing), the same size and used counts, every key
    where a find looks for it, and no free slot passed. Slots may differ (which thread wins a
    slot is the schedule's choice); the set of filled slots of linear probing does not."""
    backend = racing_backend
    rng = np.random.default_rng(seed)
    reference = generic_table(400, rng)
    twin = kernel_twin(reference, backend)
    present = set(reference.export()[0].tolist())
    # Absent keys: some homed at tombstones, many repeated, some sharing one home.
    tomb_homes = np.nonzero(reference._keys == TOMBSTONE)[0][:8]
    fresh = [keys_with_home(3, reference.slots, int(h), start=2**41) for h in tomb_homes]
    fresh.append(keys_with_home(12, reference.slots, 5, start=2**42))
    fresh.append(rng.choice(2**40, 60, replace=False).astype(np.int64) + 2**43)
    distinct = np.unique(np.concatenate(fresh))
    distinct = distinct[~np.isin(distinct, list(present))]
    batch = rng.permutation(np.concatenate([distinct, rng.choice(distinct, 80)]))
    todo = np.arange(batch.size, dtype=np.int64)

    ref_slots = np.full(batch.size, -1, np.int64)
    ref_inserted = np.zeros(batch.size, bool)
    reference._claim(batch, todo, ref_slots, ref_inserted)

    slots = backend.xp.full(batch.size, -1, dtype=backend.xp.int64)
    inserted = backend.xp.zeros(batch.size, dtype=bool)
    placed, empty = kernels.claim_slots(
        twin._keys,
        twin._mask,
        backend.dev(batch),
        backend.dev(todo),
        slots,
        inserted,
        launch=backend.launch,
    )
    slots, inserted, table_keys = to_host(slots), to_host(inserted), to_host(twin._keys)

    assert placed == distinct.size == reference.size - len(present)
    assert empty == reference._used - twin._used  # twin's counts are from before the claim
    assert sorted(batch[inserted].tolist()) == sorted(distinct.tolist())
    np.testing.assert_array_equal(table_keys[slots], batch)
    first = {}
    for key, slot in zip(batch.tolist(), slots.tolist(), strict=True):
        assert first.setdefault(key, slot) == slot, f"key {key} got two slots"
    assert np.array_equal(
        np.sort(table_keys[table_keys > TOMBSTONE]), np.sort(reference.export()[0])
    )
    assert_probe_invariant(table_keys, batch, slots)
    np.testing.assert_array_equal(reference.find(batch) >= 0, True)
    np.testing.assert_array_equal(
        to_host(
            kernels.find_slots(twin._keys, twin._mask, backend.dev(batch), launch=backend.launch)
        ),
        slots,
    )


def test_interleaving_makes_threads_lose_slots(emu_lib: ctypes.CDLL) -> None:
    """The interleaved emulation really races: threads read a free slot that another thread
    takes before their CAS (the path sequential runs never take), and the result holds."""
    if not emu_lib.emu_can_interleave():
        pytest.skip("no ucontext on this platform")
    launch = EmuLauncher(emu_lib, order="shuffle", wave=64, seed=3)
    table = HashTable(64, kernels=launch)
    keys = np.concatenate([keys_with_home(10, table.slots, 7), keys_with_home(6, table.slots, 9)])
    batch = np.tile(keys, 4)
    before = emu_lib.emu_cas_failure_count()
    slots, inserted = table.insert(batch)
    assert emu_lib.emu_cas_failure_count() > before
    assert sorted(batch[inserted].tolist()) == sorted(keys.tolist())
    assert_probe_invariant(table._keys, batch, slots)
    np.testing.assert_array_equal(table._keys[slots], batch)


def scores_by_key(table: HashTable) -> dict[int, int]:
    live = np.nonzero(to_host(table._keys) > TOMBSTONE)[0]
    keys, scores = to_host(table._keys)[live], to_host(table._scores)[live]
    return dict(zip(keys.tolist(), scores.tolist(), strict=True))


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_hash_table_with_kernels_matches_array_code(racing_backend: Backend, eviction: str) -> None:
    """HashTable's public calls with kernels (upsert pass, find-then-claim with growth,
    insert_absent, rehash) against the same calls on the array code and a dict model,
    eviction scores included."""
    backend = racing_backend
    rng = np.random.default_rng(11)
    reference = HashTable(16, eviction=eviction, kernels=False)
    table = HashTable(16, eviction=eviction, xp=backend.xp, kernels=backend.table_kernels)
    assert table.uses_kernels
    model: dict[int, int] = {}
    pool = rng.choice(2**40, 900, replace=False).astype(np.int64) - 2**39
    counter = 0
    for round_ in range(14):
        batch = rng.choice(pool, int(rng.integers(1, 200)))
        if round_ == 5:  # keys hashed to one home, across the end of the slot array
            batch = keys_with_home(12, table.slots, table.slots - 2, start=2**50)
        ref_slots, ref_inserted = reference.insert(batch)
        slots, inserted = table.insert(backend.dev(batch))
        slots, inserted = to_host(slots), to_host(inserted)
        assert sorted(batch[inserted].tolist()) == sorted(batch[ref_inserted].tolist())
        new = batch[inserted]
        values = np.arange(counter, counter + new.size)
        counter += new.size
        model.update(zip(new.tolist(), values.tolist(), strict=True))
        table.values[backend.dev(slots[inserted])] = backend.dev(values)
        # The reference may have flagged another occurrence of a repeated key: by key, then.
        reference.values[ref_slots[ref_inserted]] = [model[k] for k in batch[ref_inserted]]
        np.testing.assert_array_equal(to_host(table.keys_at(backend.dev(slots))), batch)
        # insert_absent: keys a find just missed
        absent = np.setdiff1d(rng.choice(2**40, 20) + 2**45, list(model))
        # (slots first: a rehash inside insert_absent replaces the values array)
        absent_slots = table.insert_absent(backend.dev(absent))
        table.values[absent_slots] = backend.dev(absent % 1000)
        ref_absent_slots = reference.insert_absent(absent)
        reference.values[ref_absent_slots] = absent % 1000
        model.update(zip(absent.tolist(), (absent % 1000).tolist(), strict=True))
        touched = rng.choice(batch, 30)
        table.touch(table.find(backend.dev(touched)))
        reference.touch(reference.find(touched))
        assert scores_by_key(table) == scores_by_key(reference)
        gone = rng.choice(pool, 40)
        assert table.erase(backend.dev(gone)) == reference.erase(gone)
        for key in set(gone.tolist()):
            model.pop(key, None)
        # The layouts differ (which key won which slot), so erases leave tombstones in other
        # places and the used counts (and growth) may differ from the reference: each table
        # must count its own slots right.
        assert table.size == reference.size == len(model)
        table_keys = to_host(table._keys)
        assert table._used == int(np.count_nonzero(table_keys != EMPTY))
        assert table.size == int(np.count_nonzero(table_keys > TOMBSTONE))
        keys, vals = table.export()
        assert dict(zip(to_host(keys).tolist(), to_host(vals).tolist(), strict=True)) == model
        probe = np.concatenate([pool[:300], np.array([EMPTY, TOMBSTONE, -5])])
        found = to_host(table.find(backend.dev(probe)))
        assert ((found >= 0) == (reference.find(probe) >= 0)).all()
    assert table.slots > 16, "the table never grew"


def test_kernels_true_needs_compiled_kernels() -> None:
    """On numpy, kernels=True means the compiled host kernels (numba), or a RuntimeError."""
    with pytest.raises(ValueError, match="kernels"):
        HashTable(16, kernels="yes")
    assert not HashTable(16, kernels=False).uses_kernels
    if host_kernels.host_launcher() is None:
        with pytest.raises(RuntimeError, match="kernels"):
            HashTable(16, kernels=True)
    else:
        assert HashTable(16, kernels=True).uses_kernels
        assert HashTable(16).uses_kernels  # numpy: the compiled host kernels by default


# --------------------------------------------------------------------------- rows


@pytest.mark.parametrize(
    ("arena_width", "width"),
    [(8, None), (5, None), (12, 8), (100, 70), (7, 0)],
    ids=["vec4", "scalar", "part-vec4", "wide", "empty"],
)
def test_find_rows_matches_reference(backend: Backend, arena_width: int, width: int | None) -> None:
    rng = np.random.default_rng(4)
    table = generic_table(600, rng)
    live, values = table.export()
    arena = rng.standard_normal((int(values.max()) + 1, arena_width), dtype=np.float32)
    queries = rng.permutation(
        np.concatenate([live, rng.choice(live, 50), np.arange(-60, 0), np.array([EMPTY])])
    )
    ref_slots, ref_rows = table.find_rows(queries, arena, width)
    twin = kernel_twin(table, backend)
    slots, rows = twin.find_rows(backend.dev(queries), backend.dev(arena), width)
    np.testing.assert_array_equal(to_host(slots), ref_slots)
    np.testing.assert_array_equal(to_host(rows), ref_rows)
    # zero_misses=False: rows of missing keys keep what `out` held
    cols = arena_width if width is None else width
    out = backend.dev(np.full((queries.size, cols + 3), np.nan, dtype=np.float32))
    kernels.find_rows(
        twin._keys,
        twin.values,
        twin._mask,
        backend.dev(queries),
        backend.dev(arena),
        width=width,
        out=out,
        zero_misses=False,
        launch=backend.launch,
    )
    out = to_host(out)
    hit = ref_slots >= 0
    np.testing.assert_array_equal(out[hit, :cols], ref_rows[hit])
    assert np.isnan(out[~hit]).all() and np.isnan(out[:, cols:]).all()


# --------------------------------------------------------------------------- optimizers

# Every registered optimizer, and FTRL once more with a power that is not a square root.
OPTIMIZERS = {
    **{optimizer.kind: optimizer for optimizer in each()},
    "ftrl-power": optim.FTRL(lr=0.05, lr_power=-0.3, l1=0.0, l2=0.1),
}


def exact(optimizer: optim.Optimizer) -> bool:
    """Whether its update is only +, -, *, / and sqrt: IEEE 754 rounds each of those
    correctly on every CPU, vector unit and GPU, so the kernel (built without FMA
    contraction) and numpy agree bit for bit. A power (FTRL with lr_power != -0.5) comes
    from a libm (or numpy's own vector code) that may be an ulp off, differently on each
    machine."""
    return not (isinstance(optimizer, optim.FTRL) and optimizer.lr_power != -0.5)


# Error bounds of the float32 updates, derived instead of picked. Each float32 operation on
# inputs x (float32) returns fl(op(x)) with |fl(y) - y| <= U32 * |y| (+ TINY where y is
# subnormal): round to nearest, unit roundoff 2**-24. A power is allowed POW_ULPS ulps (one
# ulp of y is at most 2 * U32 * |y|): glibc's powf is within 1, numpy's vector pow and
# CUDA's powf within a few. `Bounded` carries, per element, the float64 value v of the same
# formula on the same float32 inputs and a bound e >= |float32 result - v|, propagated
# operation by operation (first order is not enough where FTRL cancels, so the products of
# errors are kept):
#   a +- b: e = ea + eb              a * b: e = ea |b| + eb |a| + ea eb
#   a / b:  e = (ea + |a/b| eb) / (|b| - eb)       (inf where eb >= |b|)
#   f(a) monotone (sqrt, x**p): e = max(f(a + ea) - f(a), f(a) - f(max(a - ea, 0)))
# and then the operation's own rounding, U32 * (|v| + e) (the float32 operand is within e of
# v). FTRL's n'^p - n^p cancels: its error is that of n'^p and n^p, a few U32 of n'^p, divided
# by lr and multiplied by w, then divided by (n'^p / lr + 2 l2); where |z| is within its
# error of l1 the branch may go either way, and then the bound is |(sign(z) l1 - z) / q| + e.
# float64's own rounding (2**-53 relative) is far below every term here.
U32 = 2.0**-24
TINY = 2.0**-149  # the absolute rounding error of a float32 result in the subnormal range
POW_ULPS = 4


@dataclass
class Bounded:
    """A float64 value of a float32 computation and a bound on the float32 result's error."""

    v: np.ndarray
    e: np.ndarray

    @staticmethod
    def of(x: Any) -> Bounded:
        """A float32 input (or a float32 constant): exact."""
        v = np.asarray(x, dtype=np.float32).astype(np.float64)
        return Bounded(v, np.zeros_like(v))

    @staticmethod
    def _rounded(v: np.ndarray, e: np.ndarray, ulps: float = 0.5) -> Bounded:
        return Bounded(v, e + 2 * ulps * U32 * (np.abs(v) + e) + TINY)

    def __add__(self, other: Bounded) -> Bounded:
        return self._rounded(self.v + other.v, self.e + other.e)

    def __sub__(self, other: Bounded) -> Bounded:
        return self._rounded(self.v - other.v, self.e + other.e)

    def __mul__(self, other: Bounded) -> Bounded:
        e = self.e * np.abs(other.v) + other.e * np.abs(self.v) + self.e * other.e
        return self._rounded(self.v * other.v, e)

    def __truediv__(self, other: Bounded) -> Bounded:
        v = self.v / other.v
        room = np.abs(other.v) - other.e
        with np.errstate(divide="ignore"):
            e = np.where(room > 0, (self.e + np.abs(v) * other.e) / room, np.inf)
        return self._rounded(v, e)

    def monotone(self, f: Any, ulps: float = 0.5) -> Bounded:
        """f(self) for an increasing f on [0, inf) (sqrt, x**p with p > 0), within ulps."""
        v = f(self.v)
        e = np.maximum(f(self.v + self.e) - v, v - f(np.maximum(self.v - self.e, 0.0)))
        return self._rounded(v, e, ulps)


def _const(x: float) -> Bounded:
    """A hyper-parameter as the float32 arithmetic sees it (numpy rounds a Python float to
    the array's float32; the kernels get it as float32)."""
    return Bounded.of(np.float32(x))


def _adam64(opt: Any, slot: list[Bounded], g: Bounded, step: int) -> list[Bounded]:
    c1, c2 = _const(1.0 - opt.beta1), _const(1.0 - opt.beta2)
    step_size = _const(opt.lr * (1.0 - opt.beta2**step) ** 0.5 / (1.0 - opt.beta1**step))
    w = slot[0]
    m = slot[1] + c1 * (g - slot[1])
    v = slot[2] + c2 * (g * g - slot[2])
    return [w - step_size * (m / (v.monotone(np.sqrt) + _const(opt.eps))), m, v]


def _ftrl64(opt: Any, slot: list[Bounded], g: Bounded, step: int) -> list[Bounded]:
    w, lr, power = slot[0], _const(opt.lr), float(np.float32(-opt.lr_power))
    n, z = slot[1], slot[2]
    n_new = n + g * g
    ulps = 0.5 if power == 0.5 else POW_ULPS  # x ** 0.5 is a correctly rounded sqrt
    p_new = n_new.monotone(lambda x: x**power, ulps)
    p_old = n.monotone(lambda x: x**power, ulps)
    z_new = z + (g - ((p_new - p_old) / lr) * w)
    quadratic = p_new / lr + _const(2.0 * opt.l2)
    l1 = float(np.float32(opt.l1))
    sign = Bounded(np.sign(z_new.v), np.where(np.abs(z_new.v) <= z_new.e, 2.0, 0.0))
    shrunk = (sign * Bounded.of(l1) - z_new) / quadratic
    # Where |z| is within its error of l1 the float32 code may take either branch.
    either = np.abs(np.abs(z_new.v) - l1) <= z_new.e
    above = np.abs(z_new.v) > l1
    w_v = np.where(above, shrunk.v, 0.0)
    w_e = np.where(either, np.abs(shrunk.v) + shrunk.e, np.where(above, shrunk.e, 0.0))
    return [Bounded(w_v, w_e), n_new, z_new]


def _adagrad64(opt: Any, slot: list[Bounded], g: Bounded, step: int) -> list[Bounded]:
    s = slot[1] + g * g
    return [slot[0] - (_const(opt.lr) * g) / (s.monotone(np.sqrt) + _const(opt.eps)), s]


def _momentum64(opt: Any, slot: list[Bounded], g: Bounded, step: int) -> list[Bounded]:
    lr, momentum = _const(opt.lr), _const(opt.momentum)
    b = slot[1] * momentum + g
    return [slot[0] - lr * (g + momentum * b if opt.nesterov else b), b]


def _rmsprop64(opt: Any, slot: list[Bounded], g: Bounded, step: int) -> list[Bounded]:
    v = slot[1] * _const(opt.alpha) + _const(1.0 - opt.alpha) * (g * g)
    return [slot[0] - _const(opt.lr) * (g / (v.monotone(np.sqrt) + _const(opt.eps))), v]


def _sgd64(opt: Any, slot: list[Bounded], g: Bounded, step: int) -> list[Bounded]:
    return [slot[0] - _const(opt.lr) * g]


# optim.py's documented formula of each registered optimizer, by kind.
FLOAT64_STEPS = {
    "sgd": _sgd64,
    "momentum": _momentum64,
    "nesterov": _momentum64,
    "adagrad": _adagrad64,
    "adam": _adam64,
    "rmsprop": _rmsprop64,
    "ftrl": _ftrl64,
}


def _float64_step(opt: Any, rows: np.ndarray, grads: np.ndarray, step: int) -> list[Bounded]:
    """optim.py's documented formulas in float64 on the same float32 rows and gradients, in
    the float32 code's order of operations: the new [weights, state slots...], bounded."""
    if opt.kind not in FLOAT64_STEPS:
        raise AssertionError(f"FLOAT64_STEPS expected a float64 reference of {opt!r}, got none")
    dim = grads.shape[1]
    slot = [Bounded.of(rows[:, k * dim : (k + 1) * dim]) for k in range(opt.size_factor)]
    return FLOAT64_STEPS[opt.kind](opt, slot, Bounded.of(grads), step)


def assert_within(what: str, got: np.ndarray, expected: list[Bounded]) -> None:
    """got (float32 [n, slots * dim]) within the bound of each slot's float64 value."""
    dim = expected[0].v.shape[1]
    for k, slot in enumerate(expected):
        part = got[:, k * dim : (k + 1) * dim].astype(np.float64)
        assert np.all(np.isfinite(slot.e)), f"{what}: slot {k} has no finite bound"
        off = np.abs(part - slot.v) - slot.e
        worst = np.unravel_index(int(np.argmax(off)), off.shape)
        assert off[worst] <= 0, (
            f"{what}: slot {k} element {worst} is {part[worst]!r}, float64 reference "
            f"{slot.v[worst]!r} +- {slot.e[worst]!r} (off by {off[worst] + slot.e[worst]!r})"
        )


def _reference_step(opt: Any, arena: np.ndarray, ids: np.ndarray, grads: np.ndarray, step: int):
    """The generic path: gather, optimizer.apply, scatter."""
    block = arena[ids]
    opt.apply(block, grads, step)
    arena[ids] = block


@pytest.mark.parametrize("dim", [1, 5, 32, 40])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fused_optimizer_matches_apply(backend: Backend, name: str, dim: int) -> None:
    """Each step starts both paths from the same float32 rows; both must land within the
    derived bound of the float64 update, and where every operation is correctly rounded the
    host build must equal numpy bit for bit."""
    opt = OPTIMIZERS[name]
    rng = np.random.default_rng(dim)
    rows, width = 64, opt.size_factor * dim + 2  # + 2 stored step slots, never touched
    arena = rng.standard_normal((rows, width), dtype=np.float32)
    for slot, fill in enumerate(opt.state_fill(), start=1):
        arena[:, slot * dim : (slot + 1) * dim] = fill
    reference = arena.copy()
    for step in range(1, 5):
        ids = rng.permutation(rows)[: int(rng.integers(1, rows))].astype(np.int64)
        grads = rng.standard_normal((ids.size, dim), dtype=np.float32)
        grads[0, 0] = 0.0  # FTRL's sign(0), Adam's zero moment
        before = reference.copy()
        expected = _float64_step(opt, before[ids], grads, step)
        _reference_step(opt, reference, ids, grads, step)
        device = backend.dev(before)
        assert kernels.fused_apply(
            opt, device, backend.dev(ids), backend.dev(grads), step, launch=backend.launch
        )
        got = to_host(device)
        assert_within(f"{name} apply, step {step}", reference[ids], expected)
        assert_within(f"{backend.name} {name} kernel, step {step}", got[ids], expected)
        others = np.setdiff1d(np.arange(rows), ids)
        np.testing.assert_array_equal(got[others], before[others])
        np.testing.assert_array_equal(got[:, -2:], before[:, -2:])  # the step slots
        if backend.xp is np and exact(opt):
            np.testing.assert_array_equal(got, reference)


def test_the_float64_bound_catches_a_wrong_update() -> None:
    """The bound is tight enough to fail: an FTRL whose lr is 1e-4 off (or one ulp of power
    off, what a float32 exponent could be) falls outside it somewhere."""
    rng = np.random.default_rng(5)
    dim = 32
    for opt, wrong in [
        (OPTIMIZERS["ftrl-power"], optim.FTRL(lr=0.05 * (1 + 1e-4), lr_power=-0.3, l2=0.1)),
        (OPTIMIZERS["adam"], optim.Adam(lr=0.01 * (1 + 1e-4), beta1=0.8, beta2=0.99, eps=1e-6)),
    ]:
        rows = rng.standard_normal((64, opt.size_factor * dim), dtype=np.float32)
        for slot, fill in enumerate(opt.state_fill(), start=1):
            rows[:, slot * dim : (slot + 1) * dim] = fill
        grads = rng.standard_normal((64, dim), dtype=np.float32)
        expected = _float64_step(opt, rows, grads, 1)
        right, bad = rows.copy(), rows.copy()
        opt.apply(right, grads, 1)
        wrong.apply(bad, grads, 1)
        assert_within("right", right, expected)
        with pytest.raises(AssertionError, match="float64 reference"):
            assert_within("wrong", bad, expected)


# numpy >= 2.4 groups its dispatched AVX-512 code as X86_V4 / AVX512_ICL / AVX512_SPR, older
# numpy as AVX512F, AVX512_SKX, ...: disable whichever this numpy dispatches.
_PROBE_AVX512 = """
import numpy._core._multiarray_umath as m
print(" ".join(f for f in m.__cpu_dispatch__ if f.startswith("AVX512") or f == "X86_V4"))
"""


@pytest.mark.slow  # a subprocess
def test_ftrl_power_holds_without_numpys_avx512_kernels() -> None:
    """numpy picks its float32 power kernel by CPU at import: run the FTRL cases again in a
    process where NPY_DISABLE_CPU_FEATURES turns its AVX-512 code off, so both are proven."""
    probe = subprocess.run(
        [sys.executable, "-c", _PROBE_AVX512], capture_output=True, text=True, check=True
    )
    features = probe.stdout.split()
    if not features:
        pytest.skip("this numpy dispatches no AVX-512 code: nothing to turn off")
    if os.environ.get("NPY_DISABLE_CPU_FEATURES"):
        pytest.skip("already running with NPY_DISABLE_CPU_FEATURES set")
    env = {**os.environ, "NPY_DISABLE_CPU_FEATURES": " ".join(features)}
    check = (
        "import numpy._core._multiarray_umath as m; "
        f"assert not any(m.__cpu_features__[f] for f in {features!r}), 'still enabled'"
    )
    subprocess.run([sys.executable, "-W", "error::ImportWarning", "-c", check], env=env, check=True)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"{__file__}::test_fused_optimizer_matches_apply",
            "-k",
            "emu-index and ftrl",
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, f"without AVX-512 ({features}):\n{done.stdout[-3000:]}"
    cases = 4 * sum(name.startswith("ftrl") for name in OPTIMIZERS)  # 4 dims each
    assert f"{cases} passed" in done.stdout, done.stdout[-3000:]


def test_fused_apply_declines_what_it_cannot_do(backend: Backend) -> None:
    class MyAdam(optim.Adam):
        pass

    arena = backend.dev(np.ones((4, 6), dtype=np.float32))
    ids, grads = backend.dev(np.arange(2)), backend.dev(np.ones((2, 2), np.float32))
    assert not kernels.fused_apply(MyAdam(), arena, ids, grads, 1, launch=backend.launch)
    assert not kernels.has_fused(MyAdam()) and kernels.has_fused(optim.Adam())
    as_f64 = backend.dev(np.ones((4, 6)))
    assert not kernels.fused_apply(optim.Adam(), as_f64, ids, grads, 1, launch=backend.launch)
    columns = backend.dev(np.ones((6, 4), np.float32)).T  # rows not contiguous
    assert not kernels.fused_apply(optim.Adam(), columns, ids, grads, 1, launch=backend.launch)
    np.testing.assert_array_equal(to_host(arena), 1.0)
    if backend.xp is np:  # numpy without a launcher: the host path is the array code
        assert not kernels.fused_apply(optim.SGD(), arena, ids, grads, 1)
    with pytest.raises(ValueError, match="arena rows"):
        kernels.fused_apply(optim.Adam(), arena[:, :5], ids, grads, 1, launch=backend.launch)


def test_emulation_checks_argument_types(emu_lib: ctypes.CDLL) -> None:
    """The emulated launcher refuses what cupy would silently misread (so the glue's types
    are checked here once for both)."""
    launch = EmuLauncher(emu_lib)
    table_keys = np.full(16, EMPTY, dtype=np.int64)
    with pytest.raises(AssertionError, match="mask"):
        launch("tierps_find", 1, (table_keys, 15, table_keys, np.int64(1), table_keys))
    with pytest.raises(AssertionError, match="slots"):
        launch(
            "tierps_find",
            1,
            (table_keys, np.int64(15), table_keys, np.int64(1), table_keys.astype(np.int32)),
        )


# --------------------------------------------------------------------------- the tier on them


@pytest.mark.parametrize("optimizer", each(), ids=kind_id)
@pytest.mark.parametrize("setup", ["gpu_tiny_host_tiny", "gpu_lfu", "gpu_steps"])
def test_the_gpu_tier_on_the_kernels_holds_the_reference_rows(
    tmp_path: Path, emu_lib: ctypes.CDLL, setup: str, optimizer: optim.Optimizer
) -> None:
    """The contract suite's trace through a table whose GPU tier runs every kernel it would
    on a GPU (find_rows, find, claim/upsert, the fused optimizer) in the host build, threads
    shuffled: the same rows and optimizer state as the unbounded reference."""
    emulated = EmuLauncher(emu_lib, order="shuffle", seed=3)
    launched: set[str] = set()

    def launch(name: str, threads: int, args: Any) -> None:
        launched.add(name)
        emulated(name, threads, args)

    config = contract.make_config(setup, optimizer)
    reference = contract.ReferenceTable(config)
    with EmbeddingStore(tmp_path / "db", gpu_arrays="numpy") as store:
        table = store.create_table(config)
        gpu = CacheTier(
            config, config.gpu_cache_bytes, xp=np, name="gpu", trains_in_place=True, kernels=launch
        )
        assert table.tiers[0].name == "gpu" and table.tiers[0].rows == 0
        table.tiers[0] = gpu  # the same tier, its index and optimizer on the kernels
        assert gpu.index.uses_kernels
        contract.run_trace(table, reference, seed=11)
        contract.assert_same_rows(table, reference)
        assert gpu.hits > 0 and table.spilled > 0
    assert {"tierps_find", "tierps_find_rows"} <= launched
    assert launched & {"tierps_claim", "tierps_upsert"}
    assert kernels.has_fused(optimizer) and kernels.FUSED[optimizer.kind].kernel in launched


@pytest.mark.parametrize("order", ["emu-shuffle", "emu-interleaved"])
def test_the_kernels_spilling_at_a_power_of_two_budget_rarely_rebuild(
    request: pytest.FixtureRequest, order: str
) -> None:
    """The GPU tier's index (claims in the kernel) keeps test_tombstones.py's rebuild bound,
    checked against the same dict oracle after every batch."""
    backend = make_backend(order, request, seed=5)
    live = 1 << 11
    table = HashTable(live, xp=np, kernels=backend.table_kernels)
    assert table.uses_kernels and table.slots == 2 * live
    k = live // 16
    tombstones.spill_batches(table, live, k, seed=1)
    assert table.spill_rebuilds <= tombstones.rebuild_bound(table, live, k, tombstones.BATCHES)


def test_a_rebuild_whose_claim_kernel_fails_leaves_the_table_as_it_was(
    emu_lib: ctypes.CDLL,
) -> None:
    """Out of GPU memory (or a launch failure) inside the rebuild's claim: the table is as
    it was, and the next try rebuilds."""
    emulated = EmuLauncher(emu_lib, order="shuffle", seed=2)
    fail = [False]

    def launch(name: str, threads: int, args: Any) -> None:
        if fail[0] and name == "tierps_claim":
            raise MemoryError("injected: out of memory in the claim")
        emulated(name, threads, args)

    table = HashTable(64, kernels=launch)
    keys = np.arange(1, 65, dtype=np.int64)
    slots, _ = table.insert(keys)
    table.values[slots] = keys * 7
    table.erase(keys[:40])
    oracle = {int(key): int(key) * 7 for key in keys[40:]}
    before = (table.keys_at(np.arange(table.slots)).copy(), table.values.copy(), table.size)
    fail[0] = True
    with pytest.raises(MemoryError, match="injected"):
        table.reserve(36)  # 24 live + 36 fit at 128 slots, 64 used + 36 do not: a rebuild
    after = (table.keys_at(np.arange(table.slots)), table.values, table.size)
    for was, now in zip(before, after, strict=True):
        np.testing.assert_array_equal(now, was)
    assert table.rebuilds == 0 and table.tombstones == 40
    tombstones.assert_matches(table, oracle, absent=keys[:40])
    fail[0] = False
    assert table.reserve(36) and table.rebuilds == 1 and table.tombstones == 0
    tombstones.assert_matches(table, oracle, absent=keys[:40])


# --------------------------------------------------------------------------- gpu_module


def _fake_cupy(kernel: Any) -> ModuleType:
    """A cupy that finds a GPU (is_available() is True) whose arrays are numpy's, with
    RawKernel as given: what cannot be made here is a GPU whose NVRTC fails."""
    fake = ModuleType("cupy")
    fake.is_available = lambda: True  # type: ignore[attr-defined]
    fake.int64 = np.int64  # type: ignore[attr-defined]
    fake.arange = np.arange  # type: ignore[attr-defined]
    fake.asnumpy = np.asarray  # type: ignore[attr-defined]
    fake.RawKernel = kernel  # type: ignore[attr-defined]
    return fake


def _nvrtc_missing(source: str, name: str) -> Any:
    raise RuntimeError("CompileException: cannot open libnvrtc-builtins.so.12")


class _DoesNothing:
    """A kernel that 'runs' but computes nothing (a broken driver or a mis-set device)."""

    def __init__(self, source: str, name: str) -> None:
        assert "tierps_proof" in source and name == "tierps_proof"

    def __call__(self, grid: Any, block: Any, args: Any) -> None:
        pass


@pytest.fixture
def fresh_gpu_module(monkeypatch: pytest.MonkeyPatch) -> Any:
    """gpu_module() and the kernels' launcher asked again, then forgotten again."""
    from tierps.core.xp import gpu_module

    gpu_module.cache_clear()
    monkeypatch.setattr(kernels, "_cupy_launcher", None)
    monkeypatch.setattr(kernels, "_cupy_failure", None)
    yield gpu_module
    gpu_module.cache_clear()


@pytest.mark.parametrize(
    ("kernel", "cause"),
    [(_nvrtc_missing, "libnvrtc-builtins"), (_DoesNothing, "gave [1, 2, 3, 4]")],
    ids=["compile-fails", "wrong-result"],
)
def test_a_gpu_whose_kernels_fail_is_not_used(
    fresh_gpu_module: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    kernel: Any,
    cause: str,
) -> None:
    from tierps.storage import TableConfig

    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(kernel))
    with caplog.at_level("WARNING", logger="tierps.storage"):
        module, why = fresh_gpu_module()
        assert module is None and cause in why and "test kernel" in why
        assert fresh_gpu_module() == (None, why)  # cached: one proof, one warning
        assert kernels.cupy_launcher() is None and kernels.unavailable_reason() == why
        with EmbeddingStore(tmp_path / "db", gpu_arrays="auto") as store:
            table = store.create_table(TableConfig("t", 4, gpu_cache_bytes=1 << 20))
            assert "gpu" not in [tier.name for tier in table.tiers]
            keys = np.arange(5, dtype=np.int64)
            np.testing.assert_array_equal(
                table.lookup(keys), table.config.initial_rows(keys)[:, :4]
            )
    messages = [r.getMessage() for r in caplog.records]
    assert sum("no GPU tier" in m and cause in m for m in messages) == 1
    assert any("no GPU is usable" in m and cause in m and "'t'" in m for m in messages)


def test_a_gpu_whose_kernels_work_is_used(
    fresh_gpu_module: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same proof passes where the kernel adds 1 (the fake runs it on numpy)."""

    class AddsOne(_DoesNothing):
        def __call__(self, grid: Any, block: Any, args: Any) -> None:
            x, n = args
            x[: int(n)] += 1

    fake = _fake_cupy(AddsOne)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    assert fresh_gpu_module() == (fake, "")
