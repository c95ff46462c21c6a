"""The built-in models: their layers and compute times, for the simulator
(`gradhub simulate --model`) and the lab's emulated training (PHub's
ZeroComputeEngine idea).

Each profile lists the model's parameter tensors in forward order with their
true sizes, and a forward-FLOP count per layer; compute time per layer is the
model's measured (or estimated) time per batch split by FLOP share, with
backward taking twice the forward time of the same layer. Sizes are generated
from the architectures' definitions and checked against their published
parameter counts in the tests.

Time per batch (forward + backward, batch 32): AlexNet 16 ms, VGG-19 268 ms,
Inception-v3 225 ms, ResNet-50 161 ms, from PHub's Table 3. BERT-base and
GPT-2 small are estimates: 6 x params x tokens FLOPs at 25 TFLOP/s effective
(a V100 in mixed precision): BERT-base, 32 x 128 tokens: 110 ms; GPT-2 small,
8 x 1024 tokens: 250 ms.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Layer:
    name: str
    params: list[int]          # parameter tensors (element counts) owned by this layer
    flops: float               # forward FLOPs for one batch
    linear: tuple[int, int] | None = None  # (in, out) features of a fully-connected layer


@dataclass
class Profile:
    name: str
    batch: int
    time_per_batch: float      # seconds, forward + backward
    layers: list[Layer] = field(default_factory=list)
    source: str = ""

    @property
    def num_params(self) -> int:
        return sum(sum(l.params) for l in self.layers)

    def compute_times(self) -> list[tuple[float, float]]:
        """(forward, backward) seconds per layer; backward = 2 x forward."""
        total = sum(l.flops for l in self.layers) or 1.0
        fwd_total = self.time_per_batch / 3.0
        return [(fwd_total * l.flops / total, 2 * fwd_total * l.flops / total) for l in self.layers]


class _CNN:
    """Builds conv/bn/linear layers while tracking the activation shape."""

    def __init__(self, c: int, hw: int, batch: int):
        self.c, self.h, self.w, self.batch = c, hw, hw, batch
        self.layers: list[Layer] = []

    def conv(self, name, cout, k, stride=1, pad=0, bias=True, kw=None, padw=None):
        kh, kw = k, (kw if kw is not None else k)
        ph, pw = pad, (padw if padw is not None else pad)
        h = (self.h + 2 * ph - kh) // stride + 1
        w = (self.w + 2 * pw - kw) // stride + 1
        params = [cout * self.c * kh * kw] + ([cout] if bias else [])
        flops = 2.0 * kh * kw * self.c * cout * h * w * self.batch
        self.layers.append(Layer(name, params, flops))
        self.c, self.h, self.w = cout, h, w
        return self

    def bn(self, name):
        self.layers.append(Layer(name, [self.c, self.c], 4.0 * self.c * self.h * self.w * self.batch))
        return self

    def pool(self, k, stride, pad=0, ceil=False):
        f = (lambda x: -(-(x + 2 * pad - k) // stride) + 1) if ceil else (lambda x: (x + 2 * pad - k) // stride + 1)
        self.h, self.w = f(self.h), f(self.w)
        return self

    def linear(self, name, fin, fout, bias=True):
        self.layers.append(Layer(name, [fout * fin] + ([fout] if bias else []), 2.0 * fin * fout * self.batch,
                                 linear=(fin, fout)))
        return self


def vgg_layers(cfg: list, batch: int) -> list[Layer]:
    """A VGG network's layers from its configuration (channels, "M" = pool)."""
    m = _CNN(3, 224, batch)
    i = 0
    for v in cfg:
        if v == "M":
            m.pool(2, 2)
        else:
            m.conv(f"features.{i}", v, 3, pad=1)
            i += 1
    m.linear("classifier.0", 512 * 7 * 7, 4096).linear("classifier.3", 4096, 4096).linear("classifier.6", 4096, 1000)
    return m.layers


