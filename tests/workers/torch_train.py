"""Worker: train a small model with gradhub.torch on this rank's shard and
check it against single-process training on the combined batch.

Config: model (mlp|cnn|deep: many small tensors|plist|embed: sparse gradients|outside: parameters used
outside their module's forward|funcs: custom autograd functions on parameters no torch function is given),
fusion (DistributedOptimizer's fusion_threshold), opt (sgd|sgd0: no momentum nor decay|nesterov|adamw),
overlap (bool), server (optimizer on the servers), predivide (gradient_predivide_factor),
sparse_as_dense (bool), autocast (bool: forward under CPU bfloat16 autocast), sfb (auto|force|off: sufficient factors for nn.Linear weights),
fc1_bias (bool, default true: the fc model's first layer has a bias),
reload_at (a step: before it, both optimizers load a copy of their state with the buffers zeroed),
eager (bool: assert that step() updated eagerly, GRADHUB_EAGER_UPDATE, in every step, or in none),
steps, passes (backward_passes_per_step), compression (none|fp16), step_sleep (seconds after each
step, which prints STEP k: the failover tests kill a server meanwhile), autotune (bool: overlap left
to GRADHUB_AUTOTUNE, and the tensors held at the end printed), hold_at and hold_file (after step
hold_at, wait until hold_file exists, at most 120 s: the test acts on the running job first).
"""

import copy
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import gradhub.api as gradhub_api
import gradhub.torch as hvd
from common import CONFIG

torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)
# double: the whole model, its data and its loss in float64 (a reduction
# that rounds through float32 anywhere shows as ~1e-8, far above param_tol)
LOSS_DTYPE = torch.float64 if CONFIG.get("double") else torch.float32
torch.set_default_dtype(LOSS_DTYPE)
hvd.init()
r, n = hvd.rank(), hvd.size()
model_kind = CONFIG.get("model", "mlp")
opt_kind = CONFIG.get("opt", "sgd")
autotuned = CONFIG.get("autotune", False)
overlap = None if autotuned else CONFIG.get("overlap", False)
server = CONFIG.get("server", False)
steps = CONFIG.get("steps", 20)
passes = CONFIG.get("passes", 1)
per_worker = CONFIG.get("batch", 8)
sched = CONFIG.get("sched", False)  # a StepLR schedule: hyperparameters change mid-run
compression = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}[CONFIG.get("compression", "none")]


class PListNet(nn.Module):
    """Parameters held in a ParameterList (a container whose forward never runs)."""

    def __init__(self):
        super().__init__()
        self.ws = nn.ParameterList([nn.Parameter(torch.randn(32, 20) * 0.2), nn.Parameter(torch.randn(5, 32) * 0.2)])
        self.bs = nn.ParameterList([nn.Parameter(torch.zeros(32)), nn.Parameter(torch.zeros(5))])

    def forward(self, x):
        return F.linear(torch.tanh(F.linear(x, self.ws[0], self.bs[0])), self.ws[1], self.bs[1])


class EmbedNet(nn.Module):
    """An embedding with sparse gradients (rows of the table looked up by the batch)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(40, 8, sparse=True)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        return self.fc(self.emb((x.abs() * 10).long() % 40).mean(1))


class _Scale(torch.autograd.Function):
    """x * w elementwise, with its own backward (a custom autograd function)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0)


class OutsideNet(nn.Module):
    """Parameters used outside the forward() of the module that owns them:
    `enc` is never called (its weight is used functionally, and tied: its
    transpose decodes), `gate` is never called (its parameter goes through a
    custom autograd function)."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(20, 32)
        self.gate = nn.Module()
        self.gate.w = nn.Parameter(torch.rand(32) + 0.5)
        self.head = nn.Linear(20, 5)

    def forward(self, x):
        h = torch.tanh(_Scale.apply(F.linear(x, self.enc.weight, self.enc.bias), self.gate.w))
        return self.head(torch.tanh(F.linear(h, self.enc.weight.t())))


class _KernelLinear(torch.autograd.Function):
    """x @ w.T + b with its own backward, computed as an extension kernel
    would be: out of sight of torch function modes (so only autograd's graph
    records that w and b were used)."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        with torch._C.DisableTorchFunction():
            return torch.addmm(b, x, w.t())

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x, g.sum(0)


