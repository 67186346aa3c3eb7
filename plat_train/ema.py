"""Exponential moving average of model weights (DeiT's ``--model-ema``) as a Trainer callback, with warmup.

A fixed decay d keeps d^t of the initial (random) weights after t steps: with DeiT's 0.99996 that is 93% after
the 1,688 steps of a 4-epoch Fashion-MNIST run. With warmup (as timm's ModelEmaV3) step t uses
``min(decay, 1 - (1 + t) ** -WARMUP_POWER)``, so early steps average over a short window that widens as
training goes on, and the average forgets the initialisation.
"""

import logging
import os

import torch
from safetensors.torch import load_file, save_file
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

EMA_WEIGHTS_NAME = "model_ema.safetensors"
# 3/4 suits runs of thousands to ~100k steps (the decay reaches 0.999 after 10k steps); 2/3 is slower, for
# runs of millions of steps.
WARMUP_POWER = 0.75

logger = logging.getLogger(__name__)


def ema_decay(step, decay, warmup=True):
    """The decay applied at optimizer step ``step`` (1-based): ``decay``, or its warmed-up value."""
    return min(decay, 1.0 - (1.0 + step) ** -WARMUP_POWER) if warmup else decay


class ModelEmaCallback(TrainerCallback):
    """Keeps ``ema = d * ema + (1 - d) * weights`` after every optimizer step, in float32, ``d = ema_decay(step)``.

    The average is saved beside each checkpoint and restored from ``resume_from_checkpoint`` so that a resumed
    run continues the same average (the step count comes from Trainer's state). ``swap_into(model)`` exchanges
    the averaged and the live weights (call it twice to swap back), for evaluating or saving the averaged model.
    """

    def __init__(self, decay=0.99996, warmup=True, resume_from_checkpoint=None):
        self.decay = decay
        self.warmup = warmup
        self.resume_from_checkpoint = resume_from_checkpoint
        self.names = None
        self.shadow = None

    def _tracked(self, model):
        return [tensor for tensor in model.state_dict().values() if tensor.is_floating_point()]

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        tracked = {name: tensor for name, tensor in model.state_dict().items() if tensor.is_floating_point()}
        self.names = list(tracked)
        resumed = self.resume_from_checkpoint and os.path.join(self.resume_from_checkpoint, EMA_WEIGHTS_NAME)
        if resumed and os.path.isfile(resumed):
            saved = load_file(resumed)
            self.shadow = [saved[name].to(tensor.device) for name, tensor in tracked.items()]
        else:
            if resumed:
                logger.warning(f"{self.resume_from_checkpoint} has no {EMA_WEIGHTS_NAME}: the average of the weights "
                               "starts again from the checkpoint's weights")
            self.shadow = [tensor.detach().float().clone() for tensor in tracked.values()]

    @torch.no_grad()
    def on_step_end(self, args, state, control, model=None, **kwargs):
        weight = 1.0 - ema_decay(state.global_step, self.decay, self.warmup)
        live = [tensor.float() for tensor in self._tracked(model)]
        torch._foreach_lerp_(self.shadow, live, weight)

    def on_save(self, args, state, control, **kwargs):
        if args.should_save:
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            os.makedirs(folder, exist_ok=True)
            # Written whole or not at all: a run killed while saving leaves no average that resuming would trust.
            path = os.path.join(folder, EMA_WEIGHTS_NAME)
            save_file({name: t.contiguous().cpu() for name, t in zip(self.names, self.shadow)}, path + ".tmp")
            os.replace(path + ".tmp", path)

    @torch.no_grad()
    def swap_into(self, model):
        for index, tensor in enumerate(self._tracked(model)):
            live = tensor.detach().clone()
            tensor.copy_(self.shadow[index].to(tensor.dtype))
            self.shadow[index] = live.float()
