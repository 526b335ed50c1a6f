"""What a killed process leaves behind is collected at the next start, with real faults:
subprocesses that stage a snapshot load's rows into RocksDB, or write a snapshot part, are
killed with SIGKILL mid-way; the next open of the store (or start of the shard) removes what
they left, logs it with its bytes, and leaves every live row, live save and committed
snapshot as it was."""

from __future__ import annotations

import json
import logging
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from rocksdict import Rdict

from tierps.server.config import ServerConfig
from tierps.server.shard import Shard
from tierps.storage import TableConfig, init, optim
from tierps.storage.snapshot_format import MANIFEST, part_name
from tierps.storage.snapshot_reader import Snapshot
from tierps.storage.snapshot_writer import commit, write_part
from tierps.storage.store import EmbeddingStore

DIM = 32
TABLE = TableConfig("t", DIM, initializer=init.Normal(0.0, 0.1), optimizer=optim.Adagrad())
LIVE_ROWS = 20_000
STAGED_ROWS = 120_000  # per kill: ~30 MB of staged rows (weights and Adagrad state)
WAIT_S = 60.0

# A child that opens the store, stages TABLE's rows as a snapshot load does, says so once
# they are on disk, and waits to be killed. argv: store path, rows to stage, seed.
STAGE = """
import sys, time
import numpy as np
from tierps.storage.store import EmbeddingStore
store = EmbeddingStore(sys.argv[1])
config = store.table("t").config
staged = store.stage_table(config)
rng = np.random.default_rng(int(sys.argv[3]))
for start in range(0, int(sys.argv[2]), 10_000):
    keys = np.arange(start, start + 10_000, dtype=np.int64)
    staged.rows.write(keys, rng.normal(size=(keys.size, config.row_width)).astype(np.float32))
store._db.flush_wal(True)
print("staged", staged.families[0], flush=True)
time.sleep(600)
"""

# A child that stages rows and installs them, and is killed after the install's atomic write
# but before it drops the column family it replaced (it waits there). argv: store path, rows.
INSTALL = """
import sys, time
import numpy as np
from tierps.storage.store import EmbeddingStore

def wait_there(self, families):
    print("installed", *families, flush=True)
    time.sleep(600)

EmbeddingStore._drop_families = wait_there
store = EmbeddingStore(sys.argv[1])
config = store.table("t").config
staged = store.stage_table(config)
keys = np.arange(int(sys.argv[2]), dtype=np.int64)
staged.rows.write(keys, np.full((keys.size, config.row_width), 0.25, np.float32))
store.install_staged([staged])
"""

# A child that writes one shard's snapshot part, says so after its first chunk, and waits
# there (holding the part's writing marker) to be killed. argv: root, name, save id, shard,
# shards.
WRITE_PART = """
import sys, time
import numpy as np
from tierps.storage import TableConfig
from tierps.storage.snapshot_writer import write_part
root, name, save_id, shard, shards = sys.argv[1:6]
config = TableConfig("t", 32)

def chunks():
    for start in range(0, 40_000, 10_000):
        keys = np.arange(start, start + 10_000, dtype=np.int64) * int(shards) + int(shard)
        yield keys, np.ones((keys.size, config.row_width), np.float32)
        print("writing", flush=True)
        time.sleep(600)

for _ in write_part(root, name, save_id, int(shard), int(shards), [(config, chunks())], 0):
    pass
"""


def child(script: str, *args: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(process: subprocess.Popen[str], word: str) -> str:
    """The child's first line, which must start with `word`, within WAIT_S."""
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], WAIT_S)
    line = process.stdout.readline() if ready else ""
    if not line.startswith(word):
        process.kill()
        _, errors = process.communicate(timeout=WAIT_S)
        raise AssertionError(f"child did not say {word!r} in {WAIT_S} s: {line!r} {errors}")
    return line.strip()


