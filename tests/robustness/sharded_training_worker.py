"""Run by torchrun (2 processes, gloo): train a tiny p-LaT model sharded with FSDP, each module class named in
``_no_split_modules`` its own unit, and the same model unsharded on the whole batch; rank 0 prints both losses.

Usage: torchrun --nproc_per_node 2 sharded_training_worker.py {text,vision}
"""

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from tiny import classifier, lm, train_losses
from torch.distributed.fsdp import fully_shard

STEPS, LR = 4, 3e-3


def full_batch(family, world_size):
    generator = torch.Generator().manual_seed(1)
    if family == "text":
        ids = torch.randint(2, 61, (2 * world_size, 20), generator=generator)
        return dict(input_ids=ids, labels=ids)
    return dict(pixel_values=torch.randn(2 * world_size, 3, 16, 16, generator=generator),
                labels=torch.randint(0, 5, (2 * world_size,), generator=generator))


def main(family):
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = lm(plap_p=[1.5, 1.5, 2.5, 2.5]) if family == "text" else classifier(plap_p=[1.5, 1.5, 2.5])
    unsharded = copy.deepcopy(model)
    batch = full_batch(family, world_size)

    units = [module for module in model.modules() if type(module).__name__ in model._no_split_modules]
    unit_names = sorted(type(unit).__name__ for unit in units)  # fully_shard renames the classes it wraps
    for unit in units:
        fully_shard(unit)
    fully_shard(model)
    local = {name: tensor.chunk(world_size)[rank] for name, tensor in batch.items()}
    # Every rank holds the same number of tokens / images, so the mean of the local losses is the global loss.
    sharded_losses = []
    for local_loss in train_losses(model, STEPS, LR, **local):
        loss = torch.tensor(local_loss)
        dist.all_reduce(loss)
        sharded_losses.append(loss.item() / world_size)
    local_shards = sum(p.to_local().numel() for p in model.parameters())
    if rank == 0:
        print(json.dumps({
            "units": unit_names,
            "sharded": sharded_losses,
            "single": train_losses(unsharded, STEPS, LR, **batch),
            "local_fraction": local_shards / sum(p.numel() for p in unsharded.parameters()),
        }))
    dist.destroy_process_group()
    # On a loaded machine torch 2.13 sometimes aborts in its own static destructors after an FSDP run on CPU
    # ("terminate called without an active exception", after destroy_process_group has returned): all work is
    # done and reported by now, so leave without running them.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
