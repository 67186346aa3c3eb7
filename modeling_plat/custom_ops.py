"""What the fused backends' custom ops (``torch.library.custom_op``) share: their names, their autograd, and how a
call reaches them. torch.compile and torch.export trace through such an op as one opaque node each way; eager calls
skip torch.library's dispatcher, which costs several times the Python of the backends themselves per call (host
time that small attention shapes on a GPU wait for)."""

import re

import torch


def op_name(module_name, name):
    """A custom-op name unique to the defining module's import path: a checkpoint's remote-code copy of the
    backends registers its own ops beside the installed plugin's."""
    return "plat::" + re.sub(r"\W", "_", module_name) + "_" + name


class FusedOp:
    """A fused backend's forward and backward: plain functions, and the custom ops made of them.

    ``forward(query, key, value, *other tensors, *plain arguments)`` (``num_tensor_inputs`` tensors in all) returns
    a tuple whose first element is the attention output; ``backward`` takes the gradient of that output, the
    forward's tensor inputs, all its outputs, then its plain arguments, and returns the gradients of query, key and
    value. Calling a ``FusedOp`` runs the custom op while torch.compile or torch.export traces (or on tensor
    subclasses such as fake tensors), and the same functions through a plain ``torch.autograd.Function`` otherwise.
    """

    def __init__(self, forward_op, forward, backward_op, backward, num_tensor_inputs=5):
        self.forward_op, self.forward, self.backward = forward_op, forward, backward
        self.num_tensor_inputs = num_tensor_inputs

        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(*inputs[:num_tensor_inputs], *output)
            ctx.args = inputs[num_tensor_inputs:]
            ctx.set_materialize_grads(False)  # the other outputs' gradients are never read: no zero tensors (kernels)

        def backward_of_op(ctx, grad_out, *grads_of_other_outputs):
            return *self.gradients(backward_op, grad_out, ctx.saved_tensors, ctx.args), *(None,) * len(ctx.args)

        forward_op.register_autograd(backward_of_op, setup_context=setup_context)

    def gradients(self, backward, grad_out, saved, args):
        """The gradients of the forward's tensor inputs: q, k and v's, None for the others."""
        grads = backward(grad_out, *saved, *args)
        return *grads, *(None,) * (self.num_tensor_inputs - len(grads))

    def __call__(self, *inputs):
        traced = torch.compiler.is_compiling() or torch.compiler.is_exporting()
        if traced or type(inputs[0]) not in (torch.Tensor, torch.nn.Parameter):
            return self.forward_op(*inputs)
        # The plain arguments as one: Function.apply handles each argument in Python (about 1 us apiece).
        return _EagerAutograd.apply(self, inputs[self.num_tensor_inputs :], *inputs[: self.num_tensor_inputs])


class _EagerAutograd(torch.autograd.Function):
    """A ``FusedOp``'s functions with the autograd its custom op registers, minus the dispatcher."""

    @staticmethod
    def forward(ctx, fused, args, *tensors):
        outputs = fused.forward(*tensors, *args)
        ctx.fused, ctx.args = fused, args
        ctx.save_for_backward(*tensors, *outputs)
        ctx.mark_non_differentiable(*outputs[1:])
        ctx.set_materialize_grads(False)  # the other outputs' gradients are never read: no zero tensors (kernels)
        return outputs

    @staticmethod
    def backward(ctx, grad_out, *grads_of_other_outputs):
        return None, None, *ctx.fused.gradients(ctx.fused.backward, grad_out, ctx.saved_tensors, ctx.args)