def kill_9(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=WAIT_S) == -signal.SIGKILL
    for stream in (process.stdout, process.stderr):
        if stream is not None:
            stream.close()


def tree_bytes(path: Path, *, info_logs: bool = True) -> int:
    """Bytes of the files under path; info_logs=False leaves out RocksDB's text logs (LOG,
    LOG.old.*: each open of a store rotates them, whatever it holds)."""
    return sum(
        p.stat().st_size
        for p in path.rglob("*")
        if p.is_file() and (info_logs or not p.name.startswith("LOG"))
    )


def rows_files(path: Path) -> int:
    """Bytes of RocksDB's SST files and write-ahead logs: where rows are."""
    return sum(p.stat().st_size for p in path.iterdir() if p.suffix in (".sst", ".log"))


def rows_bits(store: EmbeddingStore) -> tuple[np.ndarray, np.ndarray]:
    chunks = list(store.table("t").durable.export(10_000))
    return np.concatenate([k for k, _ in chunks]), np.concatenate([r for _, r in chunks]).view(
        np.uint32
    )


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:  # a failed test must not leave one behind
        if process.poll() is None:
            process.kill()
            process.wait(timeout=WAIT_S)


def live_store(path: Path) -> Path:
    """A store at path with one table of LIVE_ROWS trained rows."""
    with EmbeddingStore(path) as store:
        table = store.create_table(TABLE)
        keys = np.arange(LIVE_ROWS, dtype=np.int64)
        table.apply_gradients(keys, np.full((keys.size, DIM), 0.5, np.float32), step=1)
    return path


@pytest.mark.slow  # a subprocess
def test_staged_families_of_loads_killed_mid_staging_are_dropped_at_the_next_open(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, children: list[subprocess.Popen[str]]
) -> None:
    path = live_store(tmp_path / "db")
    with EmbeddingStore(path) as store:  # one more clean open: the files as a restart has them
        live = rows_bits(store)
    before, before_data = tree_bytes(path), tree_bytes(path, info_logs=False)
    before_rows = rows_files(path)

    staged = []
    for kill in range(3):
        process = child(STAGE, path, STAGED_ROWS, kill)
        children.append(process)
        staged.append(wait_for(process, "staged").split()[1])
        kill_9(process)
    after_kills = tree_bytes(path)
    # each child's open dropped what the child before it staged: only the last one's is left
    assert [cf for cf in Rdict.list_cf(str(path)) if "@" in cf] == [staged[-1]]

    with caplog.at_level(logging.WARNING, logger="tierps.storage"):
        store = EmbeddingStore(path)
    try:
        assert list(store.orphans_dropped) == [staged[-1]]
        assert store.orphans_dropped[staged[-1]] > 10 << 20
        for family, size in store.orphans_dropped.items():
            assert any(
                family in r.message and f"{size} bytes" in r.message for r in caplog.records
            ), (family, caplog.text)
        assert [cf for cf in Rdict.list_cf(str(path)) if "@" in cf] == []
        keys, bits = rows_bits(store)
        assert np.array_equal(keys, live[0]) and np.array_equal(bits, live[1])
    finally:
        store.close()
    restarted, restarted_data = tree_bytes(path), tree_bytes(path, info_logs=False)
    print(
        f"\ndata dir: {before} bytes before ({before_data} without RocksDB's info logs), "
        f"{after_kills} after 3 kills mid-staging, {restarted} after the restart "
        f"({restarted_data})"
    )
    assert after_kills > before + (10 << 20)
    # the rows: RocksDB's tables and write-ahead log, exactly; its OPTIONS and MANIFEST files
    # are rewritten at each open, a few KiB either way
    assert rows_files(path) <= before_rows
    assert restarted_data <= before_data + (64 << 10)


