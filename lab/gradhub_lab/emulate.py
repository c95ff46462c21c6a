"""Emulated training on one worker (run inside an emulated host).

The model is a chain of layers with the profile's true parameter sizes
(divided by `scale`), whose forward and backward "compute" is sleeping for the
layer's share of the iteration time (costs no CPU). Gradients are real
tensors, so wait-free backprop, priorities and forward overlap face the real
timing structure. Systems:
  gradhub  gradhub.torch.DistributedOptimizer (options from the environment)
  ddp      torch DistributedDataParallel over gloo (bucket cap scaled like the model)
  ddp-hook     DDP over gloo with gradhub's comm hook (`gradhub.torch.ddp_comm_hook`)
               in the job the lab starts for gradhub (its scheduler and servers)
  ddp-gradhub  DDP whose process group is the "gradhub" torch.distributed backend
               (`init_process_group("gradhub")` from torchrun's variables: the
               group forms its own job, rank 0's scheduler, a server per host)
  ddp-overlap, ddp-gradhub-overlap  DDP over gloo or over the "gradhub"
               backend with `gradhub.torch.ddp_forward_overlap` (the exchange
               overlaps the next forward pass)
  fsdp-gloo, fsdp-gradhub  FSDP2 (`fully_shard` on every emulated layer, then
               the root; 1-D CPU mesh) over gloo or over the "gradhub" backend
  none     no synchronization: the compute-only upper bound, measured with
           every worker computing at once (they start the timed iterations
           together), so on a shared machine it is what the machine allows

Scale equivalence: every byte count is divided by `scale` (parameters, DDP
buckets, gradhub partitions), so a run at rate R behaves like the full model
at rate scale x R; compute times are not scaled.

FC-faithful mode (`fc` in the config): the profile's fully-connected layers
are real `nn.Linear` modules, each dimension and the batch's rows divided by
sqrt(scale), so both a weight gradient (M x N) and its sufficient factors
(rows x (M + N)) shrink by `scale`, as every other byte count does. Real
activations flow through them and real gradients come out (their compute is
still slept); a sufficient-factor exchange moves real factors and rebuilds
real gradients, whose CPU time is reported (`sfb_rebuild_s`, per iteration).

Config (JSON in GH_BENCH): model, scale, unscaled (DDP's buckets at their
default size), iters, warmup, system, rank, world, ddp_addr (gloo's and the
no-sync run's rendezvous; the gradhub backend's is torchrun's MASTER_ADDR and
MASTER_PORT), and optionally
dump (a path: worker 0 saves the real FC layers' parameters there at the
end), host, local_rank, local_size, netdev (the host's
shaped interface, whose byte counters are read at the start of the first
timed iteration and of one extra, untimed one). Prints one line
`RESULT {json}`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import torch
import torch.nn as nn

from gradhub.plan.models import get as get_profile

from .netns import link_counters


class _Clock:
    """Sleeps off accumulated compute time in chunks, so hundreds of tiny
    layers do not pay hundreds of sleep() overheads."""

    def __init__(self):
        self.deadline = None
        # A straggler's compute takes this many times longer (`--straggler`).
        self.slowdown = 1.0
        # Seconds the sleeps returned after their deadlines, summed: the
        # emulation's own cost on a busy machine (reported per iteration).
        self.late = 0.0

    def spend(self, seconds: float):
        seconds *= self.slowdown
        now = time.perf_counter()
        if self.deadline is None or self.deadline < now:
            self.deadline = now
        self.deadline += seconds
        ahead = self.deadline - now
        if ahead > 2e-4:
            time.sleep(ahead)
            self.late += max(0.0, time.perf_counter() - self.deadline)


CLOCK = _Clock()

# The systems on torch.distributed (DDP, FSDP2), and their process group's backend.
TORCH_SYSTEMS = {"ddp": "gloo", "ddp-hook": "gloo", "ddp-gradhub": "gradhub", "ddp-overlap": "gloo",
                 "ddp-gradhub-overlap": "gradhub", "fsdp-gloo": "gloo", "fsdp-gradhub": "gradhub"}


class _SleepFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fwd, bwd, *params):
        CLOCK.spend(fwd)
        ctx.bwd = bwd
        ctx.shapes = [p.shape for p in params]
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        CLOCK.spend(ctx.bwd)
        grads = tuple(torch.full(s, 1e-6) for s in ctx.shapes)
        return (g, None, None) + grads


class SleepLayer(nn.Module):
    def __init__(self, sizes: list[int], fwd: float, bwd: float):
        super().__init__()
        self.fwd, self.bwd = fwd, bwd
        self.w = nn.ParameterList([nn.Parameter(torch.zeros(max(1, n))) for n in sizes])

    def forward(self, x):
        return _SleepFn.apply(x, self.fwd, self.bwd, *self.w)


class EmulatedModel(nn.Module):
    def __init__(self, profile, scale: float, fc: bool = False, rank: int = 0):
        super().__init__()
        times = profile.compute_times()
        root = math.sqrt(scale)
        self.rows = max(1, round(profile.batch / root))
        layers, self.inputs = [], {}
        for i, (layer, (f, b)) in enumerate(zip(profile.layers, times)):
            if fc and layer.linear:
                fin, fout = (max(1, round(d / root)) for d in layer.linear)
                layers.append(nn.Sequential(SleepLayer([], f, b), nn.Linear(fin, fout)))
                self.inputs[i] = fin
            else:
                layers.append(SleepLayer([math.ceil(n / scale) for n in layer.params], f, b))
        self.layers = nn.ModuleList(layers)
        # Fixed inputs of a run of FC layers, scaled by the chain's value:
        # each worker its own (seeded by rank, outside the state dict, which
        # the systems broadcast from worker 0), so the FC gradients differ
        # between workers and their average is a real one.
        g = torch.Generator().manual_seed(1000 + rank)
        self.feats = {str(i): torch.randn(self.rows, fin, generator=g) * 0.1 for i, fin in self.inputs.items()}

    def forward(self, x):
        h = None
        for i, layer in enumerate(self.layers):
            if i in self.inputs:
                if h is None or h.shape[1] != self.inputs[i]:
                    h = self.feats[str(i)] * x
                h = torch.tanh(layer(h))
            else:
                if h is not None:
                    x, h = x + 1e-3 * h.mean(), None
                x = layer(x)
        return x.sum() + (1e-3 * h.sum() if h is not None else 0)


class _StartTogether:
    """The no-sync run's workers meet (a TCPStore at the DDP address) at the
    start of the timed iterations and again at the end, so the bound is
    measured with all of them computing at once, not one after another."""

    def __init__(self, cfg: dict, rank: int, world: int):
        import datetime

        import torch.distributed as dist

        host, port = cfg["ddp_addr"].rsplit(":", 1)
        self.world, self.rank = world, rank
        self.store = dist.TCPStore(host, int(port), world, rank == 0, timeout=datetime.timedelta(seconds=120))

    def meet(self, key: str, everyone: bool = True) -> None:
        """Wait until every worker is here (everyone=False: only worker 0
        waits, the one holding the store)."""
        self.store.add(key, 1)
        if not everyone and self.rank != 0:
            return
        deadline = time.monotonic() + 120
        while int(self.store.add(key, 0)) < self.world:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no-sync run: not every worker reached '{key}' within 120 s")
            time.sleep(0.0005)


def _local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's values held here: an FSDP2 (DTensor) parameter's own shard."""
    return p.to_local() if hasattr(p, "to_local") else p