class FuncsNet(nn.Module):
    """Layers as custom autograd functions that the parent's forward() applies
    to the parameters (p0, p1) of child modules that are never called."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList()
        for fan_in, fan_out in ((20, 32), (32, 32), (32, 5)):
            blk = nn.Module()
            blk.p0 = nn.Parameter(torch.randn(fan_out, fan_in) / fan_in ** 0.5)
            blk.p1 = nn.Parameter(torch.zeros(fan_out))
            self.blocks.append(blk)

    def forward(self, x):
        for i, blk in enumerate(self.blocks):
            x = _KernelLinear.apply(x, blk.p0, blk.p1)
            x = torch.tanh(x) if i + 1 < len(self.blocks) else x
        return x


class FcNet(nn.Module):
    """Fully-connected layers in every case sufficient factors must handle:
    3-D input (rows = batch x positions), a layer called twice per forward,
    a frozen layer, a weight also used outside its layer (not the sum of its
    factors: it must go through the servers)."""

    def __init__(self):
        super().__init__()
        # Without a bias, fc1's output needs its weight's gradient (the input
        # needs none): autograd computes it, and the factors replace it.
        self.fc1 = nn.Linear(10, 48, bias=CONFIG.get("fc1_bias", True))
        self.shared = nn.Linear(48, 48)
        self.frozen = nn.Linear(48, 48)
        self.frozen.requires_grad_(False)
        self.tied = nn.Linear(48, 24)
        self.out = nn.Linear(24, 5)

    def forward(self, x):
        h = torch.tanh(self.fc1(x.view(x.shape[0], 2, 10))).mean(1)
        h = torch.tanh(self.shared(torch.tanh(self.shared(h))))
        h = self.frozen(h)
        h = torch.tanh(self.tied(h)) + 0.1 * F.linear(h, self.tied.weight)
        return self.out(h)


def make_model():
    torch.manual_seed(1234)
    if model_kind == "fc":
        return FcNet()
    if model_kind == "plist":
        return PListNet()
    if model_kind == "outside":
        return OutsideNet()
    if model_kind == "funcs":
        return FuncsNet()
    if model_kind == "embed":
        return EmbedNet()
    if model_kind == "mlp":
        return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 5))
    if model_kind == "deep":
        # Many small tensors (Linear + LayerNorm blocks): what tensor fusion packs.
        blocks = [m for _ in range(6) for m in (nn.Linear(20, 20), nn.LayerNorm(20), nn.Tanh())]
        return nn.Sequential(*blocks, nn.Linear(20, 5))
    return nn.Sequential(nn.Conv2d(1, 6, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 8, 3), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 2 * 2, 16), nn.ReLU(), nn.Linear(16, 5))


def make_opt(params):
    if opt_kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)
    if opt_kind == "sgd0":
        return torch.optim.SGD(params, lr=0.5)
    if opt_kind == "nesterov":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=1e-2)


def rows(step):
    """Each worker's batch at this step (config grow: times this from step grow_at on; below 1 it shrinks)."""
    return int(per_worker * (CONFIG.get("grow", 1) if step >= CONFIG.get("grow_at", 1 << 30) else 1))


def batch(step):
    """The combined batch of all workers for this step (same on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    total = rows(step) * n
    x = torch.randn(total, 1, 8, 8, generator=g) if model_kind == "cnn" else torch.randn(total, 20, generator=g)
    y = torch.randint(0, 5, (total,), generator=g)
    return x, y


# Reference: one process on the combined batch (with the same accumulation).
ref = make_model()
ref_opt = make_opt(ref.parameters())
if not server:
    # What the distributed run's broadcast_optimizer_state does to a fresh
    # optimizer, as Horovod's does: make its state with one zero-gradient step.
    for p in ref.parameters():
        p.grad = torch.zeros_like(p)
    ref_opt.step()
    ref_opt.zero_grad()
ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=5, gamma=0.5) if sched else None
ref_losses = []
reload_at = CONFIG.get("reload_at")


def reload_zeroed(o) -> None:
    """load_state_dict() of a copy of o's state with its buffers zeroed (a
    checkpoint or an elastic rollback replaces the optimizer's state so)."""
    sd = copy.deepcopy(o.state_dict())
    for st in sd["state"].values():
        for k, v in st.items():
            if torch.is_tensor(v) and k != "step":
                v.zero_()
    o.load_state_dict(sd)


for s in range(steps):
    if s == reload_at:
        reload_zeroed(ref_opt)
    ref_opt.zero_grad()
    for k in range(passes):
        x, y = batch(s * passes + k)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=CONFIG.get("autocast", False)):
            loss = F.cross_entropy(ref(x).to(LOSS_DTYPE), y)
        loss.backward()
    ref_losses.append(loss.item())
    ref_opt.step()
    if ref_sched:
        ref_sched.step()

# Distributed: each rank trains on its shard.
model = make_model()
opt = hvd.DistributedOptimizer(make_opt(model.parameters()), named_parameters=model.named_parameters(),
                               compression=compression, backward_passes_per_step=passes, overlap_forward=overlap,
                               optimizer_on_server=server, gradient_predivide_factor=CONFIG.get("predivide", 1.0),
                               sparse_as_dense=CONFIG.get("sparse_as_dense", False),
                               sufficient_factors=CONFIG.get("sfb"), fusion_threshold=CONFIG.get("fusion"))
