"""Optimizer configs, and their lazy, vectorised updates.

A row is [weights | state slot 1 | state slot 2 ...], each `dim` wide: `size_factor` is the
number of slots including the weights. `apply` updates rows [n, size_factor*dim] in place for
n unique keys with summed gradients [n, dim]; rows not passed in do not change (lazy), which
is what torch's sparse optimizers do.

Formulas (g: gradient, w: weights, t: the step passed in, counted from 1):
- SGD:       w -= lr * g                                       (torch.optim.SGD)
- Momentum:  b = momentum * b + g;  w -= lr * b                (torch.optim.SGD(momentum))
- Nesterov:  b = momentum * b + g;  w -= lr * (g + momentum*b) (torch.optim.SGD(nesterov=True))
- Adagrad:   s += g*g;  w -= lr * g / (sqrt(s) + eps)          (torch.optim.Adagrad)
- Adam:      m += (1-b1)(g-m);  v += (1-b2)(g*g-v);
             w -= lr * sqrt(1-b2**t)/(1-b1**t) * m / (sqrt(v) + eps)   (torch.optim.SparseAdam)
- RMSprop:   v = alpha*v + (1-alpha)*g*g;  w -= lr * g / (sqrt(v) + eps)
             (torch.optim.RMSprop without momentum or centering)
- FTRL:      FTRL-Proximal (McMahan et al. 2013) as TensorFlow's ApplyFtrl: n' = n + g*g;
             z += g - (n'**-p - n**-p)/lr * w;  w = (sign(z)*l1 - z) / (n'**-p/lr + 2*l2)
             where |z| > l1, else 0;  n = n'   (p = lr_power)

The rows are float32, so each config is also checked as float32 sees it, at create: every
field must be finite in float32 (1e39 is inf there), and no combination may turn a finite
gradient into NaN or inf by itself - Adagrad with eps and initial_accumulator_value both 0
divides 0 by 0 at the first zero gradient component; FTRL whose first n**-p is 0 (or inf)
with l2 = 0 divides by 0. What finite configs can still overflow with extreme gradients
(1e20 squared is inf in float32) is refused per push instead (EmbeddingTable.apply_gradients).

The registry: an optimizer is one class here, registered by `@register` under its `kind`
in OPTIMIZERS - its hyper-parameters and their checks, its state slots and their fill, the
numpy reference update, and the torch.optim optimizer it equals (`torch_reference`, for the
parity tests). Its fused updates are registered against the same kind by the kernel
modules: the CUDA kernel in storage/kernels.py (FUSED), its numba twin in
storage/host_kernels.py. Configs, the wire, the kernels and the tests read OPTIMIZERS.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar, TypeVar

import numpy as np

from tierps.core.validation import check_range
from tierps.core.xp import array_module

_INF = float("inf")
_F32_MAX = float(np.finfo(np.float32).max)


def _check_float32(config: Any) -> None:
    """Every field of an optimizer config finite as float32 (the rows' type): 1e39 passes
    check_range but is inf in float32, and lr=inf turns a zero gradient into NaN."""
    for item in fields(config):
        value = getattr(config, item.name)
        if abs(value) > _F32_MAX:
            raise ValueError(
                f"optim.{type(config).__name__}: field '{item.name}' expected a value float32 "
                f"holds (|x| <= {_F32_MAX:.8g}: rows are float32), got {value!r}"
            )


def _f32(value: float) -> float:
    """value as float32 rounds it (what the rows' arithmetic uses)."""
    return float(np.float32(value))


def _check_eps_in_float32(owner: str, eps: float, zero_case: str) -> None:
    """eps > 0 once rounded to float32 (the rows' type): else `zero_case` divides 0 by
    sqrt(0) + 0 and makes NaN."""
    if _f32(eps) == 0.0:
        raise ValueError(
            f"{owner}: field 'eps' expected > 0 as float32 (>= {_f32(1e-45):.3g}; else "
            f"{zero_case} gives 0 / (sqrt(0) + 0) = NaN), got {eps!r}"
        )


@dataclass(frozen=True)
class TorchReference:
    """The torch.optim optimizer a config equals, for the parity tests (tests/optimizers.py
    builds it; torch is not needed here)."""

    name: str  # torch.optim.<name>
    arguments: Callable[[Any], dict[str, Any]]  # config -> that class's keyword arguments
    # The names of torch's per-parameter state tensors that equal the state slots, in order.
    state: tuple[str, ...]
    # True: it takes the sparse gradient of nn.Embedding(sparse=True) and, as tierps does,
    # changes only the rows in it. False: it takes dense gradients and would also move or
    # decay the rows a step leaves out; tierps equals it with one torch parameter per row
    # whose grad stays None when a step leaves the row out (torch.optim skips those).
    sparse: bool


class Optimizer:
    """What every registered optimizer config declares (each is a frozen dataclass of its
    hyper-parameters, checking itself in __post_init__)."""

    kind: ClassVar[str]  # its name in OPTIMIZERS, on the wire and in snapshots
    size_factor: ClassVar[int]  # slots of dim a row holds: the weights and each state slot
    # The state slot that sums or averages squared gradients, named for the refusal of
    # float16 cold state (it outgrows float16's 65,504); "" where there is none.
    squares_state: ClassVar[str] = ""
    torch_reference: ClassVar[TorchReference | None]  # None: no torch.optim counterpart

    def state_fill(self) -> tuple[float, ...]:
        """Initial value of each state slot (after the weights)."""
        raise NotImplementedError

    def apply(self, rows: Any, grads: Any, step: int) -> None:
        """One lazy step in place on rows [n, size_factor*dim] with summed gradients [n, dim]
        of n unique keys, at `step` (counted from 1): the numpy (or cupy) reference."""
        raise NotImplementedError


OPTIMIZERS: dict[str, type[Optimizer]] = {}
"""Every optimizer, by kind: the one list configs, the wire, the kernels and tests read."""

_Registered = TypeVar("_Registered", bound=type[Optimizer])


def register(cls: _Registered) -> _Registered:
    """Add an optimizer config class to OPTIMIZERS under its kind (each kind once)."""
    if cls.kind in OPTIMIZERS:
        raise ValueError(
            f"optim.register: kind {cls.kind!r} expected once, got {cls.__name__} beside "
            f"{OPTIMIZERS[cls.kind].__name__}"
        )
    OPTIMIZERS[cls.kind] = cls
    return cls


@register
@dataclass(frozen=True)
class SGD(Optimizer):
    """Plain SGD. Slots: weights."""

    lr: float = 1e-3
    kind: ClassVar[str] = "sgd"
    size_factor: ClassVar[int] = 1
    torch_reference: ClassVar[TorchReference | None] = TorchReference(
        "SGD", lambda c: {"lr": c.lr}, state=(), sparse=True
    )

    def __post_init__(self) -> None:
        check_range("optim.SGD", "lr", self.lr, 0.0, _INF, low_open=True)
        _check_float32(self)

    def state_fill(self) -> tuple[float, ...]:
        return ()

    def apply(self, rows: Any, grads: Any, step: int) -> None:
        dim = grads.shape[1]
        rows[:, :dim] -= self.lr * grads


@register
@dataclass(frozen=True)
class Momentum(Optimizer):
    """Heavy-ball momentum without dampening. Slots: weights, momentum buffer."""

    lr: float = 1e-3
    momentum: float = 0.9
    kind: ClassVar[str] = "momentum"
    size_factor: ClassVar[int] = 2
    nesterov: ClassVar[bool] = False
    torch_reference: ClassVar[TorchReference | None] = TorchReference(
        "SGD",
        lambda c: {"lr": c.lr, "momentum": c.momentum, "nesterov": c.nesterov},
        state=("momentum_buffer",),
        sparse=False,
    )

    def __post_init__(self) -> None:
        owner = f"optim.{type(self).__name__}"
        check_range(owner, "lr", self.lr, 0.0, _INF, low_open=True)
        check_range(owner, "momentum", self.momentum, 0.0, 1.0, low_open=True, high_open=True)
        _check_float32(self)

    def state_fill(self) -> tuple[float, ...]:
        return (0.0,)

    def apply(self, rows: Any, grads: Any, step: int) -> None:
        dim = grads.shape[1]
        weights, buf = rows[:, :dim], rows[:, dim : 2 * dim]
        buf *= self.momentum
        buf += grads
        weights -= self.lr * (grads + self.momentum * buf if self.nesterov else buf)


@register
@dataclass(frozen=True)
class Nesterov(Momentum):
    """Nesterov momentum, as torch.optim.SGD(nesterov=True). Slots: weights, momentum buffer."""

    kind: ClassVar[str] = "nesterov"
    nesterov: ClassVar[bool] = True


@register
@dataclass(frozen=True)
class Adagrad(Optimizer):
    """Adagrad (torch's defaults, no lr decay). Slots: weights, sum of squared gradients."""

    lr: float = 1e-2
    eps: float = 1e-10
    initial_accumulator_value: float = 0.0
    kind: ClassVar[str] = "adagrad"
    size_factor: ClassVar[int] = 2
    squares_state: ClassVar[str] = "accumulator (a sum of squared gradients)"
    torch_reference: ClassVar[TorchReference | None] = TorchReference(
        "Adagrad",
        lambda c: {
            "lr": c.lr,
            "eps": c.eps,
            "initial_accumulator_value": c.initial_accumulator_value,
        },
        state=("sum",),
        sparse=True,
    )

    def __post_init__(self) -> None:
        check_range("optim.Adagrad", "lr", self.lr, 0.0, _INF, low_open=True)
        check_range("optim.Adagrad", "eps", self.eps, 0.0, _INF)
        check_range(
            "optim.Adagrad", "initial_accumulator_value", self.initial_accumulator_value, 0.0, _INF
        )
        _check_float32(self)
        if _f32(self.eps) == 0.0 and _f32(self.initial_accumulator_value) == 0.0:
            # s = 0 + 0*0 at a zero gradient component: w -= lr * 0 / (0 + 0) is NaN
            raise ValueError(
                f"optim.Adagrad: fields 'eps' and 'initial_accumulator_value' expected at "
                f"least one > 0 as float32 (else the first zero gradient component gives "
                f"0 / (sqrt(0) + 0) = NaN), got eps={self.eps!r} and "
                f"initial_accumulator_value={self.initial_accumulator_value!r}"
            )

    def state_fill(self) -> tuple[float, ...]:
        return (self.initial_accumulator_value,)

    def apply(self, rows: Any, grads: Any, step: int) -> None:
        xp = array_module(rows)
        dim = grads.shape[1]
        weights, accum = rows[:, :dim], rows[:, dim : 2 * dim]
        accum += grads * grads
        weights -= self.lr * grads / (xp.sqrt(accum) + self.eps)


@register
@dataclass(frozen=True)
class Adam(Optimizer):
    """Adam with lazy moments, as torch.optim.SparseAdam. Slots: weights, m, v."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    kind: ClassVar[str] = "adam"
    size_factor: ClassVar[int] = 3
    squares_state: ClassVar[str] = "second moment v"
    torch_reference: ClassVar[TorchReference | None] = TorchReference(
        "SparseAdam",
        lambda c: {"lr": c.lr, "betas": (c.beta1, c.beta2), "eps": c.eps},
        state=("exp_avg", "exp_avg_sq"),
        sparse=True,
    )

    def __post_init__(self) -> None:
        check_range("optim.Adam", "lr", self.lr, 0.0, _INF, low_open=True)
        check_range("optim.Adam", "beta1", self.beta1, 0.0, 1.0, high_open=True)
        check_range("optim.Adam", "beta2", self.beta2, 0.0, 1.0, high_open=True)
        check_range("optim.Adam", "eps", self.eps, 0.0, _INF, low_open=True)
        _check_float32(self)
        # m / (sqrt(v) + eps) at m = v = 0 is 0 / 0
        _check_eps_in_float32("optim.Adam", self.eps, "a zero gradient component")

    def state_fill(self) -> tuple[float, ...]:
        return (0.0, 0.0)

    def apply(self, rows: Any, grads: Any, step: int) -> None:
        xp = array_module(rows)
        dim = grads.shape[1]
        weights, m, v = rows[:, :dim], rows[:, dim : 2 * dim], rows[:, 2 * dim : 3 * dim]
        m += (1.0 - self.beta1) * (grads - m)
        v += (1.0 - self.beta2) * (grads * grads - v)
        step_size = self.lr * (1.0 - self.beta2**step) ** 0.5 / (1.0 - self.beta1**step)
        weights -= step_size * (m / (xp.sqrt(v) + self.eps))


@register
@dataclass(frozen=True)
class RMSprop(Optimizer):
    """RMSprop as torch.optim.RMSprop (its defaults; no momentum, not centered: either
    would add a state slot only some configs use, and a kind's slots are fixed). Slots:
    weights, running mean of squared gradients v."""

    lr: float = 1e-2
    alpha: float = 0.99
    eps: float = 1e-8
    kind: ClassVar[str] = "rmsprop"
    size_factor: ClassVar[int] = 2
    squares_state: ClassVar[str] = "running mean of squared gradients v"
    torch_reference: ClassVar[TorchReference | None] = TorchReference(
        "RMSprop",
        lambda c: {"lr": c.lr, "alpha": c.alpha, "eps": c.eps},
        state=("square_avg",),
        sparse=False,
    )

    def __post_init__(self) -> None:
        check_range("optim.RMSprop", "lr", self.lr, 0.0, _INF, low_open=True)
        check_range("optim.RMSprop", "alpha", self.alpha, 0.0, 1.0, high_open=True)
        check_range("optim.RMSprop", "eps", self.eps, 0.0, _INF, low_open=True)
        _check_float32(self)
        # g / (sqrt(v) + eps) at g = v = 0 is 0 / 0
        _check_eps_in_float32("optim.RMSprop", self.eps, "a zero gradient component of a fresh row")

    def state_fill(self) -> tuple[float, ...]:
        return (0.0,)

    def apply(self, rows: Any, grads: Any, step: int) -> None:
        xp = array_module(rows)
        dim = grads.shape[1]
        weights, v = rows[:, :dim], rows[:, dim : 2 * dim]
        v *= self.alpha
        v += (1.0 - self.alpha) * (grads * grads)
        weights -= self.lr * (grads / (xp.sqrt(v) + self.eps))


@register
@dataclass(frozen=True)
class FTRL(Optimizer):
    """FTRL-Proximal (TensorFlow's defaults; lr as Keras' Ftrl). Slots: weights, n, z."""

    lr: float = 1e-3
    lr_power: float = -0.5
    l1: float = 0.0
    l2: float = 0.0
    initial_accumulator_value: float = 0.1
    kind: ClassVar[str] = "ftrl"
    size_factor: ClassVar[int] = 3
    squares_state: ClassVar[str] = "sum of squared gradients n"
    # torch has no FTRL: the parity tests check it against TensorFlow's ApplyFtrl instead
    torch_reference: ClassVar[TorchReference | None] = None

    def __post_init__(self) -> None:
        check_range("optim.FTRL", "lr", self.lr, 0.0, _INF, low_open=True)
        check_range("optim.FTRL", "lr_power", self.lr_power, -_INF, 0.0)
        check_range("optim.FTRL", "l1", self.l1, 0.0, _INF)
        check_range("optim.FTRL", "l2", self.l2, 0.0, _INF)
        check_range(
            "optim.FTRL", "initial_accumulator_value", self.initial_accumulator_value, 0.0, _INF
        )
        _check_float32(self)
        # The first update divides by n'**-p / lr + 2*l2. n' is at least the initial value
        # (a gradient too small to square in float32 adds 0), so with l2 = 0 that initial
        # value's power must be finite and above 0 in float32, or a finite gradient makes
        # the weights inf or NaN.
        with np.errstate(all="ignore"):
            first = float(np.float32(self.initial_accumulator_value) ** np.float32(-self.lr_power))
        if not np.isfinite(first) or (first == 0.0 and _f32(self.l2) == 0.0):
            raise ValueError(
                f"optim.FTRL: fields 'initial_accumulator_value' and 'lr_power' expected "
                f"initial_accumulator_value**-lr_power finite and > 0 as float32 unless "
                f"l2 > 0 (it divides the first update: {first!r} / lr + 2*l2 would be 0 or "
                f"inf), got initial_accumulator_value={self.initial_accumulator_value!r}, "
                f"lr_power={self.lr_power!r}, l2={self.l2!r}"
            )

    def state_fill(self) -> tuple[float, ...]:
        return (self.initial_accumulator_value, 0.0)

    def apply(self, rows: Any, grads: Any, step: int) -> None:
        xp = array_module(rows)
        dim = grads.shape[1]
        weights, n, z = rows[:, :dim], rows[:, dim : 2 * dim], rows[:, 2 * dim : 3 * dim]
        power = -self.lr_power
        n_new = n + grads * grads
        n_pow_new = n_new**power
        z += grads - (n_pow_new - n**power) / self.lr * weights
        quadratic = n_pow_new / self.lr + 2.0 * self.l2
        weights[...] = xp.where(xp.abs(z) > self.l1, (xp.sign(z) * self.l1 - z) / quadratic, 0.0)
        n[...] = n_new
