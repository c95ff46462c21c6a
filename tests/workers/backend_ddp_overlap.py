"""`gradhub.torch.ddp_forward_overlap` over the backend named in GH_TEST
("gradhub" or "gloo"): DDP whose exchange overlaps the next forward pass
trains as one process does on the combined batch and as plain DDP does, step
for step (SGD with momentum and weight decay, Adam, an LR scheduler, several
buckets, gradient_as_bucket_view on and off, a parameter first used outside
its own module, gradient accumulation under no_sync(), a checkpoint taken
mid-run); what it cannot do is refused with a clear error."""

import datetime
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import gradhub.torch as ght


class Net(nn.Module):
    """Layers of several buckets, and a parameter (`proj.weight`) that the
    model's own forward() may use outside `proj`: before calling it
    ("shared", the default), instead of calling it ("functional"), or not
    ("plain")."""

    def __init__(self, mode: str = "shared"):
        super().__init__()
        self.mode = mode
        self.inp = nn.Linear(10, 64)
        self.body = nn.Sequential(nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU())
        self.proj = nn.Linear(32, 32, bias=False)
        self.out = nn.Linear(32, 3)

    def forward(self, x):
        h = self.body(self.inp(x))
        if self.mode == "functional":
            return self.out(F.linear(h, self.proj.weight))
        if self.mode == "shared":
            h = h + 0.1 * F.linear(h, self.proj.weight)
        return self.out(self.proj(h))


def make(mode: str = "shared") -> nn.Module:
    torch.manual_seed(0)
    return Net(mode)


def batch(step: int, q: int):
    g = torch.Generator().manual_seed(100 * step + q)
    return torch.randn(8, 10, generator=g), torch.randint(0, 3, (8,), generator=g)


def optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)
    return torch.optim.Adam(params, lr=0.01)


def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), (what, (a - b).abs().max())


def equal_to_one_process_and_plain_ddp(kind: str, as_view: bool, steps: int = 12) -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    # 1 KB buckets: every layer in a bucket of its own, several in flight.
    ddp = nn.parallel.DistributedDataParallel(make(), bucket_cap_mb=0.001, gradient_as_bucket_view=as_view)
    plain = nn.parallel.DistributedDataParallel(make(), bucket_cap_mb=0.001)
    single = make()
    opt = optimizer(kind, ddp.parameters())
    overlap = ght.ddp_forward_overlap(ddp, opt)
    opts = [opt, optimizer(kind, plain.parameters()), optimizer(kind, single.parameters())]
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=4, gamma=0.5) for o in opts]
    for step in range(steps):
        x, y = batch(step, r)
        xs, ys = zip(*(batch(step, q) for q in range(n)))
        for model, o, s, (xb, yb) in zip((ddp, plain, single), opts, scheds,
                                         ((x, y), (x, y), (torch.cat(xs), torch.cat(ys)))):
            o.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            o.step()
            s.step()
        if step == 6:
            # A checkpoint mid-run: state_dict() applies the pending updates first.
            saved = {k: v.clone() for k, v in ddp.module.state_dict().items()}
            for (k, v), b in zip(saved.items(), plain.module.state_dict().values()):
                close(v, b, f"{kind} checkpoint {k}")
            assert opt.state_dict()["state"], "the optimizer's state is saved"
    overlap.finish()
    # Every pass but three ran the step before's updates: the first, the one
    # where DDP rebuilds its buckets, and the one after the checkpoint.
    assert overlap.overlapped == steps - 3, overlap.overlapped
    for (name, a), b, c in zip(ddp.module.named_parameters(), plain.module.parameters(), single.parameters()):
        close(a.detach(), b.detach(), f"{kind} view={as_view} {name} vs plain DDP")
        close(a.detach(), c.detach(), f"{kind} view={as_view} {name} vs one process")
    print(f"{kind}, gradient_as_bucket_view={as_view}: {steps} steps equal one process and plain DDP", flush=True)


def accumulation_under_no_sync(steps: int = 6) -> None:
    r = dist.get_rank()
    ddp = nn.parallel.DistributedDataParallel(make(), bucket_cap_mb=0.001, gradient_as_bucket_view=True)
    plain = nn.parallel.DistributedDataParallel(make(), bucket_cap_mb=0.001)
    opt = optimizer("sgd", ddp.parameters())
    ght.ddp_forward_overlap(ddp, opt)
    ref = optimizer("sgd", plain.parameters())
    for step in range(steps):
        for model, o in ((ddp, opt), (plain, ref)):
            o.zero_grad()
            with model.no_sync():
                x, y = batch(step, 10 + r)
                F.cross_entropy(model(x), y).backward()
            x, y = batch(step, r)
            F.cross_entropy(model(x), y).backward()
            o.step()
    opt._gh_ddp_overlap.finish()
    for a, b in zip(ddp.parameters(), plain.parameters()):
        close(a.detach(), b.detach(), "no_sync")
    print("no_sync accumulation equals plain DDP", flush=True)


