"""Cold rows in float16 / bfloat16 against float32: bytes on disk and the MovieLens demo's AUC.

`python -m tests.bench.bench_cold_rows [--epochs 3] [--host-kib 64]` trains the demo's DeepFM
(`tierps demo`'s model, data, Adam and seed) through a local cluster of 2 shards once per
cold-row type, with a host tier of --host-kib KiB per table and shard, small enough that most
rows spill to RocksDB (so most rows are rounded whenever they go down). The baseline is the
same run with float32 cold rows, in the same process. Reported per run: the test AUC after
each epoch, the bytes of one RocksDB value (RowCodec.value_bytes) and of all rows' values,
the RocksDB tiers' SST bytes once the stopped cluster's stores are reopened and compacted
(each key's latest value only), and the data directories' size (log files included). Saves
docs/perf/cold_rows.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

RUNS = {
    "float32": {},
    "bfloat16": {"cold_dtype": "bfloat16"},
    "float16 weights, float32 state": {"cold_dtype": "float16", "cold_state_dtype": "float32"},
}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run_one(label: str, cold: dict, args: argparse.Namespace, dataset) -> dict:
    import torch

    from tierps.client import EmbeddingClient
    from tierps.demo.deepfm import SparseOptimizer, TierpsEmbeddings
    from tierps.demo.main import tier_hit_rates
    from tierps.demo.training import DEFAULT_LR, build_tierps_model, train
    from tierps.server.cluster import LocalCluster
    from tierps.storage import EmbeddingStore

    torch.manual_seed(0)
    optimizer = SparseOptimizer("adam", DEFAULT_LR)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with (
            LocalCluster(2, root / "cluster", root / "snapshots") as cluster,
            EmbeddingClient(cluster.addresses) as client,
        ):
            configs = TierpsEmbeddings.table_configs(
                dataset.features, args.dim, optimizer, host_cache_bytes=args.host_kib << 10
            )
            configs = [dataclasses.replace(config, **cold) for config in configs]
            for config in configs:
                client.create_table(config)
            model = build_tierps_model(client, dataset, dim=args.dim, staleness=0)
            started = time.perf_counter()
            try:
                results = train(model, dataset, epochs=args.epochs)
            finally:
                model.embeddings.close()
            seconds = time.perf_counter() - started
            names = [config.name for config in configs]
            hits = {
                name: {"hit_rate": round(figures["hit_rate"], 4), "rows": figures["rows"]}
                for name, figures in tier_hit_rates(client, names).items()
            }
        # the cluster stopped gracefully (every row flushed); reopened and compacted, each
        # table's files hold each key's latest value only
        tiers = {"rocksdb_rows": 0, "rocksdb_value_bytes": 0, "rocksdb_sst_bytes": 0}
        for shard_dir in sorted((root / "cluster").glob("shard-*")):
            if not shard_dir.is_dir():
                continue
            with EmbeddingStore(shard_dir / "rocksdb") as store:
                for config in configs:
                    durable = store.table(config.name).durable
                    durable.compact()  # only each key's latest value stays in the files
                    rows = sum(keys.size for keys, _ in durable.export(1 << 16))
                    tiers["rocksdb_rows"] += rows
                    tiers["rocksdb_value_bytes"] += rows * durable.codec.value_bytes
                    tiers["rocksdb_sst_bytes"] += durable.stats()["bytes"]
        on_disk = dir_bytes(root / "cluster")
        return {
            "run": label,
            "test_auc": [round(r.test_auc, 6) for r in results],
            "test_logloss": [round(r.test_logloss, 6) for r in results],
            "tiers": hits,  # each tier's share of the keys the tier above missed; its rows
            "value_bytes": configs[0].codec.value_bytes,
            **tiers,
            "data_dir_bytes": on_disk,
            "train_seconds": round(seconds, 1),
        }


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--host-kib", type=int, default=64)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("docs/perf/cold_rows.json"))
    args = parser.parse_args()
    import torch

    from tierps.demo.data import load_dataset
    from tierps.demo.main import default_torch_threads

    torch.set_num_threads(default_torch_threads(2))
    dataset = load_dataset("movielens", seed=0)
    rows = [run_one(label, cold, args, dataset) for label, cold in RUNS.items()]
    base = rows[0]
    for row in rows:
        row["value_bytes_vs_float32"] = round(row["value_bytes"] / base["value_bytes"], 3)
        for field in ("rocksdb_value_bytes", "rocksdb_sst_bytes", "data_dir_bytes"):
            row[f"{field}_vs_float32"] = round(row[field] / base[field], 3)
        row["last_auc_minus_float32"] = round(row["test_auc"][-1] - base["test_auc"][-1], 6)
        print(json.dumps(row))
    args.out.write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": rows}, indent=1)
        + "\n"
    )


if __name__ == "__main__":
    main()
