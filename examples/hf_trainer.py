"""Hugging Face Transformers' `Trainer` with gradhub as its torch.distributed backend.

    python -m torch.distributed.run --nproc-per-node 2 examples/hf_trainer.py
    gradhub launch -w 2 -s 1 -- python examples/hf_trainer.py

`TrainingArguments(ddp_backend="gradhub")` is refused: the field's choices
are NCCL, gloo, MPI and vendors' backends, and on CPUs (`use_cpu=True`)
Accelerate, which sets up the Trainer's processes, stops with "Your
assigned backend gradhub is not available, please use gloo". But, as
Accelerate itself does (examples/accelerate_train.py), the Trainer keeps a
process group that already exists: so the script creates it first,
`dist.init_process_group("gradhub")` with no arguments (torch's env://
rendezvous on what torchrun or `gradhub launch` exports), leaves
`ddp_backend` unset, and the Trainer's DDP, data sharding and barriers then
run on gradhub.

A tiny GPT-2 built from its config here (no download) learns synthetic
sequences made here (each token the previous plus a stride that the
sequence's first token fixes). At the end every rank checks that the ranks
read disjoint shares of the data, that all ranks nevertheless hold
bit-identical parameters (gathered through the process group) and that the
loss over the whole data set fell to under half, then prints `PASS rank
<r>/<n>` with a digest of its parameters, which tests/test_frameworks.py
compares across ranks.
"""

import argparse
import hashlib
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.utils import logging as hf_logging

import gradhub.torch  # noqa: F401  registers the "gradhub" torch.distributed backend

VOCAB = 32
SEQ = 16
PER_DEVICE_BATCH = 8


class Strides(Dataset):
    """Sequences t, t + s, t + 2s, ... (mod VOCAB) with s = 1 + t % 3: a
    language model learns them in a few steps. Labels are the inputs (the
    model shifts them). `seen` lists the samples this process has read."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        self.ids = (start + (1 + start % 3) * torch.arange(SEQ)) % VOCAB
        self.seen: list[int] = []

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        self.seen.append(i)
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_model() -> GPT2LMHeadModel:
    """Two layers, width 32, no dropout: built from the config, the same on every rank."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, n_inner=64,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def full_loss(model: nn.Module, data: Strides) -> float:
    model.eval()
    with torch.no_grad():
        return model(input_ids=data.ids, labels=data.ids).loss.item()


def main():
    p = argparse.ArgumentParser(description="Hugging Face Trainer on the gradhub backend")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-2)
    args = p.parse_args()

    # The process group first: TrainingArguments and the Trainer keep it (ddp_backend stays unset).
    dist.init_process_group("gradhub")
    r, n = dist.get_rank(), dist.get_world_size()
    hf_logging.set_verbosity_error()   # the Trainer's progress notes, not our checks
    data = Strides(PER_DEVICE_BATCH * n * args.steps)   # exactly `steps` global batches
    model = make_model()
    before = full_loss(model, data)
    with tempfile.TemporaryDirectory(prefix="hf-trainer-") as out:
        targs = TrainingArguments(output_dir=out, use_cpu=True, per_device_train_batch_size=PER_DEVICE_BATCH,
                                  max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="constant",
                                  seed=0, report_to="none", save_strategy="no", logging_steps=5,
                                  disable_tqdm=True, dataloader_num_workers=0, ddp_find_unused_parameters=False)
        assert (targs.process_index, targs.world_size) == (r, n) and n > 1, (targs.process_index, targs.world_size)
        trainer = Trainer(model=model, args=targs, train_dataset=data)
        result = trainer.train()
    assert result.global_step == args.steps, result.global_step
    assert isinstance(trainer.model_wrapped, DistributedDataParallel), type(trainer.model_wrapped)
    assert dist.get_backend() == "gradhub", dist.get_backend()

    flat = nn.utils.parameters_to_vector(model.parameters()).detach().contiguous()
    every = [torch.empty_like(flat) for _ in range(n)]
    dist.all_gather(every, flat)
    assert all(torch.equal(e, every[0]) for e in every), "ranks disagree on the parameters"
    # ... though each rank trained on its own share of the data (so only the exchanged gradients make them agree).
    counts = torch.bincount(torch.tensor(data.seen), minlength=len(data))
    shards = [torch.empty_like(counts) for _ in range(n)]
    dist.all_gather(shards, counts)
    assert all(s.sum() == len(data) // n for s in shards) and torch.equal(sum(shards), torch.ones_like(counts)), \
        "the ranks' samples are not disjoint shares of the data set"
    after = full_loss(model, data)
    assert after < 0.5 * before, (before, after)
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
    dist.barrier()
    dist.destroy_process_group()
    print(f"PASS rank {r}/{n}: Trainer on gradhub, {result.global_step} steps; parameters identical on every "
          f"rank (sha256 {digest}); loss {before:.3f} -> {after:.3f}", flush=True)


if __name__ == "__main__":
    main()
