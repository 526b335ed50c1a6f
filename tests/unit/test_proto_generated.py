"""The wire contract's generated code is current, the .proto is commented, and TableConfig
survives the trip through its wire message (proto/convert.py)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from tests.optimizers import off_defaults
from tierps.proto import generate
from tierps.proto import tierps_service_pb2 as pb
from tierps.proto.convert import table_config_to_dict, table_config_to_proto
from tierps.storage import Eviction, TableConfig, WritePolicy, init, optim

PROTO_DIR = Path(generate.__file__).resolve().parent
PROTO_FILE = PROTO_DIR / "tierps_service.proto"

# -- generated code ---------------------------------------------------------------------------


def test_committed_generated_code_is_what_generate_writes(tmp_path: Path) -> None:
    written = generate.generate(tmp_path)
    assert sorted(path.name for path in written) == sorted(
        f"{stem.removesuffix('.proto')}{suffix}"
        for stem in generate.PROTOS
        for suffix in generate.SUFFIXES
    )
    for fresh in written:
        committed = PROTO_DIR / fresh.name
        assert committed.exists(), f"{committed} is missing: run `python proto/generate.py`"
        assert committed.read_bytes() == fresh.read_bytes(), (
            f"{committed.name} is stale (it differs from what protoc generates from "
            f"{PROTO_FILE.name}): run `python proto/generate.py` and commit the result"
        )


def test_generated_grpc_module_imports_messages_from_the_tierps_namespace() -> None:
    source = (PROTO_DIR / "tierps_service_pb2_grpc.py").read_text()
    assert "from tierps.proto import tierps_service_pb2" in source
    assert pb.DESCRIPTOR.package == "tierps.v1"
    assert set(pb.DESCRIPTOR.services_by_name) == {
        "EmbeddingService",
        "AdminService",
        "ChangeService",
    }


# -- every rpc and field is commented ---------------------------------------------------------

# Fields whose meaning is their name and type, stated once in the file header or in their
# type's own comment: the table or snapshot named by a request, a table's config, the shard's
# place in the cluster ("a key k >= 0 lives on shard k % N").
SELF_EXPLANATORY = {
    ("string", "table"),
    ("string", "name"),
    ("TableConfig", "config"),
    ("uint32", "shard_id"),
    ("uint32", "num_shards"),
}
_RPC = re.compile(r"^\s*rpc\s+(\w+)\s*\(")
_FIELD = re.compile(r"^\s*(?:optional\s+|repeated\s+)?(map<[^>]+>|[\w.]+)\s+(\w+)\s*=\s*\d+\s*;")
_ENUM_VALUE = re.compile(r"^\s*(\w+)\s*=\s*-?\d+\s*;")
_BLOCK = re.compile(r"^\s*(service|message|enum)\s+(\w+)\s*\{")


def undocumented(proto_text: str, seen: list[str] | None = None) -> list[str]:
    """Every rpc, message field and enum value of proto_text that breaks the rule:

    - an `rpc` needs a `//` comment line directly above it;
    - a field or enum value needs a `//` comment line directly above it, or must follow,
      with no blank line between, a field that is documented: one comment may cover a run of
      fields that belong together ("Keys ... found, and not found" above `hits` and
      `misses`);
    - except the SELF_EXPLANATORY fields (type, name), which need no comment (and do not
      document the field after them).

    Returns "Block.member (line n)" for each offender; appends "Block.member" of every
    rpc, field and enum value to `seen` if given."""
    seen = [] if seen is None else seen
    offenders: list[str] = []
    blocks: list[tuple[str, str]] = []  # (kind, name) of the enclosing blocks
    previous = ""  # the previous line, stripped
    previous_documented = False  # the previous line was a documented field
    for number, raw in enumerate(proto_text.splitlines(), start=1):
        line = raw.split("//", 1)[0].strip() if not raw.strip().startswith("//") else ""
        documented_here = False
        if block := _BLOCK.match(raw):
            blocks.append((block.group(1), block.group(2)))
            if line.endswith("}"):  # an empty block on one line: message Empty {}
                blocks.pop()
        elif blocks and (rpc := _RPC.match(raw)):
            seen.append(f"{blocks[-1][1]}.{rpc.group(1)}")
            if not previous.startswith("//"):
                offenders.append(f"{blocks[-1][1]}.{rpc.group(1)} (line {number})")
        elif blocks and blocks[-1][0] in ("message", "enum"):
            member = _FIELD.match(raw) if blocks[-1][0] == "message" else _ENUM_VALUE.match(raw)
            if member:
                name = member.group(member.lastindex or 1)
                kind = member.group(1) if blocks[-1][0] == "message" else ""
                seen.append(f"{blocks[-1][1]}.{name}")
                if previous.startswith("//") or previous_documented:
                    documented_here = True
                elif (kind, name) not in SELF_EXPLANATORY:
                    offenders.append(f"{blocks[-1][1]}.{name} (line {number})")
        elif line.endswith("}") and blocks:
            blocks.pop()
        previous = raw.strip()
        previous_documented = documented_here
    return offenders


def test_the_comment_rule_catches_what_it_should() -> None:
    text = """
