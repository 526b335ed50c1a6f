"""Pooling on a torch device: `pooling`'s sparse product A @ E and its transpose A.T @ G,
written once in torch so that one code path serves a GPU (CUDA tensors, or cupy arrays
through DLPack) and the host (CPU tensors, which is how CI runs it).

The features of a call are pooled per group of their tables that share a dim: each step
below is a handful of torch calls for the whole group, not per feature or per table
(fbgemm's table batching: at 26 features, per-feature calls would cost more in launches than
the work they launch). For a group of T tables whose bags hold N entries (keys):

1. Check: the batch's shapes and dtypes on the host, its values (offsets, COO rows, finite
   weights) on the device into one flag, read with the dedup's sync. A batch that is not
   plainly well-formed is checked by `formats.to_bags` on host copies, which words the
   refusal exactly as the host path does (table or feature, field, expected, got).
2. Dedup: a stable sort of the entries by key, then by table (padding, keys < 0, counts as a
   table T after the real ones); each new (table, key) starts a distinct key. It is
   torch.unique's own method, done by hand for the permutation that torch.unique keeps to
   itself: that permutation groups the entries of each distinct key, which is the
   transpose of A. Only the distinct keys and T + 2 counts go to the host, for the RPC.
3. Coefficients: `pooling`'s formulas per entry; the per-bag sums of mean and sqrtn in
   float64, summed in bag order as the host's np.bincount sums them (an exact zero stays 0).
4. Forward, A @ E: embedding_bag(mode="sum") of the bags over the rows [u + 1, dim] the
   shards sent, the coefficients as per-sample weights. Row u is zeros: padding entries
   point at it, so nothing is compacted (compacting needs a sync).
5. Backward, A.T @ G: embedding_bag again, the distinct keys as its bags (their entries as
   step 2 grouped them) gathering the gradient rows of their entries' bags. No atomics (it
   is deterministic) and no [N, dim] intermediate; it yields one summed gradient per
   distinct key, what a push sends.

Only the distinct keys, the rows coming in and the per-key gradients going out cross
between host and device; the pooled outputs are torch tensors on the device (a cupy caller
takes them with cupy.from_dlpack, without a copy).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tierps.client.formats import COO, Bags, array_device, float_array, to_bags
from tierps.client.pooling import Combiner
from tierps.core.errors import InvalidArgumentError

# Combiner codes in a group's per-bag code tensor.
_SUM, _MEAN, _SQRTN = 0, 1, 2
_CODES = {Combiner.SUM: _SUM, Combiner.MEAN: _MEAN, Combiner.SQRTN: _SQRTN}


def torch_device(device: str | torch.device) -> torch.device:
    """A torch device with its index: plain "cuda" is the current CUDA device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def located(where: str, field: str, value: Any, device: torch.device) -> torch.Tensor | None:
    """`value` as a tensor on `device`, without a copy, when it is a torch tensor or a DLPack
    array (cupy) there; None for a host array (numpy, a list) of a CPU call, which the caller
    takes through the host checks. An array anywhere else is refused: a call pools on one
    device and moves nothing there behind the caller's back."""
    found = array_device(value)
    if found != str(device):
        raise InvalidArgumentError(
            f"{where}: field {field!r} expected an array on {device} (where this call pools), "
            f"got one on {found}"
        )
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, np.ndarray) or not hasattr(value, "__dlpack__"):
        return None
    return torch.from_dlpack(value)


def _host(value: Any) -> Any:
    """A host copy of an array of any device, for the host checks."""
    if hasattr(value, "__dlpack__") and not isinstance(value, np.ndarray | torch.Tensor):
        value = torch.from_dlpack(value)
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:  # numpy has no bfloat16
            value = value.to(torch.float32)
    return value


def _is_int(tensor: torch.Tensor) -> bool:
    """An integer dtype that converts to int64 exactly. uint64 takes the host checks: its
    keys over 2**63 - 1 are refused there, which torch's few uint64 kernels cannot tell."""
    return not (
        tensor.is_floating_point()
        or tensor.is_complex()
        or tensor.dtype in (torch.bool, torch.uint64)
    )