def parts_started_early(backend: str, steps: int = 8) -> None:
    """DDP's default buckets (the whole model in one here) averaged in parts
    that start as their gradients come in, before DDP hands the bucket over:
    still equal to one process and plain DDP, with the default zero_grad()."""
    r, n = dist.get_rank(), dist.get_world_size()
    ddp = nn.parallel.DistributedDataParallel(make(), gradient_as_bucket_view=True)
    plain = nn.parallel.DistributedDataParallel(make())
    single = make()
    opt = optimizer("adam", ddp.parameters())
    overlap = ght.ddp_forward_overlap(ddp, opt, parts=4, part_bytes=256)
    opts = [opt, optimizer("adam", plain.parameters()), optimizer("adam", single.parameters())]
    for step in range(steps):
        x, y = batch(step, r)
        xs, ys = zip(*(batch(step, q) for q in range(n)))
        for model, o, (xb, yb) in zip((ddp, plain, single), opts, ((x, y), (x, y), (torch.cat(xs), torch.cat(ys)))):
            o.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            o.step()
    overlap.finish()
    for (name, a), b, c in zip(ddp.module.named_parameters(), plain.module.parameters(), single.parameters()):
        close(a.detach(), b.detach(), f"parts {name} vs plain DDP")
        close(a.detach(), c.detach(), f"parts {name} vs one process")
    # One bucket in up to 4 parts; from the third step on (after DDP rebuilt
    # its bucket) each part starts from the gradient hooks, over the gradhub
    # backend only (elsewhere a collective's order must match on every rank).
    assert len(overlap._layouts) == (1 if backend == "gradhub" else 0), overlap._layouts
    if backend == "gradhub":
        runs = overlap._layouts[0].runs
        assert 2 <= len(runs) <= 4, runs
        assert overlap.early == len(runs) * (steps - 2), (overlap.early, runs)
    else:
        assert overlap.early == 0
    print(f"parts started early: {overlap.early}, equal to one process and plain DDP", flush=True)


def refusals() -> None:
    def raises(fn, text: str) -> None:
        try:
            fn()
        except (TypeError, RuntimeError) as e:
            assert text in str(e), (text, str(e))
            return
        raise AssertionError(f"expected an error saying {text!r}")

    m = nn.parallel.DistributedDataParallel(make())
    raises(lambda: ght.ddp_forward_overlap(make(), torch.optim.SGD(m.parameters(), lr=0.1)),
           "must be a DistributedDataParallel")
    raises(lambda: ght.ddp_forward_overlap(m, torch.optim.Adagrad(m.parameters())), "Adagrad is not supported")
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(o, step_size=1)
    raises(lambda: ght.ddp_forward_overlap(m, o), "make the scheduler after")
    # A parameter that a later pass uses outside the module call the first
    # pass placed its update in: refused, never a stale value. Used instead
    # of that call: refused at the end of the forward pass; used before it
    # (then updated in place): refused by torch's backward, whose saved
    # tensor changed.
    for later, text in (("functional", "were used before their update"), ("shared", "modified by an inplace")):
        net = make("plain")
        ddp = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.001)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        ght.ddp_forward_overlap(ddp, opt)
        for step in range(3):   # the first two are synchronous (DDP rebuilds its buckets in the second)
            x, y = batch(step, dist.get_rank())
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
        net.mode = later
        x, y = batch(9, dist.get_rank())
        raises(lambda: F.cross_entropy(ddp(x), y).backward(), text)
    print("refusals: named", flush=True)


if __name__ == "__main__":
    cfg = json.loads(os.environ.get("GH_TEST") or "{}")
    backend = cfg.get("backend", "gradhub")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
    for kind in ("sgd", "adam"):
        for as_view in (True, False):
            equal_to_one_process_and_plain_ddp(kind, as_view)
    accumulation_under_no_sync()
    parts_started_early(backend)
    refusals()
    rank = dist.get_rank()
    dist.destroy_process_group()
    print(f"PASS {rank}", flush=True)
