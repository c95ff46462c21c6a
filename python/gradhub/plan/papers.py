"""The seed papers' published results, predicted by the planner: profiles
built from what each paper states (model, batch, GPU, network), the
paper's figure beside the prediction (docs/planning.md, "The papers'
results, reproduced"; `python -m gradhub.plan.papers` prints the table).

Only what a paper states is taken from it; where it leaves something out
(a model's size, the compute time per batch), the row says what was
assumed and where that comes from. Compute per batch, where no paper
measures it for its GPU:

- V100: ResNet-50 at 1270 images/s (TensorFlow, mixed precision,
  batch 256: NVIDIA DeepLearningExamples' published benchmark, quoted in
  github.com/NVIDIA/DeepLearningExamples/issues/837), i.e. 31.3 TFLOP/s effective on its FLOPs; VGG-16 at
  the same effective rate; BERT-large at the built-in profiles' transformer
  estimate (6 x parameters x tokens at 25 TFLOP/s).
- P4000 (P3) and GTX 1080 Ti (PHub): PHub's Table 3 times (measured on a
  1080 Ti, batch 32), for the P4000 scaled by peak FP32 (11.3 / 5.3
  TFLOP/s, NVIDIA's specifications).

The all-reduce baseline of BytePS is Horovod 0.19 with NCCL 2.5.7
(`simulate_ddp(..., fusion="horovod")`); BytePS itself is predicted by
gradhub's model (the same summation split; its RDMA at the paper's
measured 90 Gbit/s goodput), P3 and PHub by gradhub's model with their
settings."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from . import models as bp
from .cluster import Cluster, Options
from .costs import Costs
from .ddp import simulate_ddp
from .profile import SimLayer, SimProfile, _bert_large
from .sim import simulate_gradhub

V100_RESNET50_IMG_S = 1270.0     # DeepLearningExamples, TF ResNet-50 v1.5, AMP + XLA, batch 256, 1 V100
TRANSFORMER_FLOP_S = 25e12       # the built-in profiles' estimate for a V100 in mixed precision
P4000_OVER_1080TI = 5.3 / 11.3   # peak FP32 TFLOP/s (NVIDIA's specifications)
BYTEPS_GOODPUT = 0.9             # BytePS §7.1: point-to-point RDMA goodput ~90 Gbit/s on 100 GbE
TOLERANCE = 0.15


def _sim_profile(p: bp.Profile, time_s: float, name: str) -> SimProfile:
    """A built-in model (models.py) with its compute set to time_s per batch (split by FLOPs, backward 2x forward)."""
    p = bp.Profile(p.name, p.batch, time_s, p.layers, p.source)
    layers = [SimLayer(l.name, [4 * n for n in l.params], f, b) for l, (f, b) in zip(p.layers, p.compute_times())]
    return SimProfile(name, p.batch, layers, p.source)


def _flops(p: bp.Profile) -> float:
    return sum(l.flops for l in p.layers)


def v100_profiles() -> dict[str, SimProfile]:
    """BytePS §7.4's models whose architecture is public and whose batch
    the paper states (Fig. 15-16 captions), as run on a V100."""
    r50 = bp.resnet50(256)
    rate = 3 * _flops(r50) / 256 * V100_RESNET50_IMG_S          # effective FLOP/s of a V100 on a CNN
    vgg = bp.Profile("vgg16", 96, 0.0, bp.vgg_layers([64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512,
                                                       512, "M", 512, 512, 512, "M"], 96), "")
    bert = _bert_large()
    tokens = 8192
    bert = bp.transformer("bert_large", 30522, 512, 24, 1024, 4096, tokens,
                           6 * bert.num_params * tokens / TRANSFORMER_FLOP_S, "", True)
    return {
        "resnet50": _sim_profile(r50, 256 / V100_RESNET50_IMG_S, "ResNet-50 (TF, 256 images/GPU)"),
        "vgg16": _sim_profile(vgg, 3 * _flops(vgg) / rate, "VGG-16 (MXNet, 96 images/GPU)"),
        "bert_large": _sim_profile(bert, bert.time_per_batch, "BERT-large (MXNet, 8192 tokens/GPU)"),
    }


def phub_profiles(scale_time: float = 1.0) -> dict[str, SimProfile]:
    """PHub's Table 3 models (batch 32, times on a 1080 Ti), times x scale_time."""
    out = {}
    for name, make, t in (("resnet50", bp.resnet50, 0.161), ("inception_v3", bp.inception_v3, 0.225),
                          ("vgg19", bp.vgg19, 0.268), ("alexnet", bp.alexnet, 0.016)):
        out[name] = _sim_profile(make(32), t * scale_time, name)
    return out