service S {
  // Documented.
  rpc A(X) returns (Y);
  rpc B(X) returns (Y);
}
message M {
  // Keys found, and not found.
  uint64 hits = 1;
  uint64 misses = 2;

  uint64 bare = 3;
  string table = 4;
  uint64 after_exempt = 5;
  map<string, double> params = 6;
  // Set.
  optional uint64 seed = 7;
}
message Empty {}
enum E {
  // Zero.
  E_ZERO = 0;

  E_ONE = 1;
}
"""
    assert undocumented(text) == [
        "S.B (line 5)",
        "M.bare (line 12)",
        "M.after_exempt (line 14)",
        "M.params (line 15)",
        "E.E_ONE (line 24)",
    ]


def test_every_rpc_field_and_enum_value_of_the_proto_is_commented() -> None:
    text = PROTO_FILE.read_text()
    seen: list[str] = []
    offenders = undocumented(text, seen)
    assert offenders == [], (
        f"{PROTO_FILE.name}: these have no comment saying what they mean (units, layout, "
        f"unset value): {offenders}"
    )
    # The parser saw every rpc, field and enum value the compiled descriptor has.
    compiled = [
        f"{service.name}.{method.name}"
        for service in pb.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    ]
    compiled += [
        f"{message.name}.{field.name}"
        for message in pb.DESCRIPTOR.message_types_by_name.values()
        for field in message.fields
    ]
    compiled += [
        f"{enum.name}.{value.name}"
        for enum in pb.DESCRIPTOR.enum_types_by_name.values()
        for value in enum.values
    ]
    assert sorted(seen) == sorted(compiled)


# -- TableConfig <-> wire message ---------------------------------------------------------------

OPTIMIZERS = [off_defaults(cls) for cls in optim.OPTIMIZERS.values()]
INITIALIZERS = [
    init.Uniform(low=-0.5, high=0.25),
    init.Normal(mean=0.5, std=0.1),
    init.TruncatedNormal(mean=-1.0, std=3.0),
    init.Constant(value=0.375),
    init.Zeros(),
]


def round_trip(config: TableConfig) -> TableConfig:
    return TableConfig.from_dict(table_config_to_dict(table_config_to_proto(config.to_dict())))


def test_every_optimizer_and_initializer_kind_is_covered() -> None:
    assert {o.kind for o in OPTIMIZERS} == set(optim.OPTIMIZERS)
    assert {i.kind for i in INITIALIZERS} == set(init.INITIALIZERS)
    for optimizer in OPTIMIZERS:  # so that a parameter the wire dropped is noticed
        default = type(optimizer)()
        for field in dataclasses.fields(optimizer):
            assert getattr(optimizer, field.name) != getattr(default, field.name)


def test_the_component_comment_names_every_optimizer_kind_and_its_parameters() -> None:
    """The .proto's Component comment, the wire's one description of the optimizer kind
    strings, names every registered kind with its parameters."""
    text = PROTO_FILE.read_text()
    block = text[text.index("message Component {") :]
    comment = " ".join(
        line.strip().removeprefix("//").strip()
        for line in block[: block.index("string kind")].splitlines()
        if line.strip().startswith("//")
    )
    described: dict[str, set[str]] = {}
    optimizers = comment[comment.index("Optimizer kinds:") :]
    for kinds, params in re.findall(r'((?:"\w+"(?: and )?)+) \(([^)]*)\)', optimizers):
        for kind in re.findall(r'"(\w+)"', kinds):
            described[kind] = {param.strip() for param in params.split(",")}
    assert described == {
        kind: {field.name for field in dataclasses.fields(cls)}
        for kind, cls in optim.OPTIMIZERS.items()
    }


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.kind)
@pytest.mark.parametrize("initializer", INITIALIZERS, ids=lambda i: i.kind)
def test_table_config_round_trips_through_its_message(
    optimizer: optim.Optimizer, initializer: init.Initializer
) -> None:
    config = TableConfig(
        "items.v2-x",
        dim=17,
        initializer=initializer,
        optimizer=optimizer,
        seed=2**64 - 1,
        host_cache_bytes=0,  # explicitly 0 (no host tier): presence keeps it apart from unset
        gpu_cache_bytes=3 << 20,
        eviction=Eviction.LFU,
        write_policy=WritePolicy.WRITE_THROUGH,
        use_hashtable=False,
        capacity=1000,
        placement="table",
        table_shard=0,  # explicitly 0: presence keeps it apart from unset (-1)
        admit_after=3,
        admission="bloom",
        max_elements=5000,
        false_positive_rate=0.001,
        default_value=-0.5,
        steps_to_live=100,
        min_l2_norm=1e-3,
        evict_before_snapshot=True,
    )
    assert round_trip(config) == config
    adaptive = dataclasses.replace(config, admit_after=0, hash_bucket_size=64, promote_after=5)
    assert round_trip(adaptive) == adaptive
    message = table_config_to_proto(config.to_dict())
    assert message.HasField("host_cache_bytes") and message.host_cache_bytes == 0
    assert message.optimizer.kind == optimizer.kind
    # Through the wire bytes too.
    assert pb.TableConfig.FromString(message.SerializeToString()) == message


def test_default_config_round_trips() -> None:
    config = TableConfig("t", 4)
    assert round_trip(config) == config


def full_message() -> tuple[TableConfig, pb.TableConfig]:
    config = TableConfig(
        "t",
        dim=8,
        initializer=init.Normal(std=0.5),
        optimizer=optim.SGD(lr=0.5),
        seed=99,
        host_cache_bytes=1 << 20,
        gpu_cache_bytes=1 << 20,
        eviction="lfu",
        write_policy="write_through",
        use_hashtable=False,
        capacity=64,
        placement="table",
        table_shard=1,
        admit_after=2,
        admission="bloom",
        max_elements=100,
        false_positive_rate=0.05,
        default_value=0.5,
        steps_to_live=7,
        min_l2_norm=0.25,
        evict_before_snapshot=True,
    )
    return config, table_config_to_proto(config.to_dict())


DEFAULTS = {f.name: f for f in dataclasses.fields(TableConfig)}


def default_of(name: str) -> Any:
    field = DEFAULTS[name]
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


@pytest.mark.parametrize(
    "field",
    [
        "dtype",
        "seed",
        "host_cache_bytes",
        "gpu_cache_bytes",
        "eviction",
        "write_policy",
        "initializer",
        "optimizer",  # (placement stays: unset, "row", it would refuse the table_shard set)
        "admission",
        "admit_after",
        "false_positive_rate",
        "default_value",
        "steps_to_live",
        "min_l2_norm",
        "evict_before_snapshot",
    ],
)
def test_an_unset_field_takes_the_dataclass_default(field: str) -> None:
    config, message = full_message()
    message.ClearField(field)
    assert field not in table_config_to_dict(message)
    decoded = TableConfig.from_dict(table_config_to_dict(message))
    assert decoded == dataclasses.replace(config, **{field: default_of(field)})


def test_a_component_parameter_left_out_takes_its_default() -> None:
    message = pb.TableConfig(name="t", dim=4)
    message.initializer.kind = "uniform"
    message.optimizer.kind = "adam"
    message.optimizer.params["lr"] = 0.5
    decoded = TableConfig.from_dict(table_config_to_dict(message))
    assert decoded.optimizer == optim.Adam(lr=0.5)
    assert decoded.initializer == init.Uniform()
    assert decoded == TableConfig("t", 4, optimizer=optim.Adam(lr=0.5))
