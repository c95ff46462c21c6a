"""Model profiles for the simulator: per layer (forward order) the gradient
tensors' bytes and the forward and backward compute times.

Three sources: the built-in models (models.py, byte counts divided by
`scale` exactly as the lab's emulated model divides them), a JSON file, or
a PyTorch model timed on this machine (`module:factory`)."""

from __future__ import annotations

import importlib
import json
import math
import time
from dataclasses import dataclass, field

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


@dataclass
class SimLayer:
    name: str
    tensors: list[int]          # bytes of each gradient tensor
    forward_s: float
    backward_s: float
    # The part of forward_s / backward_s that is this machine's CPU (the
    # emulated model's Python and gradient fill; 0 for real models), which
    # the shared-cores pool can delay (sim.py).
    forward_cpu_s: float = 0.0
    backward_cpu_s: float = 0.0


@dataclass
class SimProfile:
    name: str
    batch: int                  # samples per worker and step
    layers: list[SimLayer] = field(default_factory=list)
    source: str = ""
    unit: str = "samples"       # what a sample is: "images" (CNNs), "tokens" (the built-in transformers)

    @property
    def model_bytes(self) -> int:
        return sum(sum(l.tensors) for l in self.layers)

    @property
    def forward_s(self) -> float:
        return sum(l.forward_s for l in self.layers)

    @property
    def compute_s(self) -> float:
        return sum(l.forward_s + l.backward_s for l in self.layers)

    def to_json(self) -> dict:
        return {"batch": self.batch, "layers": [
            {"name": l.name, "params": sum(l.tensors) // 4, "dtype": "float32", "forward_ms": l.forward_s * 1e3,
             "backward_ms": l.backward_s * 1e3} for l in self.layers]}


def _vgg16():
    """VGG-16 (138,357,544 parameters); time per batch of 32 from VGG-19's
    (PHub Table 3) by FLOP ratio (15.5 / 19.6 GFLOPs)."""
    from .models import Profile, vgg_layers

    cfg = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]
    return Profile("vgg16", 32, 0.268 * 15.5 / 19.6, vgg_layers(cfg, 32), "PHub Table 3 (VGG-19) by FLOP ratio")


def _bert_large():
    """BERT-large (24 layers, 1024 wide, with pooler: 335,141,888 parameters),
    32 x 128 tokens; time by the estimate BERT-base uses (6 x params x tokens
    FLOPs at 25 TFLOP/s): 330 ms."""
    from .models import transformer

    return transformer("bert_large", 30522, 512, 24, 1024, 4096, 32 * 128, 0.330, "estimate (6 N T at 25 TFLOP/s)",
                        True)


# Profiles only the planner has (the scaling plots), beside models.py's.
EXTRA = {"vgg16": _vgg16, "bert_large": _bert_large}


# The built-in transformers: their samples are tokens.
TRANSFORMERS = ("bert_base", "bert_large", "gpt2_small")


def builtin(name: str, scale: float = 1.0) -> SimProfile:
    """A built-in model (models.py, or one of EXTRA): tensors of
    ceil(n / scale) float32 elements (at least one), as the lab's emulated
    model builds them."""
    from . import models

    if not (isinstance(scale, (int, float)) and 0 < scale < math.inf):
        raise ValueError(f"scale {scale!r}: expected a number more than 0")
    p = EXTRA[name]() if name in EXTRA else models.get(name)
    layers = [SimLayer(l.name, [4 * max(1, math.ceil(n / scale)) for n in l.params], f, b)
              for l, (f, b) in zip(p.layers, p.compute_times())]
    return SimProfile(p.name, p.batch, layers, f"{p.source}, bytes / {scale:g}",
                      "tokens" if name in TRANSFORMERS else "images")


def from_json(path: str) -> SimProfile:
    """`{"batch": B, "layers": [{"name", "params", "dtype", "forward_ms", "backward_ms"}, ...]}`,
    forward order; `params` is the element count of the layer's gradients
    (`name` and `dtype`, float32 if not given, may be left out).

    A malformed file raises ValueError naming it and the problem (`p.json:
    layer 3 lacks 'params'`); layers are counted from 0."""
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except OSError as e:
        raise ValueError(f"{path}: cannot read it: {e.strerror or e}") from None
    except ValueError as e:   # json.JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    shape = '{"batch": B, "layers": [{"name", "params", "dtype", "forward_ms", "backward_ms"}, ...]}'
    if not isinstance(d, dict):
        raise ValueError(f"{path}: not a profile (expected a JSON object {shape})")
    for key in ("batch", "layers"):
        if key not in d:
            raise ValueError(f"{path}: not a profile: lacks {key!r} (expected {shape})")
    batch = _number(path, "batch", d["batch"], whole=True, least=1)
    if not isinstance(d["layers"], list) or not d["layers"]:
        raise ValueError(f"{path}: 'layers' is {d['layers']!r}, expected a non-empty list of layers")
    layers = []
    for i, l in enumerate(d["layers"]):
        if not isinstance(l, dict):
            raise ValueError(f"{path}: layer {i} is {l!r}, expected an object {{\"name\", \"params\", \"dtype\", "
                             f"\"forward_ms\", \"backward_ms\"}}")
        for key in ("params", "forward_ms", "backward_ms"):
            if key not in l:
                raise ValueError(f"{path}: layer {i} lacks {key!r}")
        dtype = l.get("dtype", "float32")
        if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
            raise ValueError(f"{path}: layer {i}: unknown dtype {dtype!r} (one of {', '.join(DTYPE_BYTES)})")
        n = _number(path, f"layer {i}: params", l["params"], whole=True)
        fwd = _number(path, f"layer {i}: forward_ms", l["forward_ms"])
        bwd = _number(path, f"layer {i}: backward_ms", l["backward_ms"])
        layers.append(SimLayer(str(l.get("name", f"layer{i}")), [n * DTYPE_BYTES[dtype]] if n else [],
                               fwd / 1e3, bwd / 1e3))
    prof = SimProfile(str(d.get("name", path)), batch, layers, path)
    if prof.model_bytes == 0 and prof.compute_s == 0:
        raise ValueError(f"{path}: nothing to simulate: every layer's params, forward_ms and backward_ms are 0")
    return prof