def efficiency(samples_per_s: float, p: SimProfile, c: Cluster) -> float:
    return samples_per_s / (c.workers * p.batch / p.compute_s)


@dataclass
class Row:
    source: str
    claim: str
    paper: float | tuple[float, float]        # a figure, or a range (low, high)
    predicted: float
    unit: str = "x"                           # "x" (ratio), "%" (efficiency)
    why: str = ""                             # the reason where the error exceeds TOLERANCE
    assumed: str = ""

    @property
    def error(self) -> float:
        """Relative error; for a range, the distance outside it (0 inside)."""
        if isinstance(self.paper, tuple):
            lo, hi = self.paper
            if lo <= self.predicted <= hi:
                return 0.0
            ref = lo if self.predicted < lo else hi
            return self.predicted / ref - 1
        return self.predicted / self.paper - 1

    @property
    def within(self) -> bool:
        return abs(self.error) <= TOLERANCE


def _fmt(v, unit: str) -> str:
    if isinstance(v, tuple):
        if v[1] == math.inf:
            return f"above {_fmt(v[0], unit)}"
        return " to ".join(_fmt(x, unit) for x in v)
    return f"{v:.1%}" if unit == "%" else f"{v:.2f}x"


def byteps_74(costs: Costs) -> list[Row]:
    """BytePS §7.4: 32 machines x 8 V100 (NVLink), one 100 GbE NIC each
    (RoCEv2), k = 32 CPU machines with BytePS or none, Horovod + NCCL."""
    profs = v100_profiles()
    base = Cluster(32, 8, 0, True, 100e9, gpu_link="nvlink", transport="rdma", link_efficiency=BYTEPS_GOODPUT)
    rows = []
    res = {}
    for name, p in profs.items():
        ddp = simulate_ddp(p, base, costs, fusion="horovod")
        with_cpu = simulate_gradhub(p, replace(base, cpu_servers=32), Options(), costs)
        without = simulate_gradhub(p, base, Options(), costs)
        res[name] = (ddp, with_cpu, without)
    d, w, wo = res["resnet50"]
    p = profs["resnet50"]
    why_ar = ("the model's all-reduce runs at NCCL's predicted speed and overlaps backward perfectly: at 256 "
              "GPUs Horovod's per-cycle negotiation, stragglers and NCCL's kernels slowing the compute they "
              "overlap are not modelled (no published figure for them)")
    rows.append(Row("BytePS §7.4", "ResNet-50, 256 GPUs: all-reduce scaling efficiency", 0.88,
                    efficiency(d.samples_per_s, p, base), "%", why_ar, "compute: 1270 images/s per V100"))
    rows.append(Row("BytePS §7.4", "ResNet-50, 256 GPUs: BytePS (32 CPU machines) scaling efficiency", 0.975,
                    efficiency(w.samples_per_s, p, base), "%"))
    rows.append(Row("BytePS §7.4", "ResNet-50, 256 GPUs: BytePS over all-reduce (32 CPU machines)", 0.975 / 0.88,
                    w.samples_per_s / d.samples_per_s, "x", "the all-reduce row's"))
    for name in ("vgg16", "bert_large"):
        d, w, wo = res[name]
        p = profs[name]
        note = "compute: 31.3 TFLOP/s (ResNet-50's measured rate)" if name == "vgg16" else \
            "compute: 6 x params x tokens at 25 TFLOP/s"
        rows.append(Row("BytePS §7.4", f"{p.name}, 256 GPUs: BytePS over all-reduce, with CPU machines (range over "
                        "six models)", (1.10, 1.84), w.samples_per_s / d.samples_per_s, "x",
                        "compute-bound at 100 Gbit/s in the model, as ResNet-50 (the all-reduce row's reasons)",
                        note))
        rows.append(Row("BytePS §7.4", f"{p.name}, 256 GPUs: BytePS over all-reduce, without CPU machines (range)",
                        (1.09, 1.53), wo.samples_per_s / d.samples_per_s, "x",
                        "compute-bound at 100 Gbit/s in the model, as ResNet-50 (the all-reduce row's reasons)",
                        note))
        rows.append(Row("BytePS §7.4", f"{p.name}, 256 GPUs: BytePS scaling efficiency (at least, five models)",
                        (0.916, 1.0), efficiency(w.samples_per_s, p, base), "%", "", note))
    return rows