def test_the_family_a_load_replaced_is_dropped_when_the_load_was_killed_after_its_swap(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, children: list[subprocess.Popen[str]]
) -> None:
    path = live_store(tmp_path / "db")
    process = child(INSTALL, path, 1000)
    children.append(process)
    assert wait_for(process, "installed").split()[1:] == ["table.t"]  # the replaced family
    kill_9(process)
    with caplog.at_level(logging.WARNING, logger="tierps.storage"):
        store = EmbeddingStore(path)
    try:
        assert list(store.orphans_dropped) == ["table.t"]
        assert "'table.t'" in caplog.text and "bytes" in caplog.text
        assert "table.t" not in Rdict.list_cf(str(path))
        keys, bits = rows_bits(store)  # the load's rows are the live ones: it was installed
        assert np.array_equal(keys, np.arange(1000))
        assert np.array_equal(
            bits, np.full((1000, TABLE.row_width), 0.25, np.float32).view(np.uint32)
        )
    finally:
        store.close()


def test_a_part_whose_writer_was_killed_is_removed_at_the_shards_start_and_nothing_else(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, children: list[subprocess.Popen[str]]
) -> None:
    """One snapshot dir shared by two clusters of 2 shards. At shard 0's start:
    - its part of a save killed mid-write (no header, marker unlocked) is removed;
    - the same part name being written now by a live process (the other cluster's shard 0)
      is left, and so are a committed snapshot and a whole part of a save not committed."""
    root = tmp_path / "snapshots"
    killed = child(WRITE_PART, root, "daily", "killedsave", 0, 2)
    live = child(WRITE_PART, root, "daily", "livesave", 0, 2)
    children += [killed, live]
    wait_for(killed, "writing")
    wait_for(live, "writing")
    kill_9(killed)
    abandoned = root / "daily" / "killedsave" / part_name(0, 2)
    writing = root / "daily" / "livesave" / part_name(0, 2)
    assert (abandoned / "t.keys").stat().st_size == 80_000  # the first chunk's keys
    abandoned_bytes = (
        tree_bytes(abandoned) + (abandoned.parent / f".{abandoned.name}.writing").stat().st_size
    )

    config = TableConfig("t", DIM)

    def whole_part(name: str, save_id: str, shard: int) -> None:
        keys = np.arange(shard, 200, 2, dtype=np.int64)
        rows = np.ones((keys.size, config.row_width), np.float32)
        list(write_part(root, name, save_id, shard, 2, [(config, iter([(keys, rows)]))], 0))

    whole_part("committed", "done", 0)
    whole_part("committed", "done", 1)
    commit(root, "committed", "done")
    whole_part("uncommitted", "waiting", 0)
    kept = {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and p != abandoned}
    kept = {p: data for p, data in kept.items() if abandoned not in p.parents}
    kept.pop(abandoned.parent / f".{abandoned.name}.writing")

    with caplog.at_level(logging.WARNING, logger="tierps.storage"):
        shard = Shard(
            ServerConfig(shard_id=0, num_shards=2, data_dir=tmp_path / "d0", snapshot_dir=root)
        )
    shard.close()
    assert not abandoned.exists()
    assert not (abandoned.parent / f".{abandoned.name}.writing").exists()
    lines = [r.message for r in caplog.records if str(abandoned) in r.message]
    assert len(lines) == 1 and f"{abandoned_bytes} bytes" in lines[0], caplog.text
    for path, data in kept.items():  # the live writer's files, the committed and whole parts
        assert path.read_bytes() == data, path
    assert (writing / "t.keys").exists()
    Snapshot(root, "committed").verify()

    kill_9(live)  # now that writer is dead too: the next start removes its part
    shard = Shard(
        ServerConfig(shard_id=0, num_shards=2, data_dir=tmp_path / "d0", snapshot_dir=root)
    )
    shard.close()
    assert not writing.exists()
    assert (root / "uncommitted" / "waiting" / f"{part_name(0, 2)}.json").exists()
    assert json.loads((root / "committed" / MANIFEST).read_text())["save_id"] == "done"