assert opt._gh_server == server
fusion = opt._gh_fusion
print(f"FUSED {len(fusion.buckets) if fusion else 0} buckets of {len(fusion.of) if fusion else 0} tensors", flush=True)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(opt, root_rank=0)
lr_sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5) if sched else None
losses = []
deferred = 0
first = next(model.parameters())
for s in range(steps):
    if s == reload_at:
        reload_zeroed(opt)
    opt.zero_grad()
    for k in range(passes):
        x, y = batch(s * passes + k)
        b = rows(s * passes + k)
        xs, ys = x[r * b:(r + 1) * b], y[r * b:(r + 1) * b]
        before = first.detach().clone()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=CONFIG.get("autocast", False)):
            out = model(xs).to(LOSS_DTYPE)
        # With overlap_forward, step() only schedules updates: the first layer
        # changes during the forward pass, not before.
        deferred += int(k == 0 and s > 0 and not torch.equal(before, first.detach()))
        loss = F.cross_entropy(out, ys)
        loss.backward()
    # Loss of the combined batch, from every worker's shard loss.
    losses.append(hvd.allreduce(loss.detach(), name="loss", op=hvd.Average).item())
    if model_kind == "embed":
        opt.synchronize()
        # Sparse again after the reduction, also with sparse_as_dense (how it travels), as in Horovod.
        assert model.emb.weight.grad.is_sparse, model.emb.weight.grad.layout
        with opt.skip_synchronize():
            opt.step()
    else:
        opt.step()
    if lr_sched:
        lr_sched.step()
    if "step_sleep" in CONFIG:
        print("STEP", s, flush=True)
        time.sleep(CONFIG["step_sleep"])
    if s == CONFIG.get("hold_at") and "hold_file" in CONFIG:
        # The test does something to the running job first (bounded).
        until = time.monotonic() + 120
        while not os.path.exists(CONFIG["hold_file"]) and time.monotonic() < until:
            time.sleep(0.02)
if hasattr(opt, "finish"):
    opt.finish()

if overlap and model_kind == "deep":
    # Updates applied a module at a time: one optimizer call per Linear or LayerNorm (weight and bias),
    # and one for all at finish().
    print(f"UPDATES IN GROUPS OF {sorted({len(k) for k in opt._gh_mode.where.partial.sub})}", flush=True)
if autotuned:
    # Every tensor of the layouts tried and not chosen was released.
    held = gradhub_api._require().num_tensors()
    print(f"HELD {held - len(opt._gh_declarations())} beyond the layout's; "
          f"tuner {'done' if getattr(opt, '_gh_tuner', None) is None or opt._gh_tuner.done else 'not done'}",
          flush=True)

if "sfb_layers" in CONFIG:
    chosen = sorted(opt._gh_names[pid] for pid in opt._gh_sfb.chosen)
    assert chosen == sorted(CONFIG["sfb_layers"]), chosen
    # After the decision autograd leaves the chosen weights' own gradients to the factors.
    assert not chosen or steps < 2 or opt._gh_sfb.skipped_calls > 0, opt._gh_sfb.skipped_calls
if model_kind in ("mlp", "cnn") and not autotuned:
    # GRADHUB_SCHEDULING=auto: forward order with forward overlap (these models use their parameters
    # in registration order), else all equal (in order of readiness); `size`: the largest first.
    ps = [p for p in model.parameters() if p.requires_grad]
    prio = [opt._gh_priority(p) for p in ps]
    sched = os.environ.get("GRADHUB_SCHEDULING", "auto")
    if sched == "size":
        size = [p.numel() for p in ps]
        assert all(prio[i] > prio[j] for i in range(len(ps)) for j in range(len(ps)) if size[i] > size[j]), prio
    elif overlap or sched == "priority":
        assert prio == sorted(prio, reverse=True) and len(set(prio)) == len(prio), prio
    else:
        assert len(set(prio)) == 1, prio
if "eager" in CONFIG:
    # The synchronous step's eager update (GRADHUB_EAGER_UPDATE) ran, or not.
    assert (opt._gh_mode.eager_steps == steps) == CONFIG["eager"], opt._gh_mode.eager_steps
if overlap and opt_kind != "none":
    assert deferred == steps - 1, f"updates were applied in {deferred} of {steps - 1} forward passes"
worst = 0.0
for (name, p), q in zip(model.named_parameters(), ref.parameters()):
    rel = ((p.detach() - q.detach()).abs().max() / (q.detach().abs().max() + 1e-12)).item()
    worst = max(worst, rel)
# Identical parameters on every worker: compare with rank 0's.
for name, p in model.named_parameters():
    p0 = hvd.broadcast(p.detach(), 0, name=f"check.{name}")
    assert torch.equal(p0, p.detach()), f"rank {r}: {name} differs from rank 0"
loss_gap = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(losses, ref_losses))
print(f"rank {r}: max relative parameter difference {worst:.2e}, max relative loss gap {loss_gap:.2e}", flush=True)
if opt_kind == "adamw":
    tol = CONFIG.get("loss_tol", 0.02)
    assert loss_gap < tol, f"loss curve differs by {loss_gap:.3e} (tolerance {tol})"
else:
    tol = CONFIG.get("param_tol", 1e-5)
    assert worst < tol, f"parameters differ from single-process training by {worst:.3e} (tolerance {tol})"
    assert loss_gap < 1e-4, f"loss curve differs by {loss_gap:.3e}"
print("PASS", r, flush=True)
hvd.shutdown()
