"""Autograd for ops that have no gradient: asking for one raises a
``RuntimeError`` that names the op and says why, instead of torch's deprecated
autograd fallback, which warns and returns a wrong gradient.

The backward ops (``experts_backward``, ``dispatch_backward``,
``combine_backward``) are such ops: a gradient of a gradient (double backward,
``torch.autograd.grad(..., create_graph=True)`` then a second backward) is not
computed by any backend.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from torch_moe_ops.ops.library import GENERIC_NAMESPACE

DOUBLE_BACKWARD = ("{op} has no gradient: double backward (a gradient of a gradient, as "
                   "torch.autograd.grad(..., create_graph=True) followed by a second backward "
                   "asks) is not supported by the MoE ops. Take first-order gradients only "
                   "(create_graph=False)")


@torch.library.custom_op(f"{GENERIC_NAMESPACE}::no_gradient", mutates_args=())
def no_gradient(grad: torch.Tensor, like: torch.Tensor, message: str) -> torch.Tensor:
    """Raises ``RuntimeError(message)``: the gradient of ``like``, an input of an
    op that has none.

    A backward that raised at once would also fail every compile of a graph
    that merely could ask for gradients (a router's weights require grad), for
    inference too: traced, this op only stands where the gradient would be, and
    raises if the backward runs. It reads ``grad``, the output's gradient, so
    that no partitioner can move it into the forward."""
    raise RuntimeError(message)


@no_gradient.register_fake
def _(grad, like, message):
    return torch.empty_like(like)


def refused_autograd(message_of: Callable[[object], str]):
    """``(setup_context, backward)`` of an op without a gradient: each input that
    asks for one gets `no_gradient`'s, raising ``message_of(ctx)`` (``ctx.namespace``
    is the namespace of the op that ran forward)."""

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*(t if isinstance(t, torch.Tensor) else None for t in inputs))

    def backward(ctx, *grads):
        grad = next(g for g in grads if g is not None)
        message = message_of(ctx)
        return tuple(no_gradient(grad, t, message) if needed else None
                     for t, needed in zip(ctx.saved_tensors, ctx.needs_input_grad))

    return setup_context, backward


def no_double_backward(name: str):
    """`refused_autograd` of the backward op ``name``: double backward through it
    raises `DOUBLE_BACKWARD`, naming ``namespace::name``."""
    return refused_autograd(lambda ctx: DOUBLE_BACKWARD.format(op=f"{ctx.namespace}::{name}"))