@dataclass
class _Parts:
    """A feature's bags on the device, laid out for stacking, values not checked yet: keys
    [nnz] int64, starts [B] int64 (bag i starts at entry starts[i], the last bag runs to
    nnz), weights [nnz] float32 (the group checks them finite) or None. `first` and
    `last` are CSR offsets the group checks (offsets[0] must be 0; with include_last_offset
    the last must be nnz); `checks` are 0-d bool tensors, True where the batch is bad;
    `order` is a COO's entry order, which its weights follow."""

    where: str
    keys: torch.Tensor
    starts: torch.Tensor
    weights: torch.Tensor | None
    shape: tuple[int, ...]
    first: torch.Tensor | None = None
    last: torch.Tensor | None = None
    checks: list[torch.Tensor] = field(default_factory=list)
    order: torch.Tensor | None = None

    @property
    def nnz(self) -> int:
        return int(self.keys.shape[0])

    @property
    def num_bags(self) -> int:
        return int(self.starts.shape[0])


def _from_bags(where: str, bags: Bags, device: torch.device) -> _Parts:
    """Bags the host checked, moved to the device."""
    weights = None if bags.weights is None else torch.from_numpy(bags.weights).to(device)
    keys, starts = torch.from_numpy(bags.keys), torch.from_numpy(bags.offsets[:-1])
    return _Parts(where, keys.to(device), starts.to(device), weights, bags.shape)


def feature_parts(
    where: str, value: Any, include_last_offset: bool, device: torch.device
) -> _Parts:
    """A feature's batch (dense keys; (values, offsets[, per_sample_weights]) whose values
    may be a COO; a COO; or Bags) on `device`. Shapes and dtypes are read here, values are
    checked by the group; a batch not plainly well-formed, or holding host arrays, goes
    through to_bags on the host, which refuses it in the host's words or passes it."""
    if isinstance(value, Bags):
        return _from_bags(where, value, device)
    if isinstance(value, tuple) and not isinstance(value, COO):
        if len(value) not in (2, 3):
            raise InvalidArgumentError(
                f"{where}: a tuple batch expected (values, offsets) or (values, offsets, "
                f"per_sample_weights), got {len(value)} items"
            )
        keys, offsets, weights = (*value, None)[:3]
    else:
        keys, offsets, weights = value, None, None
    coo = keys if isinstance(keys, COO) else None
    arrays = {"rows": coo.rows, "values": coo.values} if coo else {"keys": keys}
    arrays.update(offsets=offsets, per_sample_weights=weights)
    tensors = {
        name: located(where, name, array, device)
        for name, array in arrays.items()
        if array is not None
    }
    parts = None
    if all(t is not None for t in tensors.values()):
        if coo is None:
            parts = _csr(where, tensors["keys"], tensors.get("offsets"), include_last_offset)
        elif offsets is None:
            parts = _coo(where, tensors["rows"], tensors["values"], coo.shape)
        if parts is not None and weights is not None:
            keys_shape = tuple(tensors["values" if coo else "keys"].shape)
            parts = _weighted(parts, tensors["per_sample_weights"], keys_shape)
    if parts is not None:
        return parts
    host = {name: _host(array) for name, array in arrays.items()}
    batch = COO(host["rows"], host["values"], coo.shape) if coo else host["keys"]
    bags = to_bags(
        where,
        batch,
        host["offsets"],
        host["per_sample_weights"],
        include_last_offset=include_last_offset,
    )
    return _from_bags(where, bags, device)


