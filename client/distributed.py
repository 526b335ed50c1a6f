"""Many trainers against one cluster: data-parallel training with torch.distributed.

Launch the trainers with `torchrun`. Each rank makes its own EmbeddingClient and embedding
modules (tierps.client.torch), wraps the dense part in DistributedDataParallel as usual, and
hands its embedding modules to a TrainerGroup, which coordinates their pushes with the other
ranks over a gloo process group of its own (so that it never interleaves with DDP's
collectives) and counts the job's steps:

    dist.init_process_group("gloo")                       # torchrun set the env
    client = EmbeddingClient(addresses)
    ebc = EmbeddingBagCollection(client, features)
    model = DistributedDataParallel(Dense())
    group = TrainerGroup(client, [ebc], mode="sync")
    state = group.load_checkpoint(ckpt_dir)                # None: a new job
    for batch in group.pipeline(my_share_of(loader, skip=group.step), (ebc, features_of)):
        loss = loss_fn(model(ebc(batch.sparse), batch.dense), batch.labels)
        loss.backward()                                    # pushes, with the others
        optimizer.step(); optimizer.zero_grad()
        if group.step % 1000 == 0:
            group.save_checkpoint(ckpt_dir, {"model": model.state_dict(), ...})

Every rank must take the same number of steps (as DDP requires), and a module's features
must be the same, in the same order, on every rank.

Consistency modes (`mode`):

- "sync" (the default): each key has one owning rank (k % world size, key_owners), and
  each step backward sends the gradients of each of the rank's distinct keys to the key's
  owner only (exchange_gradients: an all_to_all of counts, then one of the keys and their
  gradients, every table packed into it); each rank sums the gradients of the keys
  it owns over the ranks, in rank order, divides by the world size (the mean over the
  global batch, as DDP averages the dense gradients) and pushes them, so each key's update
  is pushed once. Every rank then waits until all ranks' pushes are acknowledged (one
  all_gather of a flag per rank, which also tells every rank of a failed push) before any
  looks up the next step. Training equals one trainer taking the ranks' batches together
  as one, up to the order of float summation. Costs: a rank sends its distinct keys and
  their gradients once (plus 2 counts per table and rank), and the lookups of step t + 1
  wait for step t's pushes.
- "async" with `staleness` k >= 1: each rank pushes its own gradients in the background
  (the modules run at staleness 1), without waiting for the others; the dense part stays
  synchronous under DDP. A lookup for step t sees every rank's pushes of steps <= t - 1 - k
  (Persia's hybrid): before each step's lookups the ranks agree, by one all_reduce of two
  integers, on the step up to which all their pushes are acknowledged, and a rank whose own
  pushes lag waits for them. A key two ranks push at one step gets two optimizer updates.
  Faster (pushes overlap the next steps' work), but not the global batch's training.

The observed staleness (how many steps of other ranks' pushes a step's lookup may miss) is
`TrainerGroup.staleness_seen` and the Prometheus histogram
`tierps_trainer_sparse_staleness_steps` of the trainer process.

One step clock for every table: a push of step t carries t, the job's step, on every rank
and for every table, so Adam's and FTRL's bias corrections, eviction's steps_to_live and the
snapshot see the same step whatever the number of trainers (a table not pushed at some step
sees that step go by, as with a global step). A new group starts from the largest step its
tables hold on the cluster (EmbeddingClient.table_step), and load_checkpoint from the step
the checkpoint saved.

Job checkpoints: save_checkpoint is a consistent cut across all ranks, at a step boundary
with no push in flight: every rank waits for its pushes, a barrier, then rank 0 saves the
shards' snapshot and the dense state it is given (torch.save) under one id, and records it
as the latest only once both are written. load_checkpoint loads the latest into the cluster
and returns the dense state on every rank.

A trainer that dies: a rank killed mid-step may leave a push of that step applied on some
shards and not others; the other ranks' next collective fails, so they are told and stop,
and `torchrun --max-restarts` restarts the job, whose load_checkpoint puts back every row
of the last checkpoint (a snapshot load replaces whole tables), erasing the half push.
"""