def byteps_fig13(costs: Costs) -> list[Row]:
    """BytePS Fig. 13: 8 machines x 8 V100 (NVLink or PCIe only), 0 to 8
    CPU machines, PyTorch, Horovod + NCCL. Its models (UGATIT, GPT-2) are not
    reconstructible from the paper (sizes not stated): the rows predict the
    same claims for its other models, at its other batches."""
    profs = v100_profiles()
    rows = []
    gains = {}
    for link in ("nvlink", "pcie"):
        base = Cluster(8, 8, 0, True, 100e9, gpu_link=link, transport="rdma", link_efficiency=BYTEPS_GOODPUT)
        for name, p in profs.items():
            ddp = simulate_ddp(p, base, costs, fusion="horovod")
            by_k = [simulate_gradhub(p, replace(base, cpu_servers=k), Options(), costs).samples_per_s
                    for k in range(0, 9)]
            gains[(link, name)] = (max(by_k) / by_k[0], max(by_k) / ddp.samples_per_s)
    why = ("the figure's models are UGATIT and GPT-2 at 2 images and 80 tokens per GPU, whose sizes the paper "
           "does not state; these models are compute-bound on 8 x 8 V100 at 100 Gbit/s, where CPU machines "
           "cannot help much")
    best_cpu = max(g[0] for g in gains.values())
    best_ar = max(g[1] for g in gains.values())
    rows.append(Row("BytePS Fig. 13", "8 x 8 V100: gain of 8 CPU machines over none (up to)", 1.20, best_cpu, "x",
                    why, "ResNet-50, VGG-16, BERT-large at §7.4's batches, NVLink and PCIe"))
    rows.append(Row("BytePS Fig. 13", "8 x 8 V100: BytePS over all-reduce, best case (up to)", 1.45, best_ar, "x",
                    why, "the same"))
    nv = max(gains[("nvlink", n)][1] for n in profs)
    pc = max(gains[("pcie", n)][1] for n in profs)
    rows.append(Row("BytePS Fig. 13", "NVLink machines gain more over all-reduce than PCIe-only ones (NVLink's best "
                    "gain / PCIe's)", (1.0, math.inf), nv / pc, "x",
                    "", "the same"))
    return rows


