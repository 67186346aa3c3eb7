"""What the fused backends' custom ops (``torch.library.custom_op``) share: their names and their autograd.
torch.compile and torch.export trace through such an op as one opaque node each way."""

import re


def op_name(module_name, name):
    """A custom-op name unique to the defining module's import path: a checkpoint's remote-code copy of the
    backends registers its own ops beside the installed plugin's."""
    return "plat::" + re.sub(r"\W", "_", module_name) + "_" + name


def register_backward(forward_op, backward_op, num_tensor_inputs=5):
    """Make ``backward_op`` the gradient of ``forward_op``, whose inputs are query, key, value, then other tensors
    (``num_tensor_inputs`` in all) and then plain arguments. The backward op takes the gradient of the forward's
    first output, the forward's tensor inputs, all its outputs, then its plain arguments, and returns the gradients
    of query, key and value."""

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:num_tensor_inputs], *output)
        ctx.args = inputs[num_tensor_inputs:]

    def backward(ctx, grad_out, *grads_of_other_outputs):
        grads = backward_op(grad_out, *ctx.saved_tensors, *ctx.args)
        return *grads, *(None,) * (num_tensor_inputs - len(grads) + len(ctx.args))

    forward_op.register_autograd(backward, setup_context=setup_context)