def _number(path: str, what: str, v, whole: bool = False, least: int = 0):
    """A profile's number `v` (JSON: not a bool, finite, at least `least`;
    `whole`: an integer, returned as int), else ValueError naming it."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= least
    if ok and whole and not float(v).is_integer():
        ok = False
    if not ok:
        kind = "an integer" if whole else "a number"
        raise ValueError(f"{path}: {what} is {v!r}, expected {kind} at least {least}")
    return int(v) if whole else float(v)


def from_torch(spec: str, steps: int = 5, warmup: int = 2) -> SimProfile:
    """Time a PyTorch model on this machine. `module:factory`: factory()
    returns (model, example_batch). Each leaf module with parameters is a
    layer, timed by hooks; the step's measured forward and backward times are
    split over the layers in proportion to those (after `warmup` untimed
    steps, the median of `steps`)."""
    mod, _, fn = spec.partition(":")
    if not mod or not fn:
        raise ValueError(f"--torch-model {spec!r}: expected module:factory")
    try:
        factory = getattr(importlib.import_module(mod), fn)
    except ImportError as e:
        raise ValueError(f"--torch-model {spec}: cannot import {mod}: {e}") from None
    except AttributeError:
        raise ValueError(f"--torch-model {spec}: module {mod} has no {fn}") from None
    if not callable(factory):
        raise ValueError(f"--torch-model {spec}: {fn} is not a function")
    import torch

    made = factory()
    if not (isinstance(made, tuple) and len(made) == 2):
        raise ValueError(f"--torch-model {spec}: the factory must return (model, example_batch)")
    model, x = made
    leaves = [(n, m) for n, m in model.named_modules()
              if not list(m.children()) and any(p.requires_grad for p in m.parameters(recurse=False))]
    fwd = {n: 0.0 for n, _ in leaves}
    starts: dict[str, float] = {}
    hooks = []
    # On a GPU, kernels run asynchronously: each timestamp waits for them.
    sync = torch.cuda.synchronize if getattr(x, "is_cuda", False) else (lambda: None)

    def now() -> float:
        sync()
        return time.perf_counter()

    for n, m in leaves:
        hooks.append(m.register_forward_pre_hook(lambda _m, _i, n=n: starts.__setitem__(n, now())))
        hooks.append(m.register_forward_hook(
            lambda _m, _i, _o, n=n: fwd.__setitem__(n, fwd[n] + now() - starts[n])))
    order: list[str] = []
    for n, m in leaves:
        hooks.append(m.register_forward_hook(lambda *_a, n=n: order.append(n) if n not in order else None))
    timed = []   # per step: (forward, backward, each layer's forward)
    # Untimed first: at least `warmup` steps and one second (right after
    # torch's import its thread pools and allocator are still warming up:
    # steps there ran 100x slower).
    warmup = max(1, warmup)
    start = time.perf_counter()
    while len(timed) < warmup + steps:
        if len(timed) == warmup and time.perf_counter() - start < 1.0:
            timed.pop()
        for n in fwd:
            fwd[n] = 0.0
        t0 = now()
        out = model(x)
        loss = out.float().sum() if torch.is_tensor(out) else sum(o.float().sum() for o in out)
        t1 = now()
        loss.backward()
        t2 = now()
        timed.append((t1 - t0, t2 - t1, dict(fwd)))
        model.zero_grad(set_to_none=True)
    for h in hooks:
        h.remove()
    # The median step: one preempted by another process does not count.
    forward, back, fwd = sorted(timed[warmup:], key=lambda t: t[0] + t[1])[steps // 2]
    total_f = sum(fwd.values()) or 1.0
    mods = dict(leaves)
    layers = []
    for n in order:
        # Modules without parameters (activations, pooling) and the loss
        # are spread over the layers in proportion, so the step adds up.
        share = fwd[n] / total_f
        params = [p for p in mods[n].parameters(recurse=False) if p.requires_grad]
        layers.append(SimLayer(n, [p.numel() * p.element_size() for p in params], forward * share, back * share))
    batch = int(x.shape[0]) if hasattr(x, "shape") else 1
    return SimProfile(spec, batch, layers, f"timed on this machine (median of {steps} steps)")


def load(model: str | None, scale: float, profile: str | None, torch_model: str | None) -> SimProfile:
    """The profile the command line names (exactly one source)."""
    given = [x for x in (profile, torch_model) if x]
    if len(given) > 1:
        raise ValueError("give one of --model, --profile, --torch-model")
    if profile:
        return from_json(profile)
    if torch_model:
        return from_torch(torch_model)
    return builtin(model or "vgg19", scale)