def _csr(
    where: str, keys: torch.Tensor, offsets: torch.Tensor | None, include_last_offset: bool
) -> _Parts | None:
    """Dense keys [..., nnz] (offsets None) or CSR values with offsets; None where the shapes
    or dtypes are not those of a good batch."""
    if not _is_int(keys) or keys.dim() == 0:
        return None
    if offsets is None:  # dense: each row of the last axis is a bag
        shape, width = tuple(keys.shape[:-1]), int(keys.shape[-1])
        bags = int(np.prod(shape))
        if width:
            starts = torch.arange(0, bags * width, width, device=keys.device)
        else:
            starts = torch.zeros(bags, dtype=torch.int64, device=keys.device)
        return _Parts(where, keys.reshape(-1).to(torch.int64), starts, None, shape)
    if keys.dim() != 1 or offsets.dim() != 1 or not _is_int(offsets):
        return None
    offsets, size = offsets.to(torch.int64), int(offsets.shape[0])
    if include_last_offset:
        if size == 0:
            return None
        starts, last = offsets[:-1], offsets[-1]
    else:
        if size == 0 and keys.shape[0]:
            return None
        starts, last = offsets, None
    first = offsets[0] if size else None
    return _Parts(where, keys.to(torch.int64), starts, None, (int(starts.shape[0]),), first, last)


def _coo(where: str, rows: torch.Tensor, values: torch.Tensor, shape: Any) -> _Parts | None:
    """A COO's entries in row order (a stable sort: keys keep their order within a bag)."""
    if not (
        isinstance(shape, tuple)
        and len(shape) == 2
        and all(
            isinstance(s, int | np.integer) and not isinstance(s, bool) and s >= 0 for s in shape
        )
    ):
        return None
    if not (_is_int(rows) and _is_int(values)) or rows.dim() != 1 or rows.shape != values.shape:
        return None
    bags, rows = int(shape[0]), rows.to(torch.int64)
    ordered, order = torch.sort(rows, stable=True)
    # starts[i] = the number of entries of rows < i: where bag i begins among the sorted rows.
    starts = torch.searchsorted(ordered, torch.arange(bags, device=rows.device))
    bad = ((rows < 0) | (rows >= bags)).any()
    return _Parts(
        where, values.to(torch.int64)[order], starts, None, (bags,), checks=[bad], order=order
    )


def _weighted(parts: _Parts, weights: torch.Tensor, keys_shape: tuple[int, ...]) -> _Parts | None:
    """The parts with per-sample weights of the keys' shape (float32, in entry order);
    None where their shape or dtype is not that (the host checks word it)."""
    if tuple(weights.shape) != keys_shape:
        return None
    if not (weights.is_floating_point() or _is_int(weights)) or weights.is_complex():
        return None
    flat = weights.reshape(-1).to(torch.float32)
    parts.weights = flat if parts.order is None else flat[parts.order]
    return parts


@dataclass(frozen=True)
class FeatureSpec:
    """A feature of a call: its batch (`where` names it in messages), table and combiner."""

    name: str
    where: str
    value: Any
    table: str
    combiner: Combiner


@dataclass(frozen=True)
class _Layout:
    """A feature's place in its group: its bags [bags_lo, bags_hi) of the stacked output,
    its entries [entries_lo, entries_hi), and the leading shape of its output."""

    bags_lo: int
    bags_hi: int
    entries_lo: int
    entries_hi: int
    shape: tuple[int, ...]


