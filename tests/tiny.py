"""Tiny p-LaT models built from configs, shared by the test suites."""

import torch

from modeling_plat import PlatConfig, PlatForCausalLM, PlatForImageClassification


def text_config(**kwargs):
    defaults = dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=64, max_position_embeddings=40, pad_token_id=0, eos_token_id=1)
    return PlatConfig(**(defaults | kwargs))


def vision_config(**kwargs):
    defaults = dict(hidden_size=24, num_hidden_layers=2, num_attention_heads=3, intermediate_size=48,
                    image_size=16, patch_size=4, num_labels=5)
    return PlatConfig(**(defaults | kwargs))


def lm(**kwargs):
    torch.manual_seed(0)
    return PlatForCausalLM(text_config(**kwargs)).eval()


def classifier(**kwargs):
    torch.manual_seed(0)
    return PlatForImageClassification(vision_config(**kwargs)).eval()


def train_losses(model, steps, lr, **inputs):
    """Losses of ``steps`` AdamW steps on one fixed batch (the model is put in training mode)."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses
