"""RowCodec (core/codec.py): the stored row's layout, and cold rows in float16/bfloat16,
against numpy's float16 and torch's bfloat16 conversions."""

from __future__ import annotations

import numpy as np
import pytest

from tierps.core.codec import RowCodec, from_bfloat16_bits, to_bfloat16_bits
from tierps.proto.convert import table_config_to_dict, table_config_to_proto
from tierps.storage import TableConfig, optim

torch = pytest.importorskip("torch")


def torch_bfloat16(values: np.ndarray) -> np.ndarray:
    return torch.from_numpy(values).to(torch.bfloat16).to(torch.float32).numpy()


def test_bfloat16_rounding_matches_torch_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    magnitudes = 10.0 ** rng.uniform(-40, 38, 200_000)  # subnormals of float32 to near max
    values = (rng.choice([-1.0, 1.0], magnitudes.size) * magnitudes).astype(np.float32)
    # exact ties (the lower 16 bits 0x8000) of both parities, zeros, the smallest subnormal
    tie_bits = (rng.integers(0, 0x7F00, 4096, dtype=np.uint32) << 16) | np.uint32(0x8000)
    specials = np.array([0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45], dtype=np.float32)
    values = np.concatenate([values, tie_bits.view(np.float32), specials])
    ours = from_bfloat16_bits(to_bfloat16_bits(values))
    np.testing.assert_array_equal(ours.view(np.uint32), torch_bfloat16(values).view(np.uint32))


def test_bfloat16_saturates_where_torch_overflows_to_inf() -> None:
    largest = from_bfloat16_bits(np.array([0x7F7F], dtype=np.uint16))[0]
    values = np.array([3.397e38, -3.4e38, np.finfo(np.float32).max], dtype=np.float32)
    assert np.isinf(torch_bfloat16(values)).all()  # round to nearest: past the largest
    np.testing.assert_array_equal(
        from_bfloat16_bits(to_bfloat16_bits(values)), [largest, -largest, largest]
    )
    nan = from_bfloat16_bits(to_bfloat16_bits(np.array([np.nan], np.float32)))
    assert np.isnan(nan).all()


@pytest.mark.parametrize("weights, state", [("float16", "float32"), ("bfloat16", "bfloat16")])
def test_encode_decode_rounds_values_and_keeps_the_step_exact(weights: str, state: str) -> None:
    codec = RowCodec(3, 2, steps=True, weights_dtype=weights, state_dtype=state)
    assert (
        codec.width == 8 and codec.value_bytes == 3 * 2 + 3 * (4 if state == "float32" else 2) + 8
    )
    rng = np.random.default_rng(1)
    rows = rng.normal(size=(5, codec.width)).astype(np.float32)
    rows[:, :3] *= 1e5  # past float16's 65,504: saturates
    steps = np.array([0, 1, 2**53 - 1, 0x7FF8_0000_7FC0_0001, 12345], dtype=np.int64)
    rows[:, 6:] = steps.view(np.float32).reshape(-1, 2)  # halves that are float NaNs
    values = codec.encode(rows)
    assert [len(v) for v in values] == [codec.value_bytes] * 5
    back = codec.decode(b"".join(values), 5)
    np.testing.assert_array_equal(codec.steps(back), steps)
    if weights == "float16":
        expected = np.clip(rows[:, :3], -65504, 65504).astype(np.float16).astype(np.float32)
    else:
        expected = torch_bfloat16(np.ascontiguousarray(rows[:, :3]))
    np.testing.assert_array_equal(back[:, :3], expected)
    state_expected = rows[:, 3:6] if state == "float32" else torch_bfloat16(rows[:, 3:6].copy())
    np.testing.assert_array_equal(back[:, 3:6], state_expected)
    np.testing.assert_array_equal(codec.round(back), back)  # rounding twice changes nothing


def test_float32_values_are_the_memory_layout() -> None:
    codec = RowCodec(4, 3, steps=True)
    rows = np.arange(2 * codec.width, dtype=np.float32).reshape(2, -1)
    assert codec.encode(rows) == [row.tobytes() for row in rows]
    np.testing.assert_array_equal(codec.decode(bytearray(rows.tobytes()), 2), rows)


SQUARES = [cls() for cls in optim.OPTIMIZERS.values() if cls.squares_state]


def test_the_optimizers_whose_state_sums_squares_say_so() -> None:
    """Adagrad's accumulator, Adam's v and FTRL's n sum squared gradients (and every
    optimizer declaring such a slot has a state slot to hold it)."""
    assert {"adagrad", "adam", "ftrl"} <= {o.kind for o in SQUARES}
    assert all(o.size_factor >= 2 for o in SQUARES)
    for cls in optim.OPTIMIZERS.values():  # the others may keep float16 state
        if not cls.squares_state:
            assert TableConfig("t", 4, optimizer=cls(), cold_dtype="float16").cold_state == (
                "float16"
            )


@pytest.mark.parametrize("optimizer", SQUARES, ids=lambda o: o.kind)
def test_float16_state_of_squared_gradients_is_refused(optimizer: optim.Optimizer) -> None:
    with pytest.raises(ValueError, match="cold_state_dtype.*float16.*cold_state_dtype='float32'"):
        TableConfig("t", 4, optimizer=optimizer, cold_dtype="float16")
    with pytest.raises(ValueError, match="cold_state_dtype"):
        TableConfig("t", 4, optimizer=optimizer, cold_state_dtype="float16")
    half = TableConfig(
        "t", 4, optimizer=optimizer, cold_dtype="float16", cold_state_dtype="float32"
    )
    assert half.codec.value_bytes == 4 * 2 + 4 * 4 * (optimizer.size_factor - 1)
    assert TableConfig("t", 4, optimizer=optimizer, cold_dtype="bfloat16").codec.state_dtype == (
        "bfloat16"
    )


def test_cold_dtypes_are_checked_and_cross_the_wire() -> None:
    with pytest.raises(ValueError, match="field 'cold_dtype' expected one of"):
        TableConfig("t", 4, cold_dtype="float8")
    config = TableConfig(
        "t", 4, optimizer=optim.SGD(), cold_dtype="float16", cold_state_dtype="bfloat16"
    )
    wire = table_config_to_dict(table_config_to_proto(config.to_dict()))
    assert TableConfig.from_dict(wire) == config
    assert (
        TableConfig.from_dict(
            table_config_to_dict(table_config_to_proto({"name": "u", "dim": 2}))
        ).cold_dtype
        == "float32"
    )