class PoolingGroup:
    """The features of a call whose tables share a dim, checked, deduplicated and laid out
    for pooling on their device (the module docstring's steps 1-3). `unique[table]` are the
    table's distinct keys >= 0 (sorted, host numpy): the caller looks them up and hands
    their rows to `forward`, in the order of `tables`, plus a zero row; `backward` gives
    their gradients."""

    def __init__(
        self,
        device: torch.device,
        dim: int,
        features: Sequence[tuple[FeatureSpec, _Parts]],
        refuse: Callable[[], None],
    ) -> None:
        self.device, self.dim = device, dim
        self.tables = list(dict.fromkeys(spec.table for spec, _ in features))
        parts = [p for _, p in features]
        nnz, bags = [p.nnz for p in parts], [p.num_bags for p in parts]
        self.num_entries, self.num_bags = sum(nnz), sum(bags)
        entries, bag_base = np.cumsum([0, *nnz]), np.cumsum([0, *bags])
        self.features = {
            spec.name: _Layout(
                int(bag_base[i]),
                int(bag_base[i + 1]),
                int(entries[i]),
                int(entries[i + 1]),
                p.shape,
            )
            for i, (spec, p) in enumerate(features)
        }
        codes = [_CODES[spec.combiner] for spec, _ in features]
        table_of = [self.tables.index(spec.table) for spec, _ in features]
        lasts = [(p.last, p.nnz) for p in parts if p.last is not None]
        # Per-feature figures the device needs, in one copy: entry base, nnz, bags, table,
        # combiner, and the nnz each include_last_offset last offset must equal.
        meta = to_device(
            np.array(
                [*entries[:-1], *nnz, *bags, *table_of, *codes, *(n for _, n in lasts)],
                dtype=np.int64,
            ),
            device,
        )
        count = len(parts)
        base_d, nnz_d, bags_d, table_d, code_d = meta[: 5 * count].view(5, count)
        n, b = self.num_entries, self.num_bags

        keys = _cat([p.keys for p in parts])
        starts = _cat([p.starts for p in parts])
        if count > 1:  # each feature's starts count from its first entry in the group
            starts = starts + torch.repeat_interleave(base_d, bags_d, output_size=b)
        end = torch.full((1,), n, dtype=torch.int64, device=device)
        self.offsets = torch.cat([starts, end])  # [B + 1], as embedding_bag's CSR offsets
        checks = [check for p in parts for check in p.checks]
        if b:
            checks.append((self.offsets[1:] < self.offsets[:-1]).any())
        firsts = [p.first for p in parts if p.first is not None]
        if firsts:
            checks.append((torch.stack(firsts) != 0).any())
        if lasts:
            checks.append((torch.stack([last for last, _ in lasts]) != meta[5 * count :]).any())
        weights = None
        if any(p.weights is not None for p in parts):
            weights = _cat(
                [
                    p.weights
                    if p.weights is not None
                    else keys.new_ones(p.nnz, dtype=torch.float32)
                    for p in parts
                ]
            )
            checks.append(~torch.isfinite(weights).all())
        bad = torch.stack(checks).any() if checks else None

        self.index: torch.Tensor | None = None
        tables = len(self.tables)
        if n == 0:
            if bad is not None and bool(bad):
                refuse()
            self.num_unique = 0
            self.unique = {t: np.zeros(0, np.int64) for t in self.tables}
            self.spans = dict.fromkeys(self.tables, (0, 0))
            return

        # Step 2: dedup by (table, key), padding last as table `tables`.
        # int32 table ids: the second sort's radix passes are over 32 bits, not 64.
        table = torch.repeat_interleave(table_d.to(torch.int32), nnz_d, output_size=n)
        table = torch.where(keys < 0, tables, table)
        sorted_keys, by_key = torch.sort(keys, stable=True)
        sorted_tables, by_table = torch.sort(table[by_key], stable=True)
        order = by_key[by_table]  # entries by (table, key), in entry order within a key
        sorted_keys = sorted_keys[by_table]
        new = torch.ones(n, dtype=torch.bool, device=device)
        new[1:] = (sorted_keys[1:] != sorted_keys[:-1]) | (sorted_tables[1:] != sorted_tables[:-1])
        group_starts = torch.nonzero(new).flatten()  # syncs: its size is the distinct count
        if bad is not None and bool(bad):  # checked before anything indexes by the offsets
            refuse()
        ends = torch.cat([group_starts, end])
        bounds = torch.searchsorted(
            sorted_tables[group_starts], torch.arange(tables + 1, dtype=torch.int32, device=device)
        )
        host = (
            torch.cat([bounds, ends[bounds[tables]].reshape(1), sorted_keys[group_starts]])
            .cpu()
            .numpy()
        )
        u, live_entries = int(host[tables]), int(host[tables + 1])
        distinct = host[tables + 2 : tables + 2 + u]
        self.num_unique = u
        self.spans = {t: (int(host[i]), int(host[i + 1])) for i, t in enumerate(self.tables)}
        self.unique = {t: distinct[lo:hi] for t, (lo, hi) in self.spans.items()}

        # Each entry's distinct key; padding's distinct "keys" all point at the zero row u.
        group_of = torch.cumsum(new, 0) - 1
        self.index = torch.empty_like(group_of).scatter_(0, order, group_of).clamp_(max=u)
        bag_of = torch.repeat_interleave(
            torch.arange(b, device=device), self.offsets.diff(), output_size=n
        )
        self.coefficients = _coefficients(
            keys, weights, self.offsets, bag_of, codes, code_d, bags_d
        )
        # Step 5's CSR: distinct key j gathers its live entries, order[ends[j]:ends[j + 1]].
        live = order[:live_entries]
        self.transposed_bags = bag_of[live]
        self.transposed_offsets = ends[: u + 1]
        self.transposed_coefficients = (
            None if self.coefficients is None else self.coefficients[live]
        )

    def forward(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """The pooled rows of each feature, [*shape, dim] on the device, from the rows
        [num_unique + 1, dim] of the distinct keys in `tables` order, then a zero row."""
        expected = (self.num_unique + 1, self.dim)
        if tuple(rows.shape) != expected:
            raise ValueError(f"forward expected rows of shape {expected}, got {tuple(rows.shape)}")
        if self.index is None:
            pooled = rows.new_zeros((self.num_bags, self.dim))
        else:
            pooled = F.embedding_bag(
                self.index,
                rows,
                self.offsets,
                mode="sum",
                per_sample_weights=self.coefficients,
                include_last_offset=True,
            )
        return {
            name: pooled[at.bags_lo : at.bags_hi].view(*at.shape, self.dim)
            for name, at in self.features.items()
        }

    def backward(self, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The gradient of each distinct key's row [num_unique, dim] on the device, from the
        float32 gradients of some features' outputs (the others count as zero)."""
        for name, grad in grads.items():
            at = self.features[name]
            if tuple(grad.shape) != (*at.shape, self.dim):
                raise ValueError(
                    f"backward expected feature {name!r}'s gradient of shape "
                    f"{(*at.shape, self.dim)}, got {tuple(grad.shape)}"
                )
        blocks = [
            grads[name].reshape(-1, self.dim)
            if name in grads
            else torch.zeros((at.bags_hi - at.bags_lo, self.dim), device=self.device)
            for name, at in self.features.items()
        ]
        stacked = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
        if self.index is None or self.num_unique == 0:
            return stacked.new_zeros((self.num_unique, self.dim))
        return F.embedding_bag(
            self.transposed_bags,
            stacked,
            self.transposed_offsets,
            mode="sum",
            per_sample_weights=self.transposed_coefficients,
            include_last_offset=True,
        )

    def touched(self, names: Sequence[str]) -> torch.Tensor:
        """[num_unique] bool: the distinct keys that some entry of these features holds."""
        mask = torch.zeros(self.num_unique + 1, dtype=torch.bool, device=self.device)
        if self.index is not None:
            for name in names:
                at = self.features[name]
                mask[self.index[at.entries_lo : at.entries_hi]] = True
        return mask[: self.num_unique]

    def host_gradients(
        self, grads: Mapping[str, torch.Tensor]
    ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per table of the group, (distinct keys, their summed gradients) on the host, for
        a push: only the keys of the features in `grads` move."""
        names = [name for name in self.features if name in grads]
        if not names:
            return {}
        summed = to_host(self.backward({name: grads[name] for name in names}))
        keep = None if len(names) == len(self.features) else self.touched(names).cpu().numpy()
        out = {}
        for table, (lo, hi) in self.spans.items():
            keys, rows = self.unique[table], summed[lo:hi]
            if keep is not None:
                keys, rows = keys[keep[lo:hi]], rows[keep[lo:hi]]
            out[table] = (keys, rows)
        return out


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device`. To a GPU it goes through pinned memory without blocking:
    a copy from pageable memory would first wait for all the work queued on the device."""
    tensor = torch.from_numpy(array)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def host_buffer(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """An empty float32 host tensor to fill (through .numpy()) and send to `device` with
    .to(device, non_blocking=True): pinned for a GPU, so that copy is a DMA that queues
    behind the device's work (pinned memory comes from torch's caching allocator, which
    keeps it until the copy is done)."""
    return torch.empty(shape, dtype=torch.float32, pin_memory=device.type == "cuda")


def to_host(tensor: torch.Tensor) -> np.ndarray:
    """A device tensor's values on the host, as numpy; from a GPU through pinned memory
    (about twice the speed of a copy to pageable memory)."""
    if tensor.device.type != "cuda":
        return tensor.cpu().numpy()
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    out.copy_(tensor, non_blocking=True)
    torch.cuda.current_stream(tensor.device).synchronize()
    return out.numpy()


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _coefficients(
    keys: torch.Tensor,
    weights: torch.Tensor | None,
    offsets: torch.Tensor,
    bag_of: torch.Tensor,
    codes: list[int],
    code_d: torch.Tensor,
    bags_d: torch.Tensor,
) -> torch.Tensor | None:
    """Each entry's float32 coefficient (pooling's formulas), None for all 1 (unweighted sum)."""
    if all(code == _SUM for code in codes):
        return weights
    base = (
        weights.double() if weights is not None else keys.new_ones(keys.shape, dtype=torch.float64)
    )
    live = torch.where(keys >= 0, base, 0.0)
    # Per bag, in one call: the sum of the live weights (mean) and of their squares (sqrtn),
    # each bag summed in entry order, as np.bincount does on the host.
    sums = F.embedding_bag(
        torch.arange(keys.shape[0], device=keys.device),
        torch.stack([live, live * live], 1),
        offsets,
        mode="sum",
        include_last_offset=True,
    )
    code = torch.repeat_interleave(code_d, bags_d, output_size=int(offsets.shape[0]) - 1)
    divisor = torch.where(
        code == _MEAN, sums[:, 0], torch.where(code == _SQRTN, sums[:, 1].sqrt(), 1.0)
    )
    scale = torch.where(divisor != 0, 1.0 / divisor, 0.0)
    return (base * scale[bag_of]).to(torch.float32)


def plan(
    device: str | torch.device,
    specs: Sequence[FeatureSpec],
    dim_of: Callable[[str], int],
    include_last_offset: bool = False,
) -> list[PoolingGroup]:
    """Check and lay out the features of a call on `device`, one PoolingGroup per dim
    (tables in order of first use). Raises InvalidArgumentError for a bad batch, naming its
    feature (or table) and field, with what was expected and what came."""
    device = torch_device(device)
    parts = [feature_parts(s.where, s.value, include_last_offset, device) for s in specs]
    by_dim: dict[int, list[tuple[FeatureSpec, _Parts]]] = {}
    for spec, part in zip(specs, parts, strict=True):
        by_dim.setdefault(dim_of(spec.table), []).append((spec, part))

    def refuse() -> None:
        """A group's device checks found a bad batch: the host checks name it."""
        for spec in specs:
            value = spec.value
            if isinstance(value, Bags):
                continue
            if isinstance(value, tuple) and not isinstance(value, COO):
                keys, offsets, weights = (*(_host(v) for v in value), None)[:3]
            else:
                keys, offsets, weights = _host(value), None, None
            if isinstance(keys, COO):
                keys = COO(_host(keys.rows), _host(keys.values), keys.shape)
            to_bags(spec.where, keys, offsets, weights, include_last_offset=include_last_offset)
        raise AssertionError("the device checks refused a batch that the host checks pass")

    return [PoolingGroup(device, dim, features, refuse) for dim, features in by_dim.items()]


def checked_gradient(
    where: str, value: Any, device: torch.device, shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A pooled output's gradient as a float32 tensor on `device`, and a 0-d bool tensor that
    is True where it is not finite (None: checked already). Anything else is refused as the
    host path refuses it (float_array's words)."""
    tensor = located(where, "grad_output", value, device)
    if tensor is not None and tuple(tensor.shape) == shape and tensor.is_floating_point():
        tensor = tensor.to(torch.float32)
        return tensor, ~torch.isfinite(tensor).all()
    array = float_array(where, "grad_output", _host(value), shape, "that of the pooled output")
    return torch.from_numpy(array).to(device), None  # a host array of a CPU call, checked


def refuse_gradient(where: str, value: Any, shape: tuple[int, ...]) -> None:
    """Raise the host's refusal of a gradient the device found not finite."""
    float_array(where, "grad_output", _host(value), shape, "that of the pooled output")
    raise AssertionError(f"{where}: the device refused a gradient that the host checks pass")
