"""The contract between a trainer's embedding modules and the group that pushes with the
other ranks.

A module (tierps.client.torch.EmbeddingBagCollection) is a GroupMember; a TrainerGroup
(tierps.client.distributed) is a PushGroup. Each side uses the other only through the
public methods declared here, so the imports run one way: distributed -> torch ->
group_protocol, and the modules need no torch.distributed.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Protocol

import numpy as np

from tierps.client.embedding import EmbeddingClient
from tierps.client.pooled_lookup import Feature

# Per table: its distinct keys >= 0 and their summed gradients [u, dim], what one push sends.
KeyGradients = dict[str, tuple[np.ndarray, np.ndarray]]


class PushGroup(Protocol):
    """What a module in a group needs of the group: the step its pushes carry, and where
    its backward hands them."""

    @property
    def step(self) -> int:
        """The job's step: every push made in it carries this step, on every rank."""
        ...

    @property
    def mode(self) -> str:
        """ "sync": backward hands its pushes to push_together; "async": the module pushes
        them in its background thread and hands each push's future to track."""
        ...

    def push_together(self, pushes: KeyGradients) -> None:
        """Sync mode: push this rank's per-key gradients of the current step with the other
        ranks' (on the group's client, the module's); returns once every rank's share is
        applied, and raises where a rank's failed."""
        ...

    def track(self, step: int, pushed: Future[Any]) -> None:
        """Async mode: a push of `step` is in flight in a module's background thread, done
        when `pushed` is."""
        ...


class GroupMember(Protocol):
    """What a group needs of a module it pushes for: its client and features, joining, and
    its background pushes waited for and their failures seen."""

    client: EmbeddingClient
    features: Sequence[Feature]

    @property
    def group(self) -> PushGroup | None:
        """The group the module pushes with, or None (it pushes alone)."""
        ...

    def join_group(self, group: PushGroup, *, staleness: int) -> None:
        """Push with `group` from now on, at `staleness` (the group's choice): the module's
        pushes so far are applied first (flush). The group checks that the module is in no
        other group."""
        ...

    def flush(self) -> None:
        """Wait until every push of the module is applied; raise a failed one's error."""
        ...

    def wait_for_pushes(self) -> None:
        """Wait until the module's pushes in flight are done, without raising a failure
        (the module's next call raises it)."""
        ...

    @property
    def push_failed(self) -> bool:
        """Whether a background push failed and its failure is not raised yet."""
        ...

    def raise_push_failure(self) -> None:
        """Raise a background push's failure, if one is kept (once)."""
        ...
