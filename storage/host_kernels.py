"""Compiled kernels for the host tier: numba twins of storage/kernels.py's CUDA kernels over
numpy arrays, and fused host-only passes (lookup with the eviction touch, training with
the finiteness check, step stamp and dirty flag, initial rows). How they compile and the
switch that turns them off are core/compiled.py's, shared with the client's kernels.

The numpy array code (storage/hash_table.py, core/optim.py, core/init.py) stays the
reference: tests/unit/test_host_kernels.py and tests/unit/test_kernels.py run both on the
same inputs. `host_launcher()` returns a `kernels.Launcher` running these, or None where
numba is missing or TIERPS_HOST_KERNELS=0 (then the host tier runs the array code).

Every kernel is `njit(nogil=True, cache=True)`: it releases the GIL, so calls on different
tables run on different cores, and its machine code is cached on disk. Where the cache
lives (docs/architecture.md, "Compiled host kernels"): NUMBA_CACHE_DIR when set; else
numba's own choice, the package's __pycache__ when writable, else a per-user cache
directory. If neither is writable (a read-only install under a user without a home), the
kernels are compiled in memory at each start, with one warning.

Float arithmetic follows the CUDA source statement by statement in float32 (hyper-parameters
arrive as np.float32, so nothing widens to float64), without fastmath, so no FMA
contraction or reassociation: results match numpy's to the rounding of sqrt and pow.
"""

from __future__ import annotations

import platform
import types
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tierps.core import init, optim
from tierps.core.compiled import (
    CARRY,
    EXPONENT,
    EXPONENT_LOW_BIT,
    home_slot,
    jit_kernel,
    mix64_scalar,
    numba,
    unavailable_reason,
)
from tierps.core.config import TableConfig
from tierps.core.hashing import GOLDEN, seed_stream
from tierps.core.xp import array_module
from tierps.storage import kernels

_EMPTY = np.int64(np.iinfo(np.int64).min)
_TOMBSTONE = np.int64(_EMPTY + 1)
_S40 = np.uint64(40)
_TWO_POW_M24 = 2.0**-24
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


AHEAD = 8  # rows (or slots) a kernel prefetches ahead: random rows cost memory latency
# A probe's slots are prefetched from the key's home slot to home + 2: a quarter of the
# keys of a table at its usual load (0.25-0.5) lie past their home, and with 24-byte slots
# home + 2's key is often on the next line. Measured on 1M keys, the kernel without and
# with it alternated in one process (15-21 rounds, 4 runs): 0.70-0.76x -> 0.75-0.83x
# np.take at dim 64, 0.40-0.45x -> 0.48-0.49x at dim 16; home + 1 gained half as much,
# a longer lead (slots or rows), group prefetching and a branch-free probe did not gain.
PROBE_SPAN = 2
TRAIN_AHEAD = 4  # rows the training loops prefetch ahead (12 lines each for Adam at dim 64)
# and their dirty flags' lines: measured with cold caches on 65,536 random rows of 1M,
# the loop 1.35-1.45x faster at SGD dim 16 (a row is one line, its flag another), 1.04x at
# Adam dim 64; 6 rows ahead instead of 4 measured the same
RING = 16  # k_lookup's ring of the slots in flight: a power of two > AHEAD
STREAM_BYTES = 4 << 20  # outputs this large are written by non-temporal stores (_streams)
LINE = 64  # bytes of a cache line
# the training loops save rows of this many bytes or more by non-temporal stores (where _streams):
# measured on 65,536 random rows, faster at 768 bytes, alike at 256-384, 1.2-1.7x slower
# at 64-192 (a line or a few a row, between random reads)
TRAIN_STREAM_BYTES = 512


def aligned_empty(rows: int, columns: int) -> np.ndarray:
    """np.empty((rows, columns), float32) whose data starts on a cache line (numpy's own
    start 16 bytes into one), so that the kernels may stream rows into it (_streams)."""
    raw = np.empty(rows * columns * 4 + LINE, dtype=np.uint8)
    start = -raw.ctypes.data % LINE
    return raw[start : start + rows * columns * 4].view(np.float32).reshape(rows, columns)


# k_lookup's mode bits: what it writes besides the rows
LOOKUP_SLOTS, LOOKUP_DIRTY, LOOKUP_MISSED, LOOKUP_ROW_IDS = 1, 2, 4, 8


