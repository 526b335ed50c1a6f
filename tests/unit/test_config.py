"""TableConfig validates itself and round-trips through its dict form."""

from __future__ import annotations

import pytest

from tests.optimizers import each, kind_id
from tierps.core.config import config_differences
from tierps.storage import Eviction, TableConfig, WritePolicy, init, optim


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        ({"name": ""}, ["'name'", "''"]),
        ({"name": "a/b"}, ["'name'", "'a/b'"]),
        ({"name": "x" * 65}, ["'name'"]),
        ({"dim": 0}, ["'dim'", "[1, 65536]", "0"]),
        ({"dim": 2.0}, ["'dim'", "int", "2.0"]),
        ({"dtype": "float16"}, ["'dtype'", "'float32'", "'float16'"]),
        ({"initializer": "normal"}, ["'initializer'", "init.", "'normal'"]),
        ({"optimizer": optim}, ["'optimizer'", "optim."]),
        ({"seed": -1}, ["'seed'", "-1"]),
        ({"host_cache_bytes": -5}, ["'host_cache_bytes'", "-5"]),
        ({"gpu_cache_bytes": True}, ["'gpu_cache_bytes'", "True"]),
        ({"eviction": "fifo"}, ["'eviction'", "['lru', 'lfu']", "'fifo'"]),
        ({"write_policy": "sometimes"}, ["'write_policy'", "'write_back'", "'sometimes'"]),
        ({"use_hashtable": False}, ["'capacity'", ">= 1 with use_hashtable=False", "got 0"]),
        ({"capacity": 10}, ["'capacity'", "0 with use_hashtable=True", "10"]),
        ({"use_hashtable": 0, "capacity": 3}, ["'use_hashtable'", "bool", "0"]),
        ({"placement": "column"}, ["'placement'", "['row', 'table']", "'column'"]),
        ({"table_shard": 2}, ["'table_shard'", "-1 unless placement='table'", "2"]),
        ({"placement": "table", "table_shard": -2}, ["'table_shard'", "-2"]),
        ({"hash_bucket_size": 100}, ["'promote_after'", "both > 0", "100 and 0"]),
        ({"hash_bucket_size": 9, "promote_after": 2, "admit_after": 3}, ["one at most"]),
        ({"admit_after": 2, "admission": "bloom"}, ["'max_elements'", ">= 1", "'bloom'"]),
        ({"admission": "maybe"}, ["'admission'", "'counter'", "'maybe'"]),
        ({"false_positive_rate": 1.0}, ["'false_positive_rate'", "(0.0, 1.0)", "1.0"]),
        ({"default_value": float("nan")}, ["'default_value'", "finite", "nan"]),
        ({"steps_to_live": -1}, ["'steps_to_live'", "-1"]),
        ({"min_l2_norm": -0.5}, ["'min_l2_norm'", "-0.5"]),
        ({"evict_before_snapshot": "yes"}, ["'evict_before_snapshot'", "bool", "'yes'"]),
    ],
)
def test_invalid_fields_name_field_expected_and_given(kwargs: dict, fragments: list[str]) -> None:
    args = {"name": "t", "dim": 8, **kwargs}
    with pytest.raises(ValueError) as raised:
        TableConfig(**args)
    for fragment in fragments:
        assert fragment in str(raised.value), (fragment, str(raised.value))


def test_strings_become_enums_and_config_is_frozen() -> None:
    config = TableConfig("t", 8, eviction="lfu", write_policy="write_through")
    assert config.eviction is Eviction.LFU
    assert config.write_policy is WritePolicy.WRITE_THROUGH
    with pytest.raises(AttributeError):
        config.dim = 4  # type: ignore[misc]


@pytest.mark.parametrize("optimizer", each(), ids=kind_id)
@pytest.mark.parametrize(
    "initializer",
    [
        init.Uniform(-1, 1),
        init.Normal(0, 2),
        init.TruncatedNormal(1, 0.5),
        init.Constant(3),
        init.Zeros(),
    ],
)
def test_dict_round_trip(optimizer, initializer) -> None:
    config = TableConfig("t", 8, initializer=initializer, optimizer=optimizer, seed=2**64 - 1)
    again = TableConfig.from_dict(config.to_dict())
    assert again == config
    assert type(again.optimizer) is type(optimizer)


def test_row_width_follows_size_factor() -> None:
    for cls in optim.OPTIMIZERS.values():
        assert TableConfig("t", 16, optimizer=cls()).row_width == 16 * cls.size_factor
        assert len(cls().state_fill()) == cls.size_factor - 1


def test_unknown_kind_in_dict_is_refused() -> None:
    data = TableConfig("t", 8).to_dict()
    data["optimizer"] = {"kind": "unregistered", "lr": 0.1}
    with pytest.raises(ValueError, match=r"'optimizer.kind' expected one of .*'unregistered'"):
        TableConfig.from_dict(data)


def test_config_differences_names_each_field_that_differs() -> None:
    table = TableConfig("items", 16, optimizer=optim.Adagrad(lr=0.05), seed=1)
    asked = TableConfig("items", 32, optimizer=optim.Adagrad(lr=0.1), seed=1)
    assert config_differences(table, table) == ""
    assert config_differences(table, asked) == (
        "field 'dim' expected 16 (the table's), got 32; "
        "field 'optimizer.lr' expected 0.05 (the table's), got 0.1"
    )
    other_kind = TableConfig("items", 16, optimizer=optim.SGD(lr=0.05), seed=1)
    assert "field 'optimizer.kind' expected 'adagrad' (the table's), got 'sgd'" in (
        config_differences(table, other_kind)
    )
