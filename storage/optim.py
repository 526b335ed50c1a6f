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
- FTRL:      FTRL-Proximal (McMahan et al. 2013) as TensorFlow's ApplyFtrl: n' = n + g*g;
             z += g - (n'**-p - n**-p)/lr * w;  w = (sign(z)*l1 - z) / (n'**-p/lr + 2*l2)
             where |z| > l1, else 0;  n = n'   (p = lr_power)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from tierps.storage.validation import check_range
from tierps.storage.xp import array_module

_INF = float("inf")


@dataclass(frozen=True)
class SGD:
    """Plain SGD. Slots: weights."""

    lr: float = 1e-3
    kind: ClassVar[str] = "sgd"
    size_factor: ClassVar[int] = 1

    def __post_init__(self) -> None:
        check_range("optim.SGD", "lr", self.lr, 0.0, _INF, low_open=True)

    def state_fill(self) -> tuple[float, ...]:
        """Initial value of each state slot (after the weights)."""
        return ()

    def apply(self, rows: Any, grads: Any, step: int) -> None:
        dim = grads.shape[1]
        rows[:, :dim] -= self.lr * grads


@dataclass(frozen=True)
class Momentum:
    """Heavy-ball momentum without dampening. Slots: weights, momentum buffer."""

    lr: float = 1e-3
    momentum: float = 0.9
    kind: ClassVar[str] = "momentum"
    size_factor: ClassVar[int] = 2
    nesterov: ClassVar[bool] = False

    def __post_init__(self) -> None:
        owner = f"optim.{type(self).__name__}"
        check_range(owner, "lr", self.lr, 0.0, _INF, low_open=True)
        check_range(owner, "momentum", self.momentum, 0.0, 1.0, low_open=True, high_open=True)

    def state_fill(self) -> tuple[float, ...]:
        return (0.0,)

    def apply(self, rows: Any, grads: Any, step: int) -> None:
        dim = grads.shape[1]
        weights, buf = rows[:, :dim], rows[:, dim : 2 * dim]
        buf *= self.momentum
        buf += grads
        weights -= self.lr * (grads + self.momentum * buf if self.nesterov else buf)


@dataclass(frozen=True)
class Nesterov(Momentum):
    """Nesterov momentum, as torch.optim.SGD(nesterov=True). Slots: weights, momentum buffer."""

    kind: ClassVar[str] = "nesterov"
    nesterov: ClassVar[bool] = True


@dataclass(frozen=True)
class Adagrad:
    """Adagrad (torch's defaults, no lr decay). Slots: weights, sum of squared gradients."""

    lr: float = 1e-2
    eps: float = 1e-10
    initial_accumulator_value: float = 0.0
    kind: ClassVar[str] = "adagrad"
    size_factor: ClassVar[int] = 2

    def __post_init__(self) -> None:
        check_range("optim.Adagrad", "lr", self.lr, 0.0, _INF, low_open=True)
        check_range("optim.Adagrad", "eps", self.eps, 0.0, _INF)
        check_range(
            "optim.Adagrad", "initial_accumulator_value", self.initial_accumulator_value, 0.0, _INF
        )

    def state_fill(self) -> tuple[float, ...]:
        return (self.initial_accumulator_value,)

    def apply(self, rows: Any, grads: Any, step: int) -> None:
        xp = array_module(rows)
        dim = grads.shape[1]
        weights, accum = rows[:, :dim], rows[:, dim : 2 * dim]
        accum += grads * grads
        weights -= self.lr * grads / (xp.sqrt(accum) + self.eps)


@dataclass(frozen=True)
class Adam:
    """Adam with lazy moments, as torch.optim.SparseAdam. Slots: weights, m, v."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    kind: ClassVar[str] = "adam"
    size_factor: ClassVar[int] = 3

    def __post_init__(self) -> None:
        check_range("optim.Adam", "lr", self.lr, 0.0, _INF, low_open=True)
        check_range("optim.Adam", "beta1", self.beta1, 0.0, 1.0, high_open=True)
        check_range("optim.Adam", "beta2", self.beta2, 0.0, 1.0, high_open=True)
        check_range("optim.Adam", "eps", self.eps, 0.0, _INF, low_open=True)

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


@dataclass(frozen=True)
class FTRL:
    """FTRL-Proximal (TensorFlow's defaults; lr as Keras' Ftrl). Slots: weights, n, z."""

    lr: float = 1e-3
    lr_power: float = -0.5
    l1: float = 0.0
    l2: float = 0.0
    initial_accumulator_value: float = 0.1
    kind: ClassVar[str] = "ftrl"
    size_factor: ClassVar[int] = 3

    def __post_init__(self) -> None:
        check_range("optim.FTRL", "lr", self.lr, 0.0, _INF, low_open=True)
        check_range("optim.FTRL", "lr_power", self.lr_power, -_INF, 0.0)
        check_range("optim.FTRL", "l1", self.l1, 0.0, _INF)
        check_range("optim.FTRL", "l2", self.l2, 0.0, _INF)
        check_range(
            "optim.FTRL", "initial_accumulator_value", self.initial_accumulator_value, 0.0, _INF
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


Optimizer = SGD | Momentum | Nesterov | Adagrad | Adam | FTRL
OPTIMIZERS: dict[str, type] = {
    cls.kind: cls for cls in (SGD, Momentum, Nesterov, Adagrad, Adam, FTRL)
}