from __future__ import annotations

import json
import os
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from prometheus_client import Histogram

from tierps.client.admin import ClusterAdmin
from tierps.client.embedding import EmbeddingClient
from tierps.client.group_protocol import GroupMember, KeyGradients
from tierps.client.torch import PipelinedModule, collection_of, pipeline

MODES = ("sync", "async")
# The environment torchrun needs for --max-restarts to work: with the rendezvous store shared
# by the agent (torch's default), a restarted rank may read a rank's address of the previous
# attempt and fail to connect (pytorch/pytorch#135712, seen here with gloo under load).
RESTARTABLE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
LATEST = "latest.json"  # in a checkpoint directory: the id of the latest whole checkpoint
# Each checkpoint's id (and its snapshot's name) starts so: <prefix><step>-<random>
CHECKPOINT_PREFIX = "ckpt-step"

STALENESS_SEEN = Histogram(
    "tierps_trainer_sparse_staleness_steps",
    "Steps of other ranks' pushes a training step's lookups may miss (TrainerGroup, async: "
    "at most its staleness; sync: 0)",
    buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32),
)

Item = TypeVar("Item")


class TrainerGroupError(RuntimeError):
    """A push of another rank failed: this step's update is missing on some shards."""


class TrainerGroup:
    """The sparse side of data-parallel training: this rank's embedding modules, pushing
    with the other ranks' (see the module docstring for the modes, the step clock,
    checkpoints and a rank that dies).

    client: this rank's EmbeddingClient (the modules' client). modules: this rank's
    EmbeddingBagCollection / EmbeddingBag modules, the same on every rank; the group sets
    their staleness (sync: 0; async: 1) and owns their pushes. mode: "sync" or "async";
    staleness: async's bound k >= 1 (sync: 0). admin: what saves and loads the checkpoints'
    snapshots on rank 0 (default: client; where the shards check tokens, that needs the
    admin role, which a trainer's token lacks). Needs torch.distributed initialized; making
    a group is a collective call (every rank makes its groups in the same order)."""

    def __init__(
        self,
        client: EmbeddingClient,
        modules: Sequence[PipelinedModule],
        *,
        mode: str = "sync",
        staleness: int = 0,
        admin: ClusterAdmin | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "TrainerGroup: torch.distributed expected initialized (init_process_group, "
                "as under torchrun), got none"
            )
        if mode not in MODES:
            raise ValueError(f"TrainerGroup: mode expected one of {MODES}, got {mode!r}")
        if isinstance(staleness, bool) or not isinstance(staleness, int):
            raise ValueError(f"TrainerGroup: staleness expected an int, got {staleness!r}")
        if mode == "sync" and staleness != 0:
            raise ValueError(
                f"TrainerGroup: staleness expected 0 in sync mode (every push applied before "
                f"the next step's lookups), got {staleness}; use mode='async' for a bound"
            )
        if mode == "async" and staleness < 1:
            raise ValueError(
                f"TrainerGroup: staleness expected >= 1 in async mode (a lookup may miss up "
                f"to that many steps of other ranks' pushes), got {staleness}; use "
                f"mode='sync' for none"
            )
        self.client = client
        self.admin = admin if admin is not None else client
        self.mode = mode
        self.staleness = staleness
        self.modules: list[GroupMember] = [collection_of(module) for module in modules]
        for module in self.modules:
            if module.client is not client:
                raise ValueError(
                    "TrainerGroup: every module expected on the group's client, got one "
                    f"on another (features {[f.name for f in module.features]})"
                )
            if module.group is not None and module.group is not self:
                raise ValueError(
                    f"TrainerGroup: module of features {[f.name for f in module.features]} "
                    f"expected in one group, but another group has it"
                )
        for module in self.modules:  # all checked: now take them
            module.join_group(self, staleness=0 if mode == "sync" else 1)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # the group's own collectives: never interleaved with DDP's on the default group
        self._collectives = dist.new_group(backend="gloo")
        self.tables = sorted({f.table for module in self.modules for f in module.features})
        # the job's step: the last step begun (0: none); rank 0's reading of the cluster
        clock = max((client.table_step(t) for t in self.tables), default=0) if self.rank == 0 else 0
        self.step = self._agree(clock)
        self.staleness_seen = 0  # the latest step's observed staleness
        self.max_staleness_seen = 0
        self._pending: deque[tuple[int, Future[Any]]] = deque()  # async: pushes in flight

    # -- collectives -------------------------------------------------------------------------

    def _agree(self, value: int) -> int:
        """Rank 0's value, on every rank (a broadcast)."""
        box = torch.tensor([value], dtype=torch.int64)
        dist.broadcast(box, src=0, group=self._collectives)
        return int(box.item())

    def _together(self, work: Callable[[], Any], refused: str) -> None:
        """Run `work` on this rank, then tell every rank whether any rank's failed (an
        all_gather of one flag per rank, also a barrier): this rank's own error is raised
        (noting the ranks that failed), another's as TrainerGroupError(refused + the ranks),
        so that no rank waits for one that gave up."""
        error: BaseException | None = None
        try:
            work()
        except Exception as failure:
            error = failure
        flags = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(flags, torch.tensor([int(error is not None)]), group=self._collectives)
        failed = [rank for rank, flag in enumerate(flags) if int(flag.item())]
        if error is not None:
            error.add_note(
                f"tierps: failed on rank {self.rank} (ranks failed: {failed}); {refused}"
            )
            raise error
        if failed:
            raise TrainerGroupError(f"{refused} (ranks failed: {failed})")

    # -- steps -------------------------------------------------------------------------------

    def pipeline(
        self, items: Iterable[Item], *modules: tuple[PipelinedModule, Callable[[Item], Any]]
    ) -> Iterator[Item]:
        """Yield the items in order, one step each: group.step counts them on from the
        step the group started at (or load_checkpoint restored), and the pushes of an
        item's backward carry it. Before an item is yielded, each (module, inputs) given
        starts the lookup of the next item (as tierps.client.torch.pipeline); in async mode
        the ranks first agree that those lookups are within the staleness bound. After
        the last item, every module is flushed."""

        def begin_step(more: bool) -> None:
            self.step += 1
            if self.mode == "async":  # the earliest lookup started before the next yield
                self._bound_staleness(self.step + 1 if more and modules else self.step)

        try:
            yield from pipeline(items, *modules, before_each=begin_step)
        finally:  # a loop left early: its pushes still finish (a failure: next call)
            for module in self.modules:
                module.wait_for_pushes()
        self.flush()

    def flush(self) -> None:
        """Wait until every push of this rank's modules is applied; raise a failed one."""
        for module in self.modules:
            module.flush()
        self._pending.clear()

    # -- pushes (the modules' backward calls them: group_protocol.PushGroup) -------------------

    def push_together(self, pushes: KeyGradients) -> None:
        """Sync mode's push of one module at group.step: the ranks exchange their per-key
        gradients by key owner (exchange_gradients), each pushes the mean gradients of the
        keys it owns, then every rank learns whether all shares were applied."""
        if self.world_size == 1:  # the gradients are the global batch's already
            self.client.push_unique(pushes, self.step)
            return
        owned, _ = exchange_gradients(pushes, self.tables, self._collectives)
        self._together(
            lambda: self.client.push_unique(owned, self.step),
            f"step {self.step}'s push failed, so its update of the keys the failed ranks own "
            f"is missing on some shards; resume from the last checkpoint",
        )

    def track(self, step: int, pushed: Future[Any]) -> None:
        """Async mode: a push of `step` handed to a module's background thread."""
        self._pending.append((step, pushed))

    def _bound_staleness(self, lookup_step: int) -> None:
        """Async mode, before lookups for `lookup_step` start: wait for this rank's pushes
        of steps <= lookup_step - 1 - staleness, then agree with the other ranks on the step
        every rank's pushes are applied up to (an all_reduce MIN, also carrying whether a
        rank's push failed). Records the observed staleness."""
        need = lookup_step - 1 - self.staleness
        while self._pending and (self._pending[0][0] <= need or self._pending[0][1].done()):
            wait_for([self._pending.popleft()[1]])
        # this rank's pushes are applied up to: the step before its oldest one in flight,
        # else every step before the current one (the current step pushes later)
        applied = self._pending[0][0] - 1 if self._pending else self.step - 1
        failed = any(module.push_failed for module in self.modules)
        box = torch.tensor([applied, -int(failed)], dtype=torch.int64)
        dist.all_reduce(box, op=dist.ReduceOp.MIN, group=self._collectives)
        if int(box[1].item()) < 0:
            for module in self.modules:
                module.raise_push_failure()  # this rank's own failure, if it is one
            raise TrainerGroupError(
                f"step {self.step}: another rank's background push failed, so its update is "
                f"missing on some shards; resume from the last checkpoint"
            )
        seen = max(0, lookup_step - 1 - int(box[0].item()))
        if seen > self.staleness:  # cannot happen: every rank waited for `need` above
            raise AssertionError(f"staleness {seen} above the bound {self.staleness}")
        self.staleness_seen = seen
        self.max_staleness_seen = max(self.max_staleness_seen, seen)
        STALENESS_SEEN.observe(seen)

    # -- checkpoints -------------------------------------------------------------------------

    def save_checkpoint(self, directory: str | os.PathLike[str], state: Any = None) -> str:
        """A consistent cut of the job at the end of group.step, on every rank at once: each
        rank waits for its pushes (no push in flight anywhere), then rank 0 saves the shards'
        snapshot and `state` (the dense model's and optimizer's state_dict, for instance;
        torch.save) under one id in `directory` (shared by the ranks), then marks it the
        latest. Returns the id (also the snapshot's name)."""
        self._together(  # a barrier: every push is in
            self.flush,
            f"checkpoint at step {self.step}: a push failed, so no consistent cut exists; "
            f"resume from the last checkpoint",
        )
        checkpoint = f"{CHECKPOINT_PREFIX}{self.step:010d}-{uuid.uuid4().hex[:8]}"

        def save() -> None:
            root = Path(directory)
            root.mkdir(parents=True, exist_ok=True)
            self.admin.save_snapshot(checkpoint)
            saved = {
                "step": self.step,
                "world_size": self.world_size,
                "mode": self.mode,
                "snapshot": checkpoint,
                "state": state,
            }
            _write_atomically(root / f"{checkpoint}.pt", lambda f: torch.save(saved, f))
            latest = json.dumps({"checkpoint": checkpoint, "step": self.step}).encode()
            _write_atomically(root / LATEST, lambda f: f.write(latest))

        # the others must not wait for a cut that failed
        self._together(save if self.rank == 0 else _nothing, f"checkpoint at step {self.step}")
        return checkpoint

    def load_checkpoint(self, directory: str | os.PathLike[str]) -> Any:
        """Resume from the latest checkpoint in `directory`, on every rank at once: rank 0
        loads its snapshot into the cluster (every table of it replaced whole), then each
        rank reads the saved state and group.step becomes the saved step. Returns the
        state given to save_checkpoint, or None where `directory` holds no checkpoint
        (group.step is then unchanged)."""
        self.flush()
        root = Path(directory)
        latest = root / LATEST
        checkpoint = json.loads(latest.read_bytes())["checkpoint"] if latest.exists() else None
        self._together(  # every rank after the load
            lambda: (
                self.admin.load_snapshot(checkpoint)
                if self.rank == 0 and checkpoint is not None
                else None
            ),
            f"loading checkpoint {checkpoint!r}",
        )
        if checkpoint is None:
            return None
        saved = torch.load(root / f"{checkpoint}.pt", weights_only=False)
        self.step = int(saved["step"])
        return saved["state"]