def p3(costs: Costs) -> list[Row]:
    """P3 §5.3: 4 machines, one P4000 each, InfiniBand throttled by tc;
    baseline MXNet's PS (a server per machine, layer by layer in backward
    order; arrays over 1M elements split over the servers), P3 (50k-parameter
    slices, priority by forward order, the next forward overlapped)."""
    profs = phub_profiles(1 / P4000_OVER_1080TI)
    base = Cluster(4, 1, 0, True, 1e9)
    p3opt = Options(partition_bytes=200_000, fusion_threshold=0, scheduling="priority", overlap_forward=True)

    def mxnet(p: SimProfile) -> Options:
        # MXNet's KVStore: one push_pull per array, arrays split evenly over the servers: one chunk per
        # server for the largest (the model has one partition size for every tensor: the largest array's
        # share; smaller arrays go whole, as MXNet sends arrays under its 1M-element bound).
        largest = max(b for l in p.layers for b in l.tensors)
        return Options(partition_bytes=max(4_000_000, -(-largest // base.hosts)), fusion_threshold=0,
                       scheduling="fifo", eager_update=False)

    def gain(name: str, gbit: float) -> float:
        c = replace(base, rate_bps=gbit * 1e9)
        p = profs[name]
        return simulate_gradhub(p, c, p3opt, costs).samples_per_s / simulate_gradhub(p, c, mxnet(p), costs).samples_per_s

    note = "compute: PHub Table 3 x 11.3/5.3 (1080 Ti to P4000 peak FP32), batch 32"
    rows = [Row("P3 §5.3", "ResNet-50, 4 machines at 4 Gbit/s: P3 over MXNet's PS", 1.26, gain("resnet50", 4), "x",
                "", note),
            Row("P3 §5.3", "VGG-19, 4 machines at 15 Gbit/s: P3 over MXNet's PS", 1.66, gain("vgg19", 15), "x",
                "MXNet pulls a layer only once every slice of it is updated (P3 §4.2), so its 411 MB "
                "fully-connected layer goes there and back in series; the model's baseline gets each chunk's "
                "result back on its own, so it overlaps better than MXNet did", note),
            Row("P3 §5.3", "Inception-v3, 4 machines, 1-30 Gbit/s: P3 over MXNet's PS, at most", 1.18,
                max(gain("inception_v3", g) for g in (1, 2, 4, 6, 8, 10, 15, 20, 30)), "x", "", note)]
    return rows


def phub(costs: Costs) -> list[Row]:
    """PHub §4.3.2: 8 workers (one GPU each) at 10 Gbit/s; PBox (one
    server machine with as many links as workers: 8 CPU-only servers here)
    over MXNet's sharded PS (a server on every worker)."""
    profs = phub_profiles()
    base = Cluster(8, 1, 0, True, 10e9)
    opt = Options(partition_bytes=32 * 1024)     # PHub's 32 KB key chunks (§3.2)
    g = max(simulate_gradhub(p, replace(base, cpu_servers=8, colocated=False), opt, costs).samples_per_s
            / simulate_gradhub(p, base, opt, costs).samples_per_s for p in profs.values())
    return [Row("PHub §4.3", "8 workers at 10 Gbit/s: PBox over sharded MXNet (up to)", 2.7, g, "x",
                "the model puts gradhub's software on both sides: it predicts the architecture's gain only "
                "(half the bytes per worker link: 2(n-1)/n = 1.75x at most); the rest of PHub's 2.7x is MXNet's "
                "data plane, which PHub §4.3.1-4.3.2 measures separately", "PHub Table 3 models and times")]


def rows(costs: Costs | None = None) -> list[Row]:
    costs = costs or Costs()
    return byteps_74(costs) + byteps_fig13(costs) + p3(costs) + phub(costs)


def markdown(rs: list[Row]) -> str:
    lines = ["| source | figure | paper | predicted | error | assumed | why the prediction differs |",
             "| --- | --- | ---: | ---: | ---: | --- | --- |"]
    for r in rs:
        err = "in range" if isinstance(r.paper, tuple) and r.error == 0 else f"{r.error:+.1%}"
        lines.append(f"| {r.source} | {r.claim} | {_fmt(r.paper, r.unit)} | {_fmt(r.predicted, r.unit)} | {err} "
                     f"| {r.assumed} | {r.why if abs(r.error) > 0.05 else ''} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(rows()))
