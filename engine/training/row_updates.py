"""The optimizer updates of embedding rows (:mod:`dlrmflow.engine.serving.embedding_rows`' layout), on a trainer.

:func:`apply_update` takes the rows a batch touched as one ``[U, width]`` block and the gradient of their
weights ``[U, dim]`` and returns the updated block. Every trainer mode calls exactly this function on exactly
such a block, which is why modes that store rows in different places (local table, servers, caches) still
produce bit-identical rows. The servers only store rows: they never update one, and never import torch.
"""

from __future__ import annotations

import torch

from dlrmflow.engine.serving.embedding_rows import RowSpec


def correctly_rounded_sqrt(values: torch.Tensor) -> torch.Tensor:
    """``sqrt(values)``, each result the correctly rounded one, on every CPU and GPU.

    Adagrad's update runs on whichever device a trainer uses, so its bits must not depend on the machine.
    torch's float32 sqrt on a CPU does: on an AMD EPYC 20% of its results were one unit in the last place off
    the correctly rounded value that NumPy gives, with every ATen CPU capability (on the Intel CPUs before,
    tests/test_models.py's formula tests found them exact). The square root in float64, even 1 ulp off
    there, rounds to the correctly rounded float32: the square root of a float32 is never that close to a
    point halfway between two float32 values."""
    if values.dtype != torch.float32:
        return values.sqrt()
    return values.double().sqrt_().float()


def sgd_update(block: torch.Tensor, grad: torch.Tensor, lr: float) -> torch.Tensor:
    """Plain SGD on the weights of a ``[U, dim]`` block, in place."""
    return block.sub_(grad, alpha=lr)


def rowwise_adagrad_update(
    weights: torch.Tensor, accumulators: torch.Tensor, grad: torch.Tensor, lr: float, eps: float
) -> None:
    """Row-wise Adagrad in place: ``acc += mean(g^2)`` per row, ``w -= lr * g / (sqrt(acc) + eps)``."""
    accumulators.add_(grad.square().mean(dim=1))
    weights.addcdiv_(grad, correctly_rounded_sqrt(accumulators).add_(eps).unsqueeze(1), value=-lr)


def per_value_adagrad_update(
    weights: torch.Tensor, accumulators: torch.Tensor, grad: torch.Tensor, lr: float, eps: float
) -> None:
    """Adagrad with an accumulator per value, in place: ``acc += g^2``, ``w -= lr * g / (sqrt(acc) + eps)``.

    Every step is a single elementwise operation (each exactly rounded wherever the value sits in its
    block), so :func:`apply_update` and :func:`apply_update_rowwise` both call it and give these columns
    the same bits."""
    accumulators.add_(grad.mul(grad))
    weights.sub_(grad.div(correctly_rounded_sqrt(accumulators).add_(eps)).mul_(lr))


def apply_update(spec: RowSpec, block: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Update a ``[U, width]`` block (weights + state) in place with the weights' gradient ``[U, dim]``."""
    if spec.optimizer == "sgd":
        sgd_update(block[:, : spec.dim], grad, spec.lr)
        return block
    shared = spec.shared_columns
    # A [U] view (stride = width) into the block's shared accumulator column.
    rowwise_adagrad_update(block[:, :shared], block[:, spec.dim], grad[:, :shared], spec.lr, spec.eps)
    if spec.own_accumulator_columns:
        per_value_adagrad_update(block[:, shared: spec.dim], block[:, spec.dim + 1:], grad[:, shared:], spec.lr,
                                 spec.eps)
    return block


def apply_update_rowwise(spec: RowSpec, block: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """:func:`apply_update` computed so that each row's result depends on that row alone, in place.

    Several trainers (:mod:`dlrmflow.engine.training.launch`) update a row in blocks of different
    shapes (a trainer's own rows, the rows synced now, those synced later). CPU kernels round a
    fused multiply-add (``w - lr * g`` in one step) in their vectorised body and a multiply then
    an add in their scalar tail, so :func:`apply_update`'s result for a row can depend on where the
    row sits in its block. Here every step is a single elementwise operation (each exactly rounded
    wherever the element sits) and Adagrad's row mean is a sum over columns in column order. ``grad`` may lie
    on another device (the trainers sum gradients on the host): it is applied where ``block`` lies."""
    grad = grad.to(block.device)
    if spec.optimizer == "sgd":
        block[:, : spec.dim].sub_(grad.mul(spec.lr))
        return block
    shared = spec.shared_columns
    squares = grad.mul(grad)
    total = squares[:, 0].clone()
    for column in range(1, shared):
        total.add_(squares[:, column])
    accumulators = block[:, spec.dim]
    accumulators.add_(total.div_(shared))
    denominator = correctly_rounded_sqrt(accumulators).add_(spec.eps).unsqueeze(1)
    block[:, :shared].sub_(grad[:, :shared].div(denominator).mul_(spec.lr))
    if spec.own_accumulator_columns:
        per_value_adagrad_update(block[:, shared: spec.dim], block[:, spec.dim + 1:], grad[:, shared:], spec.lr,
                                 spec.eps)
    return block
