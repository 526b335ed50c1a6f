"""Shared fixtures: real stores in pytest's tmp_path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tierps.storage import EmbeddingStore, EmbeddingTable


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """torch with one intra-op thread for a test module: on this 2-core machine, with the
    shards or anything else holding a core, two threads stall torch's parallel regions (10x
    and more), and tiny tensors gain nothing from them."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[EmbeddingStore]:
    with EmbeddingStore(tmp_path / "db") as opened:
        yield opened


def export_dict(table: EmbeddingTable) -> dict[int, np.ndarray]:
    """Every stored row of a table as {key: full row}."""
    out: dict[int, np.ndarray] = {}
    for keys, rows in table.export(chunk_rows=97):
        out.update(zip(keys.tolist(), rows, strict=True))
    return out
