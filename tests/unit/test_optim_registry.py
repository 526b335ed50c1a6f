"""The optimizer registry (optim.OPTIMIZERS) is complete: every registered optimizer has a
fused CUDA update (kernels.FUSED, its kernel in kernels.SOURCE), the numba twin of that
kernel and its compiled training loop (host_kernels), a reference the parity tests check
it against (a torch.optim optimizer, or for FTRL TensorFlow's, transcribed), a derived
float64 bound (tests/unit/test_kernels.py) and a config the tests train
(tests/optimizers.py); an optimizer missing any of them fails loudly, never falling back
to another optimizer's update."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import ClassVar

import numpy as np
import pytest

from tests.optimizers import EXAMPLES, each
from tests.unit.test_kernels import FLOAT64_STEPS, kernel_signatures
from tierps.core import optim
from tierps.storage import host_kernels, kernels

KINDS = list(optim.OPTIMIZERS)

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")


@pytest.mark.parametrize("kind", KINDS)
def test_every_optimizer_has_its_fused_updates(kind: str) -> None:
    cls = optim.OPTIMIZERS[kind]
    fused = kernels.FUSED[kind]
    assert fused.kernel in kernel_signatures(kernels.SOURCE)
    assert fused.kernel in kernels.KERNEL_NAMES
    arguments = fused.arguments(EXAMPLES[kind], 3)
    assert all(isinstance(value, np.float32 | np.int32) for value in arguments)
    # the CUDA kernel's parameters: the row shape (7 of them), then the hyper-parameters
    assert len(kernel_signatures(kernels.SOURCE)[fused.kernel]) == 7 + len(arguments)
    assert fused.kernel in host_kernels.ROW_UPDATES
    train, hyper = host_kernels.fused_trainer(cls(), 3)
    assert train is host_kernels.TRAINERS[fused.kernel]
    assert hyper.dtype == np.float32 and hyper.size == len(fused.arguments(cls(), 3))


def test_the_kernel_tables_hold_registered_optimizers_only() -> None:
    assert list(kernels.FUSED) == KINDS
    used = {fused.kernel for fused in kernels.FUSED.values()}
    assert set(host_kernels.ROW_UPDATES) == set(host_kernels.TRAINERS) == used
    optimizer_kernels = set(kernels.KERNEL_NAMES) - {
        "tierps_find",
        "tierps_claim",
        "tierps_upsert",
        "tierps_find_rows",
    }
    assert optimizer_kernels == used


@pytest.mark.parametrize("kind", KINDS)
def test_every_optimizer_has_a_reference(kind: str) -> None:
    """A torch.optim optimizer whose arguments the mapping gives and whose state, after a
    step, holds the tensors the mapping names (one per state slot); or, where torch has
    none, a transcription the parity tests use."""
    torch = pytest.importorskip("torch")
    from tests.unit.test_optim_parity import OTHER_REFERENCES

    cls = optim.OPTIMIZERS[kind]
    reference = cls.torch_reference
    if reference is None:
        assert kind in OTHER_REFERENCES
        return
    assert kind not in OTHER_REFERENCES
    assert len(reference.state) == cls.size_factor - 1
    for config in (cls(), EXAMPLES[kind]):
        param = torch.nn.Parameter(torch.zeros(3, 2))
        theirs = getattr(torch.optim, reference.name)([param], **reference.arguments(config))
        grad = torch.ones(3, 2)
        param.grad = grad.to_sparse() if reference.sparse else grad
        theirs.step()
        assert set(reference.state) <= set(theirs.state[param])
        assert not torch.equal(param.detach(), torch.zeros(3, 2))


def test_every_optimizer_has_a_float64_bound_and_an_example() -> None:
    assert set(FLOAT64_STEPS) == set(KINDS)
    assert [optimizer.kind for optimizer in each()] == KINDS
    for kind, example in EXAMPLES.items():
        assert type(example) is optim.OPTIMIZERS[kind]
        assert example != type(example)()  # away from the defaults


@dataclasses.dataclass(frozen=True)
class Unkernelled(optim.Optimizer):
    """A registered optimizer nobody wrote kernels for."""

    lr: float = 0.1
    kind: ClassVar[str] = "unkernelled"
    size_factor: ClassVar[int] = 1
    torch_reference: ClassVar[optim.TorchReference | None] = None

    def state_fill(self) -> tuple[float, ...]:
        return ()

    def apply(self, rows: np.ndarray, grads: np.ndarray, step: int) -> None:
        rows[:, : grads.shape[1]] -= self.lr * grads


@pytest.fixture
def registered() -> Iterator[None]:
    optim.register(Unkernelled)
    try:
        yield
    finally:
        del optim.OPTIMIZERS[Unkernelled.kind]


def test_a_registered_optimizer_without_kernels_fails_loudly(registered: None) -> None:
    with pytest.raises(LookupError, match="'unkernelled' expected a fused update"):
        kernels.fused_update(Unkernelled())
    arena = np.zeros((4, 2), np.float32)
    grads = np.ones((2, 2), np.float32)
    with pytest.raises(LookupError, match="unkernelled"):
        kernels.fused_apply(
            Unkernelled(), arena, np.arange(2), grads, 1, launch=host_kernels.host_launcher()
        )
    with pytest.raises(LookupError, match="unkernelled"):
        host_kernels.fused_trainer(Unkernelled(), 1)
    np.testing.assert_array_equal(arena, 0.0)


def test_a_cuda_kernel_without_a_numba_twin_fails_loudly(
    registered: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    fused = kernels.FusedUpdate("tierps_unkernelled", lambda opt, step: (np.float32(opt.lr),))
    monkeypatch.setitem(kernels.FUSED, Unkernelled.kind, fused)
    with pytest.raises(LookupError, match="kernel 'tierps_unkernelled' expected a numba twin"):
        host_kernels.fused_trainer(Unkernelled(), 1)


def test_a_kind_registers_once() -> None:
    @dataclasses.dataclass(frozen=True)
    class Other(optim.SGD):
        pass

    with pytest.raises(ValueError, match="kind 'sgd' expected once, got Other beside SGD"):
        optim.register(Other)
    assert optim.OPTIMIZERS["sgd"] is optim.SGD
