"""The optimizers the tests train, read from the registry (optim.OPTIMIZERS): one config
of each with its hyper-parameters away from the defaults, configs with every
hyper-parameter off its default (for round trips), and the torch.optim twin of a config
(its `torch_reference`) stepped as tierps steps."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from tierps.core import optim

# One trained config per registered optimizer. A new optimizer needs one here: each()
# fails naming it until then.
EXAMPLES: dict[str, optim.Optimizer] = {
    "sgd": optim.SGD(lr=0.05),
    "momentum": optim.Momentum(lr=0.05, momentum=0.8),
    "nesterov": optim.Nesterov(lr=0.03, momentum=0.8),
    "adagrad": optim.Adagrad(lr=0.1, initial_accumulator_value=0.1),
    "adam": optim.Adam(lr=0.01, beta1=0.8, beta2=0.99, eps=1e-6),
    "rmsprop": optim.RMSprop(lr=0.02, alpha=0.9, eps=1e-6),
    "ftrl": optim.FTRL(lr=0.1, l1=0.01, l2=0.02),
}


def each() -> list[optim.Optimizer]:
    """EXAMPLES' config of every registered optimizer, in registry order."""
    missing = sorted(set(optim.OPTIMIZERS) - set(EXAMPLES))
    if missing:
        raise AssertionError(
            f"tests/optimizers.py: EXAMPLES expected a config of every registered optimizer, "
            f"got none for {missing}"
        )
    return [EXAMPLES[kind] for kind in optim.OPTIMIZERS]


def off_defaults(cls: type[optim.Optimizer]) -> optim.Optimizer:
    """A config of `cls` whose every hyper-parameter differs from its default: half of it,
    or 0.25 where the default is 0 (inside every registered optimizer's ranges)."""
    values = {}
    for field in dataclasses.fields(cls):
        default = field.default
        values[field.name] = default / 2 if default else 0.25
    return cls(**values)


def kind_id(optimizer: optim.Optimizer) -> str:
    """A pytest id: the optimizer's kind."""
    return optimizer.kind


class TorchTwin:
    """torch.optim's optimizer of a config (its torch_reference) over `weight`, a leaf
    [rows, dim] tensor whose .grad a backward fills (sparse or dense), stepped as tierps
    steps a table: only the rows a step touched change. Where the reference is not sparse
    (it would move or decay untouched rows), each row is a parameter of its own and the
    rows left out keep grad None, which torch.optim skips."""

    def __init__(self, config: optim.Optimizer, weight: Any) -> None:
        import torch

        reference = config.torch_reference
        if reference is None:
            raise AssertionError(f"optim.{type(config).__name__} has no torch reference")
        self.config, self.reference, self.weight = config, reference, weight
        self.params = (
            [weight]
            if reference.sparse
            else [torch.nn.Parameter(row.detach().clone()) for row in weight]
        )
        make = getattr(torch.optim, reference.name)
        self.optimizer = make(self.params, **reference.arguments(config))

    def zero_grad(self) -> None:
        self.weight.grad = None

    def step(self, touched: np.ndarray) -> None:
        """One step on weight.grad, of the rows in `touched` (row indices, repeats and all)."""
        import torch

        if self.reference.sparse:
            self.optimizer.step()
            return
        grad = self.weight.grad
        grad = grad.to_dense() if grad.is_sparse else grad
        rows = sorted(set(np.asarray(touched).tolist()))
        for param in self.params:
            param.grad = None
        for i in rows:
            self.params[i].grad = grad[i].clone()
        self.optimizer.step()
        with torch.no_grad():
            for i in rows:
                self.weight[i] = self.params[i]

    def state(self) -> list[np.ndarray]:
        """Each state slot [rows, dim] as torch holds it; a row it never stepped holds the
        config's initial fill, as a tierps row does."""
        slots = []
        fills = self.config.state_fill()
        for name, fill in zip(self.reference.state, fills, strict=True):
            if self.reference.sparse:
                tensor = self.optimizer.state[self.weight][name]
                slots.append((tensor.to_dense() if tensor.is_sparse else tensor).numpy())
                continue
            rows = [
                self.optimizer.state[p][name].numpy()
                if name in self.optimizer.state[p]
                else np.full(p.shape, fill, np.float32)
                for p in self.params
            ]
            slots.append(np.stack(rows))
        return slots
