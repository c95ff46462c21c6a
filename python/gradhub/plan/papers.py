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


# How a row is scored: as the user decides by it (docs/planning.md, "The
# papers' results, reproduced"). A gain (speed-up - 1) decides which system
# to buy: within GAIN_BAND of none, no clear winner. A row passes when the
# prediction names the same winner and its gain is within GAIN_BAND of the
# paper's (in points of gain); an efficiency row when its lost throughput
# (1 - efficiency) is within LOSS_BAND of the paper's (in points); a range
# when the prediction is inside it.
GAIN_BAND = 0.10
LOSS_BAND = 0.05


@dataclass
class Row:
    source: str
    claim: str
    paper: float | tuple[float, float]        # a figure, or a range (low, high)
    predicted: float
    unit: str = "x"                           # "x" (a speed-up: gain = x - 1), "%" (efficiency: lost = 1 - x)
    why: str = ""                             # why the prediction differs, where it does
    assumed: str = ""
    # Not scored: the paper's figure for this setup exists only in a plot
    # the text copy lost (or a model it does not describe); the reason.
    unscored: str = ""

    def lost_or_gain(self, v: float) -> float:
        """What a user decides by: lost throughput (1 - efficiency) or gain (speed-up - 1)."""
        return 1 - v if self.unit == "%" else v - 1

    @property
    def error(self) -> float:
        """The prediction's lost throughput or gain minus the paper's, in
        points (0.10: ten points); for a range, the distance outside it (0
        inside; negative below, positive above in the row's own units)."""
        if isinstance(self.paper, tuple):
            lo, hi = self.paper
            if lo <= self.predicted <= hi:
                return 0.0
            edge = lo if self.predicted < lo else hi
            return self.lost_or_gain(self.predicted) - self.lost_or_gain(edge)
        return self.lost_or_gain(self.predicted) - self.lost_or_gain(self.paper)

    @property
    def times_off(self) -> float | None:
        """The predicted lost throughput or gain over the paper's (None for
        ranges, or where the paper's is 0)."""
        if isinstance(self.paper, tuple) or self.lost_or_gain(self.paper) == 0:
            return None
        return self.lost_or_gain(self.predicted) / self.lost_or_gain(self.paper)

    @staticmethod
    def winner(speedup: float) -> str:
        return "new" if speedup > 1 + GAIN_BAND else "baseline" if speedup < 1 - GAIN_BAND else "no clear winner"

    @property
    def within(self) -> bool:
        """The same decision: inside a range; an efficiency's lost throughput
        within LOSS_BAND; a speed-up naming the same winner, its gain within GAIN_BAND."""
        if isinstance(self.paper, tuple):
            return self.error == 0.0
        if self.unit == "%":
            return abs(self.error) <= LOSS_BAND
        return self.winner(self.predicted) == self.winner(self.paper) and abs(self.error) <= GAIN_BAND

    @property
    def scored(self) -> bool:
        return not self.unscored


def _fmt(v, unit: str) -> str:
    if isinstance(v, tuple):
        if v[1] == math.inf:
            return f"above {_fmt(v[0], unit)}"
        return " to ".join(_fmt(x, unit) for x in v)
    if v != v:   # nan: not predicted
        return "-"
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
    why_ar = ("Horovod's cycle and negotiation are modelled, stragglers and incast cost both systems alike "
              "(docs/planning.md, the effects table); what is missing is an all-reduce-only cost of about 9 points: "
              "NCCL's kernels slowing the backward they overlap, for which no figure is published")
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
                        "near compute-bound at 100 Gbit/s in the model: the all-reduce-only cost of the ResNet-50 "
                        "row is missing here too", note))
        rows.append(Row("BytePS §7.4", f"{p.name}, 256 GPUs: BytePS over all-reduce, without CPU machines (range)",
                        (1.09, 1.53), wo.samples_per_s / d.samples_per_s, "x",
                        "near compute-bound at 100 Gbit/s in the model: the all-reduce-only cost of the ResNet-50 "
                        "row is missing here too", note))
        rows.append(Row("BytePS §7.4", f"{p.name}, 256 GPUs: BytePS scaling efficiency (at least, five models)",
                        (0.916, 1.0), efficiency(w.samples_per_s, p, base), "%", "", note))
    return rows


