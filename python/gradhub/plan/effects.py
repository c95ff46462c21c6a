"""What costs large synchronous jobs their last percent, each with a switch
(docs/planning.md, "What large jobs lose"):

- stragglers: every synchronous step waits for the slowest of its N GPUs.
  With a per-step compute time of mean T and coefficient of variation s
  (`Cluster.jitter`, what the user gives or measures: the standard
  deviation of one GPU's step time over its mean), independent across GPUs
  and normal, the slowest takes T (1 + s e_N) in expectation, where e_N is
  the expected maximum of N standard normal variables (order statistics:
  e_1 = 0, e_2 = 1/sqrt(pi), e_3 = 3/(2 sqrt(pi)), about 2.8 at 256). The
  step is longer by s e_N T whichever system synchronizes it (gradhub's
  synchronous push_pull and DDP's all-reduce alike wait for the last
  gradient): `with_stragglers`.
- incast at a server: the pushes of every worker converge on each
  server's downlink at once; `Cluster.incast` is the share of its line
  rate that link keeps then (1: lossless, as RDMA with PFC is; TCP through
  shallow switch buffers loses more: Vasudevan et al., SIGCOMM 2009),
  applied to every server's receiving link (sim.py).
- Horovod's cycle (the papers' all-reduce baseline, ddp.py): every 5 ms its
  background thread fuses what is ready, after a negotiation among the
  ranks: with its response cache (Horovod 0.17+), a bit-vector all-reduce
  over all N ranks, 2 ceil(log2 N) one-way latencies (a tree up and down):
  `negotiation_s`.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import lru_cache


@lru_cache(maxsize=None)
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normal variables], by integrating
    x n phi(x) Phi(x)^(n-1) (Simpson's rule over [-9, 9], 3600 steps)."""
    if n <= 1:
        return 0.0
    lo, hi, steps = -9.0, 9.0, 3600
    h = (hi - lo) / steps
    total = 0.0
    for i in range(steps + 1):
        x = lo + i * h
        phi = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        cdf = 0.5 * math.erfc(-x / math.sqrt(2))
        f = x * n * phi * cdf ** (n - 1)
        total += f * (1 if i in (0, steps) else 4 if i % 2 else 2)
    return total * h / 3


def straggler_s(compute_s: float, jitter: float, n: int) -> float:
    """Seconds a synchronous step of n GPUs waits for its slowest beyond the mean compute."""
    return jitter * compute_s * expected_max_normal(n) if jitter > 0 else 0.0


def with_stragglers(r, compute_s: float, jitter: float, n: int):
    """A Result (sim.py) with each step longer by `straggler_s`."""
    extra = straggler_s(compute_s, jitter, n)
    if extra <= 0:
        return r
    iter_s = r.iter_s + extra
    util = {k: v * r.iter_s / iter_s for k, v in r.utilization.items()}
    return replace(r, samples_per_s=r.samples_per_s * r.iter_s / iter_s, iter_s=iter_s, utilization=util,
                   detail=(r.detail + "; " if r.detail else "") + f"stragglers +{extra * 1e3:.2f} ms")


def negotiation_s(ranks: int, latency_s: float) -> float:
    """Horovod's per-cycle coordination: a bit-vector all-reduce over the ranks (a tree up and down)."""
    return 2 * math.ceil(math.log2(ranks)) * latency_s if ranks > 1 else 0.0