if numba is not None:
    from llvmlite import ir as _ir
    from numba.core import types as _types
    from numba.extending import intrinsic as _intrinsic

    def _emit_prefetch(builder: Any, pointer: Any, write: int) -> None:
        """A call of llvm.prefetch on an i8* `pointer`: for a read (write=0) or a write
        (1), locality 3 (keep in all caches), the data cache (1)."""
        i32 = _ir.IntType(32)
        kind = _ir.FunctionType(_ir.VoidType(), [_ir.IntType(8).as_pointer(), i32, i32, i32])
        module = builder.module
        name = "llvm.prefetch.p0i8"
        function = module.globals.get(name) or _ir.Function(module, kind, name=name)
        builder.call(function, [pointer, i32(write), i32(3), i32(1)])

    def _prefetcher(write: int) -> Callable:
        """An intrinsic prefetching the cache line `offset` bytes from the start of an
        array's data (llvm.prefetch: a hint, so an address past it is harmless), for a
        read (write=0) or a write (1). A byte offset, not an element index, so that it
        serves strided views too (the host index's interleaved columns: `_at`). The
        kernels walk rows in a random order, where latency, not bandwidth, bounds them:
        prefetching AHEAD rows brings a fused update to np.take's pace."""

        def prefetch(typingctx, array, offset):  # noqa: ARG001 - numba's signature
            def codegen(context, builder, signature, args):
                data = context.make_array(signature.args[0])(context, builder, args[0]).data
                byte_ptr = _ir.IntType(8).as_pointer()
                _emit_prefetch(
                    builder, builder.gep(builder.bitcast(data, byte_ptr), [args[1]]), write
                )
                return context.get_dummy_value()

            return _types.void(array, offset), codegen

        prefetch.__name__ = f"_prefetch_{'write' if write else 'read'}"
        return _intrinsic(prefetch)

    _prefetch = _prefetcher(0)
    _prefetch_for_write = _prefetcher(1)

    @_intrinsic
    def _stream16(typingctx, target, source):  # noqa: ARG001 - numba's signature
        """Copy 16 bytes from address `source` to address `target` (16-byte aligned) with
        a non-temporal store: it goes to memory without reading the target line into the
        cache first (a plain store reads it: a third of a large copy's memory traffic)
        and without evicting what the caches hold. Ordered by _store_fence. Addresses,
        not arrays: a compiled helper taking arrays counts their references atomically
        at each call."""
        if not (isinstance(target, _types.Integer) and isinstance(source, _types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            vector = _ir.VectorType(_ir.FloatType(), 4).as_pointer()
            value = builder.load(builder.inttoptr(args[1], vector), align=4)
            store = builder.store(value, builder.inttoptr(args[0], vector), align=16)
            store.set_metadata("nontemporal", builder.module.add_metadata([_ir.IntType(32)(1)]))
            return context.get_dummy_value()

        return _types.void(target, source), codegen

    @_intrinsic
    def _prefetch_address(typingctx, address):  # noqa: ARG001 - numba's signature
        """Prefetch the cache line at `address` for a read (as _prefetch)."""
        if not isinstance(address, _types.Integer):
            return None

        def codegen(context, builder, signature, args):
            _emit_prefetch(builder, builder.inttoptr(args[0], _ir.IntType(8).as_pointer()), 0)
            return context.get_dummy_value()

        return _types.void(address), codegen

    @_intrinsic
    def _store_fence(typingctx):  # noqa: ARG001 - numba's signature
        """A full fence: the non-temporal stores before it are visible to every thread
        (they are weakly ordered) before anything after it."""

        def codegen(context, builder, signature, args):
            if _X86:  # LLVM's seq_cst fence is a locked add there, which need not order them
                module = builder.module
                name = "llvm.x86.sse.sfence"
                kind = _ir.FunctionType(_ir.VoidType(), [])
                builder.call(module.globals.get(name) or _ir.Function(module, kind, name=name), [])
            else:
                builder.fence("seq_cst")
            return context.get_dummy_value()

        return _types.void(), codegen

    @jit_kernel
    def _streams(target, columns):
        """Whether rows of `columns` float32 written into the 2-D float32 matrix `target`
        go by non-temporal stores (_stream16): only for a large target (STREAM_BYTES: a
        small one is read again from the cache soon), whose rows are whole cache lines
        (64-byte multiples, 64-byte aligned: a partly written line costs the memory a
        read and a write, slower than a plain store; `aligned_empty` makes such arrays)."""
        return (
            target.shape[0] * columns * 4 >= STREAM_BYTES
            and columns * 4 % LINE == 0
            and target.strides[1] == 4
            and target.strides[0] % LINE == 0
            and target.ctypes.data % LINE == 0
        )

    @jit_kernel
    def _stream_bytes(target, source, size):
        """`size` bytes (a multiple of 16) from address `source` to address `target` by
        non-temporal stores (the caller checked _streams and fences after its last one)."""
        for b in range(0, size, 16):
            _stream16(target + b, source + b)

    @jit_kernel
    def _stream_row(target, source, size):
        """_stream_bytes with loops of a constant trip count for the common row sizes,
        which LLVM unrolls (a loop over a run-time count cost a lookup a tenth)."""
        if size == 256:
            _stream_bytes(target, source, 256)
        elif size == 64:
            _stream_bytes(target, source, 64)
        elif size == 512:
            _stream_bytes(target, source, 512)
        elif size == 128:
            _stream_bytes(target, source, 128)
        else:
            _stream_bytes(target, source, size)

    @jit_kernel
    def _prefetch_bytes(address, size):
        """Prefetch the cache lines of `size` bytes from `address`."""
        for k in range(0, size, 64):
            _prefetch_address(address + k)

    @jit_kernel
    def _prefetch_span(address, size):
        """_prefetch_bytes with constant trip counts for the common row sizes."""
        if size == 256:
            _prefetch_bytes(address, 256)
        elif size == 64:
            _prefetch_bytes(address, 64)
        elif size == 512:
            _prefetch_bytes(address, 512)
        elif size == 128:
            _prefetch_bytes(address, 128)
        else:
            _prefetch_bytes(address, size)

    @jit_kernel
    def _at(array, index):
        """The byte offset of element `index` of a 1-D array (strided or not)."""
        return index * array.strides[0]

    @jit_kernel
    def _prefetch_row_for_write(matrix, row):
        """Prefetch every cache line of row `row` of a row-major matrix, to write it."""
        start = row * matrix.strides[0]
        for k in range(0, matrix.shape[1] * matrix.itemsize, 64):
            _prefetch_for_write(matrix, start + k)

    @jit_kernel
    def _probe(table, mask, key):
        if key <= _TOMBSTONE:
            return -1
        pos = home_slot(key, mask)
        for _ in range(mask + 1):
            seen = table[pos]
            if seen == key:
                return pos
            if seen == _EMPTY:
                return -1
            pos = (pos + 1) & mask
        return -1

    @jit_kernel
    def _claim_one(table, mask, key):
        """(slot, code) as tierps_claim_one: code 2 took an EMPTY slot, 1 a tombstone, 0
        found the key (placed earlier in the batch) or no free slot (slot -1)."""
        pos = home_slot(key, mask)
        for _ in range(mask + 1):
            seen = table[pos]
            if seen <= _TOMBSTONE:
                table[pos] = key
                return pos, 2 if seen == _EMPTY else 1
            if seen == key:
                return pos, 0
            pos = (pos + 1) & mask
        return -1, 0

    @jit_kernel
    def k_find(table, mask, keys, n, slots):
        for i in range(n):
            if i + AHEAD < n:
                home = home_slot(keys[i + AHEAD], mask)
                _prefetch(table, _at(table, home))
                _prefetch(table, _at(table, (home + PROBE_SPAN) & mask))
            slots[i] = _probe(table, mask, keys[i])

    @jit_kernel
    def k_claim(table, mask, keys, todo, n, slots, inserted, codes, scores, has_scores, score):
        for i in range(n):
            j = todo[i]
            slot, code = _claim_one(table, mask, keys[j])
            slots[j] = slot
            if code:
                inserted[j] = True
                if has_scores:
                    scores[slot] = score
            codes[i] = code

    @jit_kernel
    def k_upsert(table, mask, keys, n, slots, inserted, codes, scores, has_scores, score):
        for i in range(n):
            key = keys[i]
            slot = _probe(table, mask, key)
            code = 0
            if slot < 0:
                slot, code = _claim_one(table, mask, key)
            slots[i] = slot
            if code:
                inserted[i] = True
                if has_scores:
                    scores[slot] = score
            codes[i] = code

    @jit_kernel
    def k_rehash(keys, values, scores, leaving, table, new_values, new_scores, mask):
        """HashTable._rebuilt's fill in one pass: every live key of a table (its columns
        keys, values, scores), but those of the slots where `leaving` is True (an empty
        `leaving`: none), into an empty table of mask + 1 slots (table, new_values,
        new_scores), in slot order. Its keys are distinct, so each takes the first EMPTY
        slot from its home without looking for itself. Returns how many it placed, -1 if
        the new table had no room (the caller sizes it so that it has)."""
        placed = 0
        skip = leaving.shape[0] > 0
        for s in range(keys.shape[0]):
            key = keys[s]
            if key <= _TOMBSTONE or (skip and leaving[s]):
                continue
            pos = home_slot(key, mask)
            probes = 0
            while table[pos] != _EMPTY:
                probes += 1
                if probes > mask:
                    return -1
                pos = (pos + 1) & mask
            table[pos] = key
            new_values[pos] = values[s]
            new_scores[pos] = scores[s]
            placed += 1
        return placed

    @jit_kernel
    def k_find_rows(table, values, mask, keys, n, arena, out, width, zero_misses, slots, has_slots):
        for i in range(n):
            slot = _probe(table, mask, keys[i])
            if has_slots:
                slots[i] = slot
            if slot >= 0:
                r = values[slot]
                for c in range(width):
                    out[i, c] = arena[r, c]
            elif zero_misses:
                for c in range(width):
                    out[i, c] = 0.0

    @jit_kernel
    def k_lookup(
        table,
        values,
        scores,
        mask,
        keys,
        arena,
        out,
        dirty,
        slots,
        found_dirty,
        missed,
        mode,
        tick,
        lfu,
    ):
        """The host tier's find in one pass: out[i] = the first out.shape[1] columns of the
        row of keys[i] (left as it was for a miss) and the eviction touch of each hit (LRU:
        score = tick; LFU: +1 per occurrence). `mode` bits say what else it writes:
        LOOKUP_SLOTS slots[i] (-1 for a miss), LOOKUP_ROW_IDS slots[i] = its row id
        instead (-1 for a miss), LOOKUP_DIRTY found_dirty[i] (a hit's dirty flag),
        LOOKUP_MISSED the indices of the misses in missed[:count], keys < 0
        (padding) zeroing their rows and counting as neither. Returns (hits, misses
        listed)."""
        # A software pipeline over the dependent random loads of each key: its slot (on
        # the host the slot's key, value and score share a cache line, see HashTable),
        # prefetched 2 * AHEAD keys before use; then its row, AHEAD before. The slots of
        # the keys in flight wait in a ring, so no [n] slot array is needed. A large out
        # is written by non-temporal stores (_streams); an LRU score is written only when
        # it changes, so a line read is not also written back.
        n = keys.shape[0]
        width = out.shape[1]
        want_slots = mode & LOOKUP_SLOTS
        want_ids = mode & LOOKUP_ROW_IDS
        want_dirty = mode & LOOKUP_DIRTY
        want_missed = mode & LOOKUP_MISSED
        ring = np.empty(RING, dtype=np.int64)
        stream = _streams(out, width)
        size = width * 4  # bytes copied from a row
        arena_at, arena_stride = np.int64(arena.ctypes.data), arena.strides[0]
        out_at, out_stride = np.int64(out.ctypes.data), out.strides[0]
        hits = 0
        listed = 0
        for i in range(-2 * AHEAD, n):
            ahead = i + 2 * AHEAD
            if ahead < n:
                home = home_slot(keys[ahead], mask)
                _prefetch(table, _at(table, home))
                _prefetch(table, _at(table, (home + PROBE_SPAN) & mask))
                _prefetch_for_write(scores, _at(scores, home))  # its line, if not the key's
            ahead = i + AHEAD
            if 0 <= ahead < n:
                slot = _probe(table, mask, keys[ahead])
                ring[ahead & (RING - 1)] = slot
                if slot >= 0:
                    r = values[slot]
                    _prefetch_span(arena_at + r * arena_stride, size)
                    if want_dirty:
                        _prefetch(dirty, _at(dirty, r))
            if i < 0:
                continue
            slot = ring[i & (RING - 1)]
            if want_slots or (want_ids and slot < 0):
                slots[i] = slot
            if slot < 0:
                if want_missed:
                    if keys[i] < 0:
                        for c in range(width):
                            out[i, c] = 0.0
                    else:
                        missed[listed] = i
                        listed += 1
                continue
            hits += 1
            if lfu:
                scores[slot] += 1
            elif scores[slot] != tick:  # a write only when it changes: a clean line stays so
                scores[slot] = tick
            r = values[slot]
            if want_ids:
                slots[i] = r
            if want_dirty:
                found_dirty[i] = dirty[r]
            if stream:
                _stream_row(out_at + i * out_stride, arena_at + r * arena_stride, size)
            else:
                for c in range(width):
                    out[i, c] = arena[r, c]
        if stream:
            _store_fence()
        return hits, listed

    @jit_kernel
    def k_touch(scores, slots, tick, lfu):
        for i in range(slots.shape[0]):
            if lfu:
                scores[slots[i]] += 1
            else:
                scores[slots[i]] = tick

    @jit_kernel
    def k_take_rows(arena, present, keys, out, missed):
        """A direct tier's find in one pass, a key being its own row id: out[i] = the first
        out.shape[1] columns of arena row keys[i] where present[keys[i]], zeros where
        keys[i] < 0 (padding), left as it was for the others, whose indices go to
        missed[:count]. Keys are < arena.shape[0] (the table refuses others). Each row and
        its flag are prefetched AHEAD keys before use; a large out is written by
        non-temporal stores (as k_lookup). Returns (hits, count)."""
        n = keys.shape[0]
        width = out.shape[1]
        size = width * 4  # bytes copied from a row
        stream = _streams(out, width)
        arena_at, arena_stride = np.int64(arena.ctypes.data), arena.strides[0]
        out_at, out_stride = np.int64(out.ctypes.data), out.strides[0]
        hits = 0
        listed = 0
        for i in range(n):
            if i + AHEAD < n:
                ahead = keys[i + AHEAD]
                if ahead >= 0:
                    _prefetch_span(arena_at + ahead * arena_stride, size)
                    _prefetch(present, _at(present, ahead))
            key = keys[i]
            if key < 0:
                for c in range(width):
                    out[i, c] = 0.0
            elif not present[key]:
                missed[listed] = i
                listed += 1
            else:
                hits += 1
                if stream:
                    _stream_row(out_at + i * out_stride, arena_at + key * arena_stride, size)
                else:
                    for c in range(width):
                        out[i, c] = arena[key, c]
        if stream:
            _store_fence()
        return hits, listed

    # ---------------------------------------------------------------- optimizers
    # The numba twin of each optimizer kernel of kernels.SOURCE, registered under the CUDA
    # kernel's name: the new [weights | state] of row r (gradient row i) into
    # new[:size*dim], from p, the kernel's hyper-parameters as float32 in its order
    # (kernels.FUSED). They live in this file because numba keys a cached kernel on its
    # own file only: the training loops that inline them are cached here too, so editing
    # one recompiles them.

    ROW_UPDATES: dict[str, Callable] = {}

    def _twin(kernel: str) -> Callable[[Callable], Callable]:
        def register(update: Callable) -> Callable:
            ROW_UPDATES[kernel] = compiled = jit_kernel(update)
            return compiled

        return register

    @_twin("tierps_sgd")
    def _sgd_row(arena, r, g, i, dim, p, new):
        lr = p[0]
        for c in range(dim):
            new[c] = arena[r, c] - lr * g[i, c]

    @_twin("tierps_momentum")
    def _momentum_row(arena, r, g, i, dim, p, new):
        lr, momentum, nesterov = p[0], p[1], p[2] != 0
        for c in range(dim):
            gc = g[i, c]
            b = arena[r, dim + c] * momentum
            b = b + gc
            new[dim + c] = b
            update = gc + momentum * b if nesterov else b
            new[c] = arena[r, c] - lr * update

    @_twin("tierps_adagrad")
    def _adagrad_row(arena, r, g, i, dim, p, new):
        lr, eps = p[0], p[1]
        for c in range(dim):
            gc = g[i, c]
            s = arena[r, dim + c] + gc * gc
            new[dim + c] = s
            new[c] = arena[r, c] - (lr * gc) / (np.sqrt(s) + eps)

    @_twin("tierps_adam")
    def _adam_row(arena, r, g, i, dim, p, new):
        b1, b2, step_size, eps = p[0], p[1], p[2], p[3]
        for c in range(dim):
            gc = g[i, c]
            m = arena[r, dim + c]
            v = arena[r, 2 * dim + c]
            mc = m + b1 * (gc - m)
            vc = v + b2 * (gc * gc - v)
            new[dim + c] = mc
            new[2 * dim + c] = vc
            new[c] = arena[r, c] - step_size * (mc / (np.sqrt(vc) + eps))

    @_twin("tierps_rmsprop")
    def _rmsprop_row(arena, r, g, i, dim, p, new):
        lr, alpha, one_minus_alpha, eps = p[0], p[1], p[2], p[3]
        for c in range(dim):
            gc = g[i, c]
            v = arena[r, dim + c] * alpha
            v = v + one_minus_alpha * (gc * gc)
            new[dim + c] = v
            new[c] = arena[r, c] - lr * (gc / (np.sqrt(v) + eps))

    @jit_kernel
    def _pow(x, p, use_sqrt):
        if use_sqrt:
            return np.sqrt(x)
        return x**p

    @_twin("tierps_ftrl")
    def _ftrl_row(arena, r, g, i, dim, p, new):
        lr, power, use_sqrt, l1, two_l2 = p[0], p[1], p[2] != 0, p[3], p[4]
        zero = np.float32(0.0)
        for c in range(dim):
            gc = g[i, c]
            n_old = arena[r, dim + c]
            n_new = n_old + gc * gc
            p_new = _pow(n_new, power, use_sqrt)
            p_old = _pow(n_old, power, use_sqrt)
            zc = arena[r, 2 * dim + c] + (gc - ((p_new - p_old) / lr) * arena[r, c])
            new[2 * dim + c] = zc
            quadratic = p_new / lr + two_l2
            sign = np.float32(int(zc > zero) - int(zc < zero))
            new[c] = (sign * l1 - zc) / quadratic if abs(zc) > l1 else zero
            new[dim + c] = n_new

    def _train(
        arena,
        ids,
        grads,
        p,
        size,
        refuse,
        backup,
        was_dirty,
        stamp,
        has_stamp,
        row_width,
        dirty,
    ):
        """One optimizer step in place on rows arena[ids] (unique) with grads [n, dim];
        size: weight and state slots. Row by row: the new values are computed
        (_update_row: this copy's row update), and with refuse, checked to be finite; the
        row's first backup.shape[1] floats are saved in backup[i] (by non-temporal stores
        when wide: it is read again only to undo) and its dirty flag in was_dirty[i];
        then the new values, the stamp (has_stamp: arena[r, row_width:] = stamp, the step
        slots) and the dirty flag are written. A row with a non-finite value stops the
        pass: the rows and flags written so far are put back from backup and was_dirty and
        its index i returned, nothing changed. Else -1."""
        n, dim = grads.shape
        width = size * dim
        saved = backup.shape[1]
        new = np.empty(width, dtype=np.float32)
        new_bits = new.view(np.uint32)  # the finiteness test: an integer OR, vectorised
        stream = saved * 4 >= TRAIN_STREAM_BYTES and _streams(backup, saved)
        arena_at, arena_stride = np.int64(arena.ctypes.data), arena.strides[0]
        backup_at, backup_stride = np.int64(backup.ctypes.data), backup.strides[0]
        for i in range(n):
            if i + TRAIN_AHEAD < n:
                ahead = ids[i + TRAIN_AHEAD]
                _prefetch_row_for_write(arena, ahead)
                # its dirty flag too: read and written below, a random line of its own
                _prefetch_for_write(dirty, _at(dirty, ahead))
            r = ids[i]
            _update_row(arena, r, grads, i, dim, p, new)  # noqa: F821 - each copy's global
            if refuse:
                carry = np.uint32(0)  # bit 31 set by a value whose exponent bits are all set
                for c in range(width):
                    carry |= (new_bits[c] & EXPONENT) + EXPONENT_LOW_BIT
                if carry & CARRY:  # inf or NaN; a thread reads its own streamed stores
                    for j in range(i):
                        for c in range(saved):
                            arena[ids[j], c] = backup[j, c]
                        dirty[ids[j]] = was_dirty[j]
                    return i
            if stream:
                _stream_row(backup_at + i * backup_stride, arena_at + r * arena_stride, saved * 4)
            else:
                for c in range(saved):
                    backup[i, c] = arena[r, c]
            was_dirty[i] = dirty[r]
            for c in range(width):
                arena[r, c] = new[c]
            if has_stamp:
                for c in range(stamp.shape[0]):
                    arena[r, row_width + c] = stamp[c]
            dirty[r] = True
        if stream:
            _store_fence()
        return -1

    def _train_keys(
        table,
        values,
        scores,
        mask,
        tick,
        lfu,
        keys,
        arena,
        grads,
        p,
        size,
        backup,
        was_dirty,
        stamp,
        has_stamp,
        row_width,
        dirty,
        ids,
    ):
        """_train (refuse set) on the rows of distinct keys [n] held by a host index, found
        in the same pass: the index's arrays (table, values, scores, mask; k_lookup's) are
        probed as k_lookup probes, with the eviction touch of each hit (tick, lfu), so
        the probes' cache misses overlap the rows' and no [n] row ids pass between two
        kernels. ids[i] = the row id of keys[i], -1 for a key not held (the cascade's).
        The j-th row trained is saved in backup[j] and was_dirty[j]. Returns (hits, bad):
        bad as _train's return, an index into keys, the rows written before it put back
        (every key is still probed and touched, and ids filled, as if the pass had gone
        on), or -1. Its per-row tail (the finiteness test, the save, the writes) is
        _train's, written out again on purpose: the same tail as two shared @jit_kernel
        helpers made a push of 1,200 keys at dim 16 take 2x its CPU (not inlined)."""
        n, dim = grads.shape
        width = size * dim
        saved = backup.shape[1]
        new = np.empty(width, dtype=np.float32)
        new_bits = new.view(np.uint32)
        stream = saved * 4 >= TRAIN_STREAM_BYTES and _streams(backup, saved)
        arena_at, arena_stride = np.int64(arena.ctypes.data), arena.strides[0]
        backup_at, backup_stride = np.int64(backup.ctypes.data), backup.strides[0]
        ring = np.empty(RING, dtype=np.int64)
        hits = 0
        bad = -1
        for i in range(-2 * AHEAD, n):
            ahead = i + 2 * AHEAD
            if ahead < n:
                home = home_slot(keys[ahead], mask)
                _prefetch(table, _at(table, home))
                _prefetch(table, _at(table, (home + PROBE_SPAN) & mask))
                _prefetch_for_write(scores, _at(scores, home))
            ahead = i + TRAIN_AHEAD
            if 0 <= ahead < n:
                slot = _probe(table, mask, keys[ahead])
                ring[ahead & (RING - 1)] = slot
                if slot >= 0:
                    r = values[slot]
                    _prefetch_row_for_write(arena, r)
                    _prefetch_for_write(dirty, _at(dirty, r))
            if i < 0:
                continue
            slot = ring[i & (RING - 1)]
            if slot < 0:
                ids[i] = -1
                continue
            if lfu:
                scores[slot] += 1
            elif scores[slot] != tick:  # a write only when it changes: a clean line stays so
                scores[slot] = tick
            r = values[slot]
            ids[i] = r
            _update_row(arena, r, grads, i, dim, p, new)  # noqa: F821 - each copy's global
            carry = np.uint32(0)  # bit 31 set by a value whose exponent bits are all set
            for c in range(width):
                carry |= (new_bits[c] & EXPONENT) + EXPONENT_LOW_BIT
            if carry & CARRY:  # inf or NaN; a thread reads its own streamed stores
                bad = i
                break
            if stream:
                _stream_row(
                    backup_at + hits * backup_stride, arena_at + r * arena_stride, saved * 4
                )
            else:
                for c in range(saved):
                    backup[hits, c] = arena[r, c]
            was_dirty[hits] = dirty[r]
            for c in range(width):
                arena[r, c] = new[c]
            if has_stamp:
                for c in range(stamp.shape[0]):
                    arena[r, row_width + c] = stamp[c]
            dirty[r] = True
            hits += 1
        if stream:
            _store_fence()
        if bad < 0:
            return hits, bad
        j = 0
        for k in range(bad):  # put back the rows written before the refused one
            if ids[k] >= 0:
                for c in range(saved):
                    arena[ids[k], c] = backup[j, c]
                dirty[ids[k]] = was_dirty[j]
                j += 1
        hits += 1
        for k in range(bad + 1, n):  # the rest probed and touched, as k_lookup would
            slot = _probe(table, mask, keys[k])
            ids[k] = -1 if slot < 0 else values[slot]
            if slot >= 0:
                hits += 1
                if lfu:
                    scores[slot] += 1
                else:
                    scores[slot] = tick
        return hits, bad

    def _training_loop(kernel: str, update: Callable, loop: Callable = _train) -> Callable:
        """A training loop (_train, or _train_keys) compiled for one row update: a copy of
        it whose global _update_row is `update`, so that the update is inlined with no
        per-row dispatch. A copy and not a closure: numba keys a closure's disk cache on a
        pickle of its cells, and a compiled function pickles with an id made afresh in each
        process, so a closure would compile again in every process. The copy's own name
        keeps its cache entries apart from the other copies'."""
        name = f"k{loop.__name__}_{kernel.removeprefix('tierps_')}"
        copy = types.FunctionType(
            loop.__code__, {**globals(), "_update_row": update}, name, None, None
        )
        copy.__qualname__ = name
        copy.__doc__ = loop.__doc__
        return jit_kernel(copy)

    TRAINERS: dict[str, Callable] = {
        kernel: _training_loop(kernel, update) for kernel, update in ROW_UPDATES.items()
    }
    """The compiled training loop of every optimizer kernel, by the CUDA kernel's name."""

    KEY_TRAINERS: dict[str, Callable] = {
        kernel: _training_loop(kernel, update, _train_keys)
        for kernel, update in ROW_UPDATES.items()
    }
    """The compiled training loop that finds its rows by key (_train_keys), by kernel."""

    @jit_kernel
    def _uniform_weight(base, c, span, low, below_high):
        """init.Uniform's weight of column c of the key whose counter base is `base` (bit
        for bit the numpy code: counter_bits, top 24 bits, low + span * u in float64,
        rounded to float32, capped below high): the one copy both initializers use."""
        bits = mix64_scalar(base + np.uint64(c + 1) * GOLDEN)
        u = np.float64(np.int32(bits >> _S40)) * _TWO_POW_M24  # < 2**24: exact
        value = np.float32(low + span * u)
        return value if value < below_high else below_high

    @jit_kernel
    def k_uniform_rows(keys, stream, span, low, below_high, out, fills, dim):
        """init.Uniform's weights into out[:, :dim] (_uniform_weight) and each state slot k
        filled with fills[k]."""
        for i in range(keys.shape[0]):
            base = mix64_scalar(np.uint64(keys[i]) ^ stream)
            for c in range(dim):
                out[i, c] = _uniform_weight(base, c, span, low, below_high)
            for k in range(fills.shape[0]):
                for c in range(dim):
                    out[i, (k + 1) * dim + c] = fills[k]

    @jit_kernel
    def k_uniform_rows_into(
        keys, stream, span, low, below_high, fills, zero_fill, dim, arena, ids, fresh, stamp, out
    ):
        """k_uniform_rows's rows written where they are stored: row i into arena row
        ids[i] (its weights, each state slot k filled with fills[k], then the step slots
        `stamp` when given) and its weights into out[i] too (a lookup's answer: a copy).
        A row id >= `fresh` was never used, so its memory is still the zero pages of a
        fresh mapping: a state slot whose fill is +0.0 (zero_fill[k]) is not written
        there again. The same weights as k_uniform_rows (_uniform_weight)."""
        row_width = dim * (fills.shape[0] + 1)
        for i in range(keys.shape[0]):
            r = ids[i]
            base = mix64_scalar(np.uint64(keys[i]) ^ stream)
            for c in range(dim):
                value = _uniform_weight(base, c, span, low, below_high)
                arena[r, c] = value
                out[i, c] = value
            for k in range(fills.shape[0]):
                if r >= fresh and zero_fill[k]:
                    continue
                for c in range(dim):
                    arena[r, (k + 1) * dim + c] = fills[k]
            for s in range(stamp.shape[0]):
                arena[r, row_width + s] = stamp[s]


def _null(array: Any, dtype: Any) -> tuple[Any, bool]:
    """An array argument that may be None (a null pointer on the GPU): (array, given)."""
    if array is None:
        return np.empty(1, dtype=dtype), False
    return array, True


class NumbaLauncher:
    """kernels.Launcher over numpy arrays: the same kernel names and arguments as the CUDA
    launch (storage/kernels.py), run by the compiled twins above. `threads` is ignored:
    each kernel loops over its work items."""

    def __call__(self, name: str, threads: int, args: Sequence[Any]) -> None:
        if threads <= 0:
            return
        if name == "tierps_find":
            table, mask, keys, n, slots = args
            k_find(table, mask, keys, n, slots)
        elif name == "tierps_claim":
            table, mask, keys, todo, n, slots, inserted, codes, scores, score = args
            scores, given = _null(scores, np.int64)
            k_claim(table, mask, keys, todo, n, slots, inserted, codes, scores, given, score)
        elif name == "tierps_upsert":
            table, mask, keys, n, slots, inserted, codes, scores, score = args
            scores, given = _null(scores, np.int64)
            k_upsert(table, mask, keys, n, slots, inserted, codes, scores, given, score)
        elif name == "tierps_find_rows":
            table, values, mask, keys, n, arena, _, out, _, width, _, _, zero, slots = args
            slots, given = _null(slots, np.int64)
            k_find_rows(table, values, mask, keys, n, arena, out, width, zero, slots, given)
        elif name in _KERNEL_SLOTS:
            arena, _, ids, grads, n, dim, _, *hyper = args
            empty = np.empty((n, 0), np.float32)  # nothing to put back: no refusal
            dirty = np.empty(arena.shape[0], dtype=bool)  # scratch: fused_apply sets none
            _trainer(name)(
                arena,
                ids,
                grads[:n, :dim],
                _float32(hyper),
                _KERNEL_SLOTS[name],
                False,
                empty,
                np.empty(n, bool),
                np.empty(0, np.float32),
                False,
                arena.shape[1],
                dirty,
            )
        else:
            raise ValueError(f"host kernels: field 'name' expected a kernel name, got {name!r}")


def _float32(hyper: Sequence[Any]) -> np.ndarray:
    """A kernel's hyper-parameters as the float32 array the numba twins read."""
    return np.array([float(h) for h in hyper], dtype=np.float32)


# Weight and state slots each optimizer kernel updates (optimizers sharing a kernel share
# their slots): what a launch of it, which passes none, trains.
_KERNEL_SLOTS = {
    fused.kernel: optim.OPTIMIZERS[kind].size_factor for kind, fused in kernels.FUSED.items()
}


def fused_trainer(optimizer: Any, step: int) -> tuple[Callable, np.ndarray] | None:
    """(the compiled training loop of this optimizer, its float32 hyper-parameters for
    `step`: the values its CUDA kernel gets), or None where it has no fused update (see
    kernels.fused_update). Call the loop as _train's docstring says."""
    found = kernels.optimizer_args(optimizer, step)
    if found is None:
        return None
    kernel, hyper = found
    return _trainer(kernel), _float32(hyper)


def fused_key_trainer(optimizer: Any, step: int) -> tuple[Callable, np.ndarray] | None:
    """fused_trainer's, with the loop that finds its rows by key in the host index in the
    same pass (_train_keys; call it as its docstring says)."""
    found = kernels.optimizer_args(optimizer, step)
    if found is None:
        return None
    kernel, hyper = found
    _trainer(kernel)  # the same refusal of a kernel without a twin
    return KEY_TRAINERS[kernel], _float32(hyper)


def _trainer(kernel: str) -> Callable:
    """The training loop of an optimizer kernel; a kernel without a numba twin is an error."""
    train = TRAINERS.get(kernel)
    if train is None:
        raise LookupError(
            f"host kernels: optimizer kernel {kernel!r} expected a numba twin in "
            f"host_kernels.ROW_UPDATES (every kernel of kernels.FUSED has one), got none"
        )
    return train


_launcher: NumbaLauncher | None = None


def host_launcher() -> NumbaLauncher | None:
    """The compiled host kernels, or None (numba missing, TIERPS_HOST_KERNELS=0): then the
    host tier runs the numpy array code. `unavailable_reason()` says why."""
    global _launcher
    if _launcher is None and unavailable_reason() is None:
        _launcher = NumbaLauncher()
    return _launcher


def _uniform_args(config: TableConfig) -> tuple[Any, ...]:
    """The compiled initializer's arguments of a table whose weights come from init.Uniform
    (see k_uniform_rows): the key stream, span, low, the largest value below high, fills."""
    initializer = config.initializer
    return (
        seed_stream(config.seed, 0),
        float(initializer.high - initializer.low),
        float(initializer.low),
        np.nextafter(np.float32(initializer.high), np.float32(initializer.low)),
        np.asarray(config.optimizer.state_fill(), dtype=np.float32),
    )


def initializes_in_place(config: TableConfig) -> bool:
    """Whether initial_rows_into can make this table's rows: its weights come from
    init.Uniform and the compiled host kernels run."""
    return type(config.initializer) is init.Uniform and host_launcher() is not None


def initial_rows_into(
    config: TableConfig,
    keys: np.ndarray,
    arena: np.ndarray,
    ids: np.ndarray,
    fresh: int,
    stamp: np.ndarray | None,
    out: np.ndarray,
) -> None:
    """config.initial_rows(keys) (then the step slots `stamp`, float32 [STEP_SLOTS], when
    given) written straight into arena rows ids, and their weights into out [n, dim], in
    one compiled pass: no rows array, no copy (k_uniform_rows_into). Row ids >= `fresh`
    must never have been written (zero): their zero state slots are left as they are.
    Only where initializes_in_place(config); the same bits as initial_rows."""
    stream, span, low, below_high, fills = _uniform_args(config)
    zero_fill = fills.view(np.uint32) == 0  # +0.0 only: -0.0 is written
    k_uniform_rows_into(
        np.ascontiguousarray(keys, np.int64),
        stream,
        span,
        low,
        below_high,
        fills,
        zero_fill,
        config.dim,
        arena,
        np.ascontiguousarray(ids, np.int64),
        fresh,
        np.empty(0, np.float32) if stamp is None else np.asarray(stamp, np.float32),
        out,
    )


def initial_rows(config: TableConfig, keys: Any, weights: Any = None) -> Any:
    """config.initial_rows(keys, weights), compiled where it can be: numpy keys of a table
    whose weights come from init.Uniform, with the same bits as the numpy code (a pure
    function of seed, key and column); the numpy (or cupy) code everywhere else."""
    uniform = type(config.initializer) is init.Uniform
    if weights is not None or not uniform or array_module(keys) is not np:
        return config.initial_rows(keys, weights)
    if host_launcher() is None:  # numba missing or TIERPS_HOST_KERNELS=0
        return config.initial_rows(keys, weights)
    stream, span, low, below_high, fills = _uniform_args(config)
    out = np.empty((keys.shape[0], config.row_width), dtype=np.float32)
    k_uniform_rows(keys, stream, span, low, below_high, out, fills, config.dim)
    return out