def param_error(model: nn.Module, steps: int) -> float:
    """Largest relative deviation of any emulated layer's parameter from what
    `steps` SGD steps on the averaged gradient give. Every worker's gradient
    is 1e-6 everywhere, so the average is too: a wrong sum (a worker counted
    twice or not at all, a stale or misplaced chunk) shows up here. (The real
    FC layers of the FC-faithful mode have real gradients: not checked.)
    Under FSDP each worker checks its own shard of every parameter; the
    shards cover every element once, and the run's error is the largest
    over the workers (runner.summarize)."""
    ref = torch.zeros(1, requires_grad=True)
    o = torch.optim.SGD([ref], lr=1e-3, momentum=0.9)
    for _ in range(steps):
        ref.grad = torch.full((1,), 1e-6)
        o.step()
    want = float(ref.detach()[0])
    with torch.no_grad():
        worst = max((float((_local(p).detach() - want).abs().max())
                     for m in model.modules() if isinstance(m, SleepLayer) for p in m.parameters()
                     if _local(p).numel()), default=0.0)
    return worst / abs(want)


def main():
    cfg = json.loads(os.environ["GH_BENCH"])
    torch.set_num_threads(1)
    profile = get_profile(cfg["model"])
    scale = float(cfg.get("scale", 1))
    system = cfg["system"]
    rank, world = cfg.get("rank", 0), cfg.get("world", 1)
    torch.manual_seed(0)  # the same initial FC weights in every run (`dump` compares systems)
    model = EmulatedModel(profile, scale, bool(cfg.get("fc")), rank)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    if system == "gradhub":
        import gradhub.torch as hvd

        hvd.init()
        rank, world = hvd.rank(), hvd.size()
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    elif system in TORCH_SYSTEMS:
        import torch.distributed as dist

        if TORCH_SYSTEMS[system] == "gradhub":
            import gradhub.torch  # noqa: F401 - registers the backend

            # As under torchrun: MASTER_ADDR/MASTER_PORT, RANK, WORLD_SIZE (set by the lab).
            dist.init_process_group("gradhub")
        else:
            dist.init_process_group("gloo", init_method=f"tcp://{cfg['ddp_addr']}", rank=rank, world_size=world)
        if system == "ddp-hook":
            import gradhub.torch as hvd

            hvd.init()   # the job the lab started (GRADHUB_SCHEDULER, GRADHUB_RANK, ...)
        if system.startswith("fsdp"):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for layer in model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)   # over the shards
        else:
            # DDP's buckets scale with every other byte count, unless the run
            # keeps the defaults a user gets (`unscaled`).
            bucket_mb = 25.0 if cfg.get("unscaled") else 25.0 / scale
            overlap = system.endswith("-overlap")
            model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb,
                                                        gradient_as_bucket_view=overlap)
            if system == "ddp-hook":
                model.register_comm_hook(None, hvd.ddp_comm_hook)
            if overlap:
                import gradhub.torch as ght

                opt = ght.ddp_forward_overlap(model, opt).opt
    elif system != "none":
        raise ValueError(f"unknown system {system!r}")
    together = _StartTogether(cfg, rank, world) if system == "none" and world > 1 else None
    if rank == world - 1:
        CLOCK.slowdown = float(cfg.get("straggler", 1.0))
    x = torch.ones(1, requires_grad=True)
    times, lates = [], []
    t_start = time.time()
    dev = cfg.get("netdev")
    warmup, iters = cfg.get("warmup", 3), cfg.get("iters", 10)
    net0 = net1 = None
    # The link's counters are read at the start of the first timed iteration
    # and at the start of one more, untimed, iteration: the same point of the
    # cycle, so traffic still in flight (forward overlap) counts once.
    extra = 1 if dev else 0
    # GRADHUB_AUTOTUNE: the trials run first, untimed (every worker ends them
    # at the same step: they take the same decisions).
    tuner, tuning = getattr(opt, "_gh_tuner", None), 0
    while tuner is not None and not tuner.done and tuning < 500:
        opt.zero_grad()
        model(x).backward()
        opt.step()
        tuning += 1
    for i in range(warmup + iters + extra):
        if i == warmup:
            if together is not None:
                together.meet("timed")
            net0 = link_counters(dev)
            t_start, main0 = time.time(), time.thread_time()
        if i == warmup + iters:
            net1, t_end, main1 = link_counters(dev), time.time(), time.thread_time()
        t0, late0 = time.perf_counter(), CLOCK.late
        opt.zero_grad()
        model(x).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        lates.append(CLOCK.late - late0)
    if system == "gradhub" and hasattr(opt, "finish"):
        opt.finish()
    if system.endswith("-overlap"):
        opt._gh_ddp_overlap.finish()
    if together is not None:
        together.meet("done", everyone=False)  # worker 0 holds the store: it leaves last
    if not extra:
        t_end, main1 = time.time(), time.thread_time()
    steps = len(times) + tuning
    times = times[warmup:warmup + iters]
    lates = lates[warmup:warmup + iters]
    res = {
        "rank": rank,
        "world": world,
        "system": system,
        "model": profile.name,
        "scale": scale,
        "batch": profile.batch,
        "compute_per_iter": profile.time_per_batch,
        "iter_times": times,
        "sleep_late_s": sum(lates) / max(1, len(lates)),
        # This process's main (training) thread's CPU per timed iteration:
        # forward, backward, the hooks and step(), and what it sends itself.
        "main_cpu_s": (main1 - main0) / max(1, iters),
        "t_start": t_start, "t_end": t_end,
        "host": cfg.get("host"), "local_rank": cfg.get("local_rank", 0), "local_size": cfg.get("local_size", 1),
        "params_scaled": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "options": {k: os.environ.get(k) for k in ("GRADHUB_OVERLAP_FORWARD", "GRADHUB_OPTIMIZER_ON_SERVER",
                                                   "GRADHUB_SCHEDULING", "GRADHUB_HOST_REDUCE", "GRADHUB_ASYNC")
                    if os.environ.get(k)},
    }
    if system == "gradhub":
        # Whether step() updated eagerly (GRADHUB_EAGER_UPDATE): the simulator predicts the run as it ran.
        res["eager_update"] = getattr(getattr(opt, "_gh_mode", None), "eager_steps", 0) > 0
        if hasattr(opt, "_gh_schedule"):
            res["scheduling"] = opt._gh_schedule()
    if tuner is not None:
        res["autotune"] = {"steps": tuning, "trials": len(tuner.trials), "choice": tuner.best.describe(),
                           "gain": tuner.start_time / tuner.best_time if tuner.best_time else None}
    sfb = getattr(opt, "_gh_sfb", None)
    if sfb is not None:
        res["sfb_layers"] = len(sfb.chosen)
        res["sfb_rebuild_s"] = sfb.rebuild_seconds / max(1, steps - 1)
    if net0 and net1:
        res["net"] = {"tx0": net0[0], "rx0": net0[1], "tx1": net1[0], "rx1": net1[1]}
    # (Asynchronous workers that finish first have not seen the others' last
    # changes: their parameters are not the reference's.)
    if os.environ.get("GRADHUB_ASYNC") != "1":
        res["param_error"] = param_error(model, steps)
    if cfg.get("dump"):
        # The real FC layers' parameters after training: the bench compares
        # every system's with DDP's (the average of the same gradients).
        # FSDP's are gathered whole (a collective: every worker takes part).
        net = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        fc = {n: p.detach() for n, p in net.named_parameters()
              if isinstance(net.get_submodule(n.rsplit(".", 1)[0]), nn.Linear)}
        fc = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).clone() for n, p in fc.items()}
        if rank == 0:
            torch.save(fc, cfg["dump"])
    print("RESULT " + json.dumps(res), flush=True)
    if system in TORCH_SYSTEMS:
        import torch.distributed as dist

        dist.destroy_process_group()   # the gradhub backend's job ends with it
    if system in ("gradhub", "ddp-hook"):
        hvd.shutdown()


if __name__ == "__main__":
    sys.exit(main())