def key_owners(keys: np.ndarray, world_size: int) -> np.ndarray:
    """The rank that owns each key in sync mode (sums its gradients over the ranks and
    pushes it): k % world_size, for keys >= 0. The shards place keys by the same rule
    (k % num_shards), so a batch's distinct keys spread over the ranks as evenly as the
    cluster spreads them over the shards, which it needs anyway; and a rank's keys lie on
    num_shards / gcd(num_shards, world_size) shards (one where the world size is a multiple
    of the shards), so each rank's push reaches fewer shards than a slice of all keys
    would. Keys with a stride that shares a factor with the world size (all even keys on 2
    ranks, say) land on fewer ranks, as they land on fewer shards."""
    return keys % world_size


_PAD = np.zeros(1, np.int32)  # the word that makes a destination's payload even


def exchange_gradients(
    pushes: KeyGradients, tables: Sequence[str], group: Any = None
) -> tuple[KeyGradients, int]:
    """Sync mode's exchange, a collective call of every rank of `group` (gloo): each rank
    sends each key's gradients only to the key's owner (key_owners), and gets back, per
    table, the distinct keys it owns and their gradients summed over the ranks (float32,
    each key's in rank order), divided by the world size: the mean over the global batch.

    pushes: this rank's per-table distinct keys >= 0 and their gradients [u, dim] (a table
    may be missing, or have no keys). tables: every table a push may name, the same list on
    every rank (it indexes the counts). Returns the owned keys' mean gradients (tables that
    received no key left out) and the bytes this rank passed to the collectives.

    Two all_to_alls: one of counts (per destination and table: the keys, and this rank's
    dim of the table, 0 where it has none), then one payload of 32-bit words, destination by
    destination: its keys (int64, two words each) table by table, then their gradients
    (float32) table by table, padded to an even number of words so that every
    destination's keys stay 8-byte aligned. A rank so passes its distinct keys' keys and
    gradients once, plus 2 * tables * world_size counts and at most a word a destination."""
    unknown = sorted(set(pushes) - set(tables))
    if unknown:  # a caller's mistake, found before any collective
        raise ValueError(
            f"exchange_gradients: pushes expected of the group's tables {list(tables)}, got "
            f"tables {unknown} besides"
        )
    world = dist.get_world_size(group)
    # per destination: each table's number of keys, then this rank's dim of it (0: none)
    counts = np.zeros((world, 2, len(tables)), np.int64)
    keys_to: list[list[np.ndarray]] = [[] for _ in range(world)]  # per destination, as words
    grads_to: list[list[np.ndarray]] = [[] for _ in range(world)]
    for t, table in enumerate(tables):
        if table not in pushes:
            continue
        keys = np.asarray(pushes[table][0], np.int64)
        owners = key_owners(keys, world)
        by_owner = np.argsort(owners, kind="stable")
        # new C-ordered arrays: each destination's slice is contiguous, seen as words
        keys = keys[by_owner]
        grads = np.asarray(pushes[table][1], np.float32)[by_owner]
        counts[:, 0, t] = np.bincount(owners, minlength=world)
        counts[:, 1, t] = grads.shape[1]
        bounds = np.concatenate([[0], np.cumsum(counts[:, 0, t])])
        for rank in range(world):
            rows = slice(bounds[rank], bounds[rank + 1])
            keys_to[rank].append(keys[rows].view(np.int32))
            grads_to[rank].append(grads[rows].reshape(-1).view(np.int32))
    received = torch.empty(counts.size, dtype=torch.int64)
    dist.all_to_all_single(received, torch.from_numpy(counts.reshape(-1)), group=group)
    got = received.numpy().reshape(world, 2, len(tables))  # per source
    dims = _agreed_dims(got[:, 1, :], tables)
    send_words = (2 * counts[:, 0, :] + counts[:, 0, :] * counts[:, 1, :]).sum(axis=1)
    parts = []
    for rank in range(world):
        parts += keys_to[rank] + grads_to[rank] + ([_PAD] if send_words[rank] % 2 else [])
    sent = np.concatenate(parts) if parts else np.empty(0, np.int32)
    send_words = _even(send_words)
    receive_words = _even((2 * got[:, 0, :] + got[:, 0, :] * dims).sum(axis=1))
    words = torch.empty(int(receive_words.sum()), dtype=torch.int32)
    dist.all_to_all_single(
        words,
        torch.from_numpy(sent),
        output_split_sizes=receive_words.tolist(),
        input_split_sizes=send_words.tolist(),
        group=group,
    )
    owned = _summed_by_key(words.numpy(), receive_words, got[:, 0, :], dims, tables)
    for _, summed in owned.values():
        summed /= np.float32(world)  # the mean over the global batch, as DDP's
    return owned, counts.nbytes + sent.nbytes