def resnet50_256_effects(costs: Costs) -> list[tuple[str, float, float, float]]:
    """BytePS §7.4's ResNet-50 on 256 GPUs, each effect of effects.py
    switched on in turn: (what, all-reduce's efficiency, BytePS's, BytePS's
    gain). Stragglers at the per-step jitter that accounts for BytePS's own
    measured 97.5 % (no jitter is published: this is what it would take)."""
    from .effects import expected_max_normal

    p = v100_profiles()["resnet50"]
    base = Cluster(32, 8, 0, True, 100e9, gpu_link="nvlink", transport="rdma", link_efficiency=BYTEPS_GOODPUT)
    out = []

    def row(what, c, **kw):
        d = simulate_ddp(p, c, costs, fusion="horovod", **kw).samples_per_s
        w = simulate_gradhub(p, replace(c, cpu_servers=32), Options(), costs).samples_per_s
        out.append((what, efficiency(d, p, c), efficiency(w, p, c), w / d))
        return out[-1]

    row("the model without Horovod's negotiation, a 0.1 ms cycle", base, cycle_s=1e-4, negotiation=False)
    row("+ Horovod's 5 ms cycle", base, negotiation=False)
    _, _, bps, _ = row("+ Horovod's negotiation (2 log2(256) latencies a cycle)", base)
    jitter = max(0.0, (1 / 0.975 - 1 / bps) / expected_max_normal(base.workers))
    row(f"+ stragglers at {jitter:.2%} per-step jitter (what BytePS's own 97.5 % implies)",
        replace(base, jitter=jitter))
    row("+ incast at the servers (RDMA with PFC: lossless, incast = 1)", replace(base, jitter=jitter, incast=1.0))
    return out


def effects_markdown(rs: list[tuple[str, float, float, float]]) -> str:
    lines = ["| effects in the model | all-reduce efficiency | BytePS efficiency | BytePS over all-reduce |",
             "| --- | ---: | ---: | ---: |"]
    lines += [f"| {w} | {a:.1%} | {b:.1%} | {g:.3f}x |" for w, a, b, g in rs]
    lines.append("| the paper (BytePS §7.4) | 88.0% | 97.5% | 1.108x |")
    return "\n".join(lines)


def gpt2_80_tokens() -> SimProfile:
    """GPT-2 at Fig. 13's 80 tokens per GPU: the paper does not say which
    GPT-2; the smallest (124M parameters, models.gpt2_small) is taken, its
    compute 6 x parameters x tokens at 25 TFLOP/s (the built-in estimate)."""
    small = bp.gpt2_small()
    tokens = 80
    p = bp.transformer("gpt2", 50257, 1024, 12, 768, 3072, tokens, 6 * small.num_params * tokens / TRANSFORMER_FLOP_S,
                       "", False)
    return _sim_profile(p, p.time_per_batch, "GPT-2 small (PyTorch, 80 tokens/GPU)")


FIG13_UNSCORED = ("the figure is a lost plot; the text's \"up to\" is over UGATIT and GPT-2, whose sizes the paper "
                  "does not state (UGATIT is not reconstructible; GPT-2's size is assumed)")