def vgg19(batch=32) -> Profile:
    cfg = [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M"]
    return Profile("vgg19", batch, 0.268, vgg_layers(cfg, batch), "PHub Table 3")


def alexnet(batch=32) -> Profile:
    m = _CNN(3, 224, batch)
    m.conv("features.0", 64, 11, 4, 2).pool(3, 2).conv("features.3", 192, 5, pad=2).pool(3, 2)
    m.conv("features.6", 384, 3, pad=1).conv("features.8", 256, 3, pad=1).conv("features.10", 256, 3, pad=1)
    m.pool(3, 2)
    m.linear("classifier.1", 256 * 6 * 6, 4096).linear("classifier.4", 4096, 4096).linear("classifier.6", 4096, 1000)
    return Profile("alexnet", batch, 0.016, m.layers, "PHub Table 3")


def resnet50(batch=32) -> Profile:
    m = _CNN(3, 224, batch)
    m.conv("conv1", 64, 7, 2, 3, bias=False).bn("bn1").pool(3, 2, 1)
    for li, (width, blocks, stride) in enumerate([(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)], start=1):
        for b in range(blocks):
            p = f"layer{li}.{b}"
            cin, hin, win = m.c, m.h, m.w
            s = stride if b == 0 else 1
            m.conv(f"{p}.conv1", width, 1, bias=False).bn(f"{p}.bn1")
            m.conv(f"{p}.conv2", width, 3, s, 1, bias=False).bn(f"{p}.bn2")
            m.conv(f"{p}.conv3", width * 4, 1, bias=False).bn(f"{p}.bn3")
            if b == 0:
                cout, h, w = m.c, m.h, m.w
                m.c, m.h, m.w = cin, hin, win
                m.conv(f"{p}.downsample.0", cout, 1, s, bias=False).bn(f"{p}.downsample.1")
                m.c, m.h, m.w = cout, h, w
    m.linear("fc", 2048, 1000)
    return Profile("resnet50", batch, 0.161, m.layers, "PHub Table 3")


def inception_v3(batch=32) -> Profile:
    """torchvision's Inception3 with the auxiliary classifier (27,161,264 params)."""
    m = _CNN(3, 299, batch)

    def cbr(name, cout, k, stride=1, pad=0, kw=None, padw=None):
        m.conv(f"{name}.conv", cout, k, stride, pad, bias=False, kw=kw, padw=padw)
        m.layers.append(Layer(f"{name}.bn", [cout, cout], 4.0 * cout * m.h * m.w * batch))

    def branches(spec, name):
        """spec: list of branches, each a list of (cout, k, stride, pad, kw, padw) or 'pool'."""
        c, h, w = m.c, m.h, m.w
        outs, oh, ow = 0, None, None
        for bi, br in enumerate(spec):
            m.c, m.h, m.w = c, h, w
            for li, op in enumerate(br):
                if op == "pool":
                    continue
                if op == "maxpool":
                    m.pool(3, 2)
                    continue
                cout, k, s, p, kw, pw = op
                cbr(f"{name}.b{bi}_{li}", cout, k, s, p, kw, pw)
            outs += m.c
            oh, ow = m.h, m.w
        m.c, m.h, m.w = outs, oh, ow

    def conv(cout, k, s=1, p=0, kw=None, pw=None):
        return (cout, k, s, p, kw, pw)

    cbr("Conv2d_1a_3x3", 32, 3, 2)
    cbr("Conv2d_2a_3x3", 32, 3)
    cbr("Conv2d_2b_3x3", 64, 3, pad=1)
    m.pool(3, 2)
    cbr("Conv2d_3b_1x1", 80, 1)
    cbr("Conv2d_4a_3x3", 192, 3)
    m.pool(3, 2)
    for name, pool_features in (("Mixed_5b", 32), ("Mixed_5c", 64), ("Mixed_5d", 64)):
        branches([[conv(64, 1)], [conv(48, 1), conv(64, 5, p=2)], [conv(64, 1), conv(96, 3, p=1), conv(96, 3, p=1)],
                  ["pool", conv(pool_features, 1)]], name)
    branches([[conv(384, 3, 2)], [conv(64, 1), conv(96, 3, p=1), conv(96, 3, 2)], ["maxpool"]], "Mixed_6a")
    for name, c7 in (("Mixed_6b", 128), ("Mixed_6c", 160), ("Mixed_6d", 160), ("Mixed_6e", 192)):
        branches([[conv(192, 1)],
                  [conv(c7, 1), conv(c7, 1, p=0, kw=7, pw=3), conv(192, 7, p=3, kw=1, pw=0)],
                  [conv(c7, 1), conv(c7, 7, p=3, kw=1, pw=0), conv(c7, 1, kw=7, pw=3), conv(c7, 7, p=3, kw=1, pw=0),
                   conv(192, 1, kw=7, pw=3)],
                  ["pool", conv(192, 1)]], name)
    # Auxiliary classifier (on the 17x17x768 map).
    c, h, w = m.c, m.h, m.w
    m.pool(5, 3)
    cbr("AuxLogits.conv0", 128, 1)
    cbr("AuxLogits.conv1", 768, 5)
    m.linear("AuxLogits.fc", 768, 1000)
    m.c, m.h, m.w = c, h, w
    branches([[conv(192, 1), conv(320, 3, 2)],
              [conv(192, 1), conv(192, 1, kw=7, pw=3), conv(192, 7, p=3, kw=1, pw=0), conv(192, 3, 2)],
              ["maxpool"]], "Mixed_7a")
    for name in ("Mixed_7b", "Mixed_7c"):
        c, h, w = m.c, m.h, m.w
        parts = 0
        m.c = c
        cbr(f"{name}.branch1x1", 320, 1)
        parts += 320
        m.c = c
        cbr(f"{name}.branch3x3_1", 384, 1)
        cbr(f"{name}.branch3x3_2a", 384, 1, kw=3, padw=1)
        m.c = 384
        cbr(f"{name}.branch3x3_2b", 384, 3, pad=1, kw=1, padw=0)
        parts += 768
        m.c = c
        cbr(f"{name}.branch3x3dbl_1", 448, 1)
        cbr(f"{name}.branch3x3dbl_2", 384, 3, pad=1)
        cbr(f"{name}.branch3x3dbl_3a", 384, 1, kw=3, padw=1)
        m.c = 384
        cbr(f"{name}.branch3x3dbl_3b", 384, 3, pad=1, kw=1, padw=0)
        parts += 768
        m.c = c
        cbr(f"{name}.branch_pool", 192, 1)
        parts += 192
        m.c, m.h, m.w = parts, h, w
    m.linear("fc", 2048, 1000)
    return Profile("inception_v3", batch, 0.225, m.layers, "PHub Table 3")


def transformer(name, vocab, positions, layers, d, ffn, tokens, time_per_batch, source, bert: bool) -> Profile:
    out = []
    emb = [vocab * d, positions * d] + ([2 * d, d, d] if bert else [])  # (+ token types, LayerNorm for BERT)
    out.append(Layer("embeddings", emb, 2.0 * d * tokens))
    seq = 128 if bert else 1024
    for i in range(layers):
        # Each projection is a fully-connected layer over every token (typed,
        # so the FC-faithful mode builds real nn.Linear layers with
        # batch x sequence rows: K is large, and BestScheme keeps the servers).
        def fc(part, fin, fout):
            out.append(Layer(f"layer{i}.{part}", [fin * fout, fout], 2.0 * tokens * fin * fout, linear=(fin, fout)))

        fc("attention.qkv", d, 3 * d)
        # The attention itself (scores and weighted sum): FLOPs, no parameters.
        out.append(Layer(f"layer{i}.attention.scores", [], 4.0 * tokens * seq * d))
        fc("attention.output", d, d)
        out.append(Layer(f"layer{i}.attention.norm", [d, d], 4.0 * d * tokens))
        fc("mlp.fc1", d, ffn)
        fc("mlp.fc2", ffn, d)
        out.append(Layer(f"layer{i}.mlp.norm", [d, d], 4.0 * d * tokens))
    if bert:
        out.append(Layer("pooler", [d * d, d], 2.0 * d * d * tokens / 128))
    else:
        out.append(Layer("ln_f", [d, d], 4.0 * d * tokens))
    return Profile(name, tokens, time_per_batch, out, source)


def bert_base() -> Profile:
    """BertModel (bert-base-uncased, with pooler): 109,482,240 parameters."""
    return transformer("bert_base", 30522, 512, 12, 768, 3072, 32 * 128, 0.110, "estimate (see module doc)", True)


def gpt2_small() -> Profile:
    """GPT2Model (small; output head tied to the embedding): 124,439,808 parameters."""
    return transformer("gpt2_small", 50257, 1024, 12, 768, 3072, 8 * 1024, 0.250, "estimate (see module doc)", False)


PROFILES = {
    "vgg19": vgg19,
    "resnet50": resnet50,
    "alexnet": alexnet,
    "inception_v3": inception_v3,
    "bert_base": bert_base,
    "gpt2_small": gpt2_small,
}


def get(name: str) -> Profile:
    try:
        return PROFILES[name]()
    except KeyError:
        raise ValueError(f"unknown model profile {name!r}; choose from {', '.join(PROFILES)}") from None