def _even(words: np.ndarray) -> np.ndarray:
    """Word counts rounded up to even (int64)."""
    return words + words % 2


def _agreed_dims(dims: np.ndarray, tables: Sequence[str]) -> np.ndarray:
    """Each table's dim, from the ranks' [source, table] dims (0: the rank has none of
    it). Every rank sees every rank's dims, so every rank refuses a disagreement alike."""
    agreed = dims.max(axis=0)
    for t, table in enumerate(tables):
        differ = {int(d) for d in dims[:, t] if d} - {int(agreed[t])}
        if differ:
            by_rank = {rank: int(d) for rank, d in enumerate(dims[:, t]) if d}
            raise ValueError(
                f"exchange_gradients: table {table!r}'s gradients expected of one dim on "
                f"every rank, got dims by rank {by_rank}"
            )
    return agreed


def _summed_by_key(
    words: np.ndarray,
    source_words: np.ndarray,
    counts: np.ndarray,
    dims: np.ndarray,
    tables: Sequence[str],
) -> KeyGradients:
    """The received payload (source by source, source_words words each, laid out as
    exchange_gradients sends it, with counts [source, table] keys) summed per key and
    table, each key's gradients added in rank order."""
    pieces: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
    start = 0
    for source, source_counts in enumerate(counts):
        keys = words[start : start + 2 * source_counts.sum()].view(np.int64)
        grads = words[start + keys.nbytes // 4 : start + source_words[source]].view(np.float32)
        start += source_words[source]
        at_key = at_grad = 0
        for t in np.flatnonzero(source_counts):
            n, width = source_counts[t], source_counts[t] * dims[t]
            pieces.setdefault(int(t), []).append(
                (keys[at_key : at_key + n], grads[at_grad : at_grad + width].reshape(n, -1))
            )
            at_key, at_grad = at_key + n, at_grad + width
    summed: KeyGradients = {}
    for t, parts in sorted(pieces.items()):
        table_keys = np.concatenate([k for k, _ in parts])
        order = np.argsort(table_keys, kind="stable")  # a key's gradients stay in rank order
        table_keys = table_keys[order]
        starts = np.flatnonzero(np.concatenate([[True], table_keys[1:] != table_keys[:-1]]))
        grads_sorted = np.concatenate([g for _, g in parts])[order]
        summed[tables[t]] = (table_keys[starts], np.add.reduceat(grads_sorted, starts, axis=0))
    return summed


def _nothing() -> None:
    """What a rank other than 0 does of a checkpoint's writing."""


def _write_atomically(path: Path, write: Callable[[Any], Any]) -> None:
    """Write a file whole or not at all: to a temporary name, synced, then renamed."""
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(temporary, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