def byteps_fig13(costs: Costs) -> list[Row]:
    """BytePS Fig. 13: 8 machines x 8 V100 (NVLink or PCIe only), 0 to 8
    CPU machines, PyTorch, Horovod + NCCL, UGATIT at 2 images and GPT-2 at
    80 tokens per GPU. UGATIT is not reconstructible from the paper; GPT-2
    is predicted at its smallest size (an assumption), and the rows are not
    scored: the text gives maxima over both models, the plot is lost."""
    p = gpt2_80_tokens()
    rows = []
    gains = {}
    for link in ("nvlink", "pcie"):
        base = Cluster(8, 8, 0, True, 100e9, gpu_link=link, transport="rdma", link_efficiency=BYTEPS_GOODPUT)
        ddp = simulate_ddp(p, base, costs, fusion="horovod")
        by_k = [simulate_gradhub(p, replace(base, cpu_servers=k), Options(), costs).samples_per_s
                for k in range(0, 9)]
        gains[link] = (max(by_k) / by_k[0], max(by_k) / ddp.samples_per_s)
    note = "GPT-2 small at 80 tokens/GPU (the paper's model; its size assumed), NVLink and PCIe"
    rows.append(Row("BytePS Fig. 13", "8 x 8 V100: gain of 8 CPU machines over none (up to, over both models)",
                    (1.0, 1.20), max(g[0] for g in gains.values()), "x", "", note, FIG13_UNSCORED))
    rows.append(Row("BytePS Fig. 13", "8 x 8 V100: BytePS over all-reduce, faster in every case, up to",
                    (1.0, 1.45), max(g[1] for g in gains.values()), "x", "", "the same", FIG13_UNSCORED))
    rows.append(Row("BytePS Fig. 13", "NVLink machines gain more over all-reduce than PCIe-only ones (NVLink's best "
                    "gain / PCIe's)", (1.0, math.inf), gains["nvlink"][1] / gains["pcie"][1], "x",
                    "", "the same", FIG13_UNSCORED))
    rows.append(Row("BytePS Fig. 13", "UGATIT (2 images/GPU): gains as above", (1.0, 1.45), float("nan"), "x", "",
                    "", "not reconstructible: the paper does not state its size; its public full configuration "
                        "has about a billion parameters"))
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


def _decides(r: Row) -> str:
    """The quantity a user decides by, the paper's and the prediction's, and the error."""
    what = "lost" if r.unit == "%" else "gain"
    if r.predicted != r.predicted:
        return "not predicted"
    if isinstance(r.paper, tuple):
        lo, hi = (r.lost_or_gain(x) for x in r.paper)
        lo, hi = min(lo, hi), max(lo, hi)
        rng = f"above {lo:+.1%}" if hi == math.inf else f"{lo:+.1%} to {hi:+.1%}"
        where = "inside" if r.error == 0 else f"outside by {r.error:+.1%}"
        return f"{what} {rng} / {r.lost_or_gain(r.predicted):+.1%}: {where}"
    off = r.times_off
    return (f"{what} {r.lost_or_gain(r.paper):+.1%} / {r.lost_or_gain(r.predicted):+.1%}: {r.error:+.1%}"
            + (f" ({off:.2g}x)" if off is not None and abs(r.error) > 0.005 else ""))


def markdown(rs: list[Row]) -> str:
    lines = ["| source | figure | paper | predicted | lost throughput or gain: paper / predicted: error (points) "
             "| same decision | assumed | why the prediction differs |",
             "| --- | --- | ---: | ---: | --- | --- | --- | --- |"]
    for r in rs:
        verdict = ("yes" if r.within else "**no**") if r.scored else f"not scored: {r.unscored}"
        lines.append(f"| {r.source} | {r.claim} | {_fmt(r.paper, r.unit)} | {_fmt(r.predicted, r.unit)} "
                     f"| {_decides(r)} | {verdict} | {r.assumed} | {'' if r.within else r.why} |")
    scored = [r for r in rs if r.scored]
    lines.append("")
    lines.append(f"{sum(r.within for r in scored)} of the {len(scored)} scored rows lead to the paper's decision "
                 f"(the same winner and a gain within {GAIN_BAND * 100:.0f} points, lost throughput within "
                 f"{LOSS_BAND * 100:.0f} points, or inside the range); {len(rs) - len(scored)} not scored.")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(rows()))
    print()
    print(effects_markdown(resnet50_256_effects(Costs())))
