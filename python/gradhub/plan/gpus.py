"""`--gpu`: the built-in models' compute times on a GPU the user names.

The built-in profiles' times are PHub's Table 3 (a GTX 1080 Ti, fp32,
batch 32) for the CNNs, and 6 x parameters x tokens at 25 TFLOP/s (a V100
in mixed precision) for the transformers (models.py). A catalogue entry is
one published per-GPU training throughput: ResNet-50 v1.5 images/s on one
GPU, the one model whose per-GPU training throughput is published for
every GPU here. Every layer of every built-in model is scaled by the same
factor: the entry's ResNet-50 throughput over the built-in profile's base
(for CNNs, ResNet-50's own 32 / 0.161 s; for transformers, a V100 in mixed
precision, the estimate's base). That carries ResNet-50's speed-up from one
GPU to another over to every model: an approximation (transformers gain
more from tensor cores than convolutions do); `--profile` and
`--torch-model` remain the exact ways (docs/planning.md, "Inputs", cites
each figure).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .profile import TRANSFORMERS, SimProfile, load


@dataclass(frozen=True)
class Gpu:
    name: str
    precision: str              # "amp" (mixed precision) or "fp32" (TF32 on A100 and H100)
    resnet50_img_s: float       # ResNet-50 v1.5 training, images/s on one GPU
    source: str


DLE = "NVIDIA DeepLearningExamples, PyTorch ResNet-50 v1.5 README, training performance, 1 GPU"
MLPERF = "MLPerf Training v3.0, closed, ResNet-50 on 8 x H100 SXM5 in 13.466 min (MLPerf ID 3.0-2053)"
# MLPerf's ResNet-50 runs (LARS, about 3k images a step) reach the target in
# about 37 epochs of ImageNet's 1,281,167 images: 8 GPUs x 13.466 min ->
# 7,334 images/s per GPU. A more tuned stack (MXNet, DALI) than the
# PyTorch figures of the other entries: the H100's are an upper end.
H100_AMP_IMG_S = 1_281_167 * 37 / (13.466 * 60) / 8
GPUS = {
    ("v100", "fp32"): Gpu("v100", "fp32", 367.0, f"{DLE}, DGX-1 (V100 16GB), FP32"),
    ("v100", "amp"): Gpu("v100", "amp", 1200.0, f"{DLE}, DGX-1 (V100 16GB), mixed precision"),
    ("a100", "fp32"): Gpu("a100", "fp32", 938.0, f"{DLE}, DGX A100 (A100 80GB), TF32"),
    ("a100", "amp"): Gpu("a100", "amp", 2470.0, f"{DLE}, DGX A100 (A100 80GB), mixed precision"),
    ("h100", "amp"): Gpu("h100", "amp", H100_AMP_IMG_S, f"{MLPERF}, mixed precision, 37 epochs assumed"),
    # No published single-GPU TF32 figure: mixed precision x the A100's TF32 / mixed ratio (938 / 2470).
    ("h100", "fp32"): Gpu("h100", "fp32", H100_AMP_IMG_S * 938.0 / 2470.0,
                          f"{MLPERF} x A100's TF32 / mixed-precision ratio ({DLE})"),
}
# The built-in profiles' bases, in ResNet-50 images/s: PHub's 1080 Ti (batch
# 32 in 161 ms) for CNNs; the transformers' estimate is a V100 in mixed precision.
CNN_BASE_IMG_S = 32 / 0.161
TRANSFORMER_BASE_IMG_S = GPUS[("v100", "amp")].resnet50_img_s


def gpu(name: str, precision: str = "amp") -> Gpu:
    key = (name.strip().lower(), precision)
    if key not in GPUS:
        names = sorted({n for n, _ in GPUS})
        raise ValueError(f"--gpu {name!r}: one of {', '.join(names)} (with --precision amp or fp32)")
    return GPUS[key]


def speedup(model: str, g: Gpu) -> float:
    """How many times faster the GPU runs the built-in model than its profile says."""
    base = TRANSFORMER_BASE_IMG_S if model in TRANSFORMERS else CNN_BASE_IMG_S
    return g.resnet50_img_s / base


def on_gpu(p: SimProfile, model: str, g: Gpu) -> SimProfile:
    """The built-in profile with every layer's compute divided by `speedup`."""
    f = speedup(model, g)
    layers = [replace(l, forward_s=l.forward_s / f, backward_s=l.backward_s / f) for l in p.layers]
    return SimProfile(p.name, p.batch, layers, f"{p.source}; compute on {g.name} ({g.precision}): {g.source}",
                      p.unit)


def load_on(model: str | None, scale: float, profile: str | None, torch_model: str | None,
            gpu_name: str | None = None, precision: str = "amp") -> SimProfile:
    """The profile the command line names (`profile.load`); with `gpu_name`,
    a built-in model's compute on that GPU of the catalogue."""
    if gpu_name and (profile or torch_model):
        raise ValueError("--gpu scales the built-in models; a --profile's or --torch-model's times are its own")
    p = load(model, scale, profile, torch_model)
    return on_gpu(p, model or "vgg19", gpu(gpu_name, precision)) if gpu_name else p
