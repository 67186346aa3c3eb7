"""Exponential moving average of model weights (DeiT's optional ``--model-ema``) as a Trainer callback."""

import os

import torch
from safetensors.torch import load_file, save_file
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

EMA_WEIGHTS_NAME = "model_ema.safetensors"


class ModelEmaCallback(TrainerCallback):
    """Keeps ``ema = decay * ema + (1 - decay) * weights`` after every optimizer step, in float32.

    The average is saved beside each checkpoint and restored from ``resume_from_checkpoint`` so that a resumed
    run continues the same average. ``swap_into(model)`` exchanges the averaged and the live weights (call it
    twice to swap back), for evaluating or saving the averaged model.
    """

    def __init__(self, decay=0.99996, resume_from_checkpoint=None):
        self.decay = decay
        self.resume_from_checkpoint = resume_from_checkpoint
        self.shadow = None

    def _tracked(self, model):
        return {name: tensor for name, tensor in model.state_dict().items() if tensor.is_floating_point()}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        tracked = self._tracked(model)
        resumed = self.resume_from_checkpoint and os.path.join(self.resume_from_checkpoint, EMA_WEIGHTS_NAME)
        if resumed and os.path.isfile(resumed):
            saved = load_file(resumed)
            self.shadow = {name: saved[name].to(tensor.device) for name, tensor in tracked.items()}
        else:
            self.shadow = {name: tensor.detach().float().clone() for name, tensor in tracked.items()}

    @torch.no_grad()
    def on_step_end(self, args, state, control, model=None, **kwargs):
        for name, tensor in self._tracked(model).items():
            self.shadow[name].lerp_(tensor.float(), 1.0 - self.decay)

    def on_save(self, args, state, control, **kwargs):
        if args.should_save:
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            os.makedirs(folder, exist_ok=True)
            save_file({name: t.contiguous().cpu() for name, t in self.shadow.items()},
                      os.path.join(folder, EMA_WEIGHTS_NAME))

    @torch.no_grad()
    def swap_into(self, model):
        for name, tensor in self._tracked(model).items():
            live = tensor.detach().clone()
            tensor.copy_(self.shadow[name].to(tensor.dtype))
            self.shadow[name] = live.float()
