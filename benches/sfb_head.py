"""CPU time of one worker's step on a fully-connected head with sufficient
factors, single thread (what docs/benchmarks.md, "Sufficient factors", quotes).

AlexNet's FC head at 1/16 of its bytes (2304 -> 1024 -> 1024 -> 250; 8 rows a
worker, 4 workers' rows rebuilt): forward + backward with and without
autograd's own weight gradient, and the rebuild of the averaged gradient as
a fresh product divided and copied into `.grad`, against one matmul into a
buffer kept across steps. Run: `python benches/sfb_head.py`.
"""

import time

import torch
import torch.nn as nn

DIMS = [(2304, 1024), (1024, 1024), (1024, 250)]
ROWS, WORKERS = 8, 4


def cpu_ms(fn, n=40):
    for _ in range(3):
        fn()
    t0 = time.thread_time()
    for _ in range(n):
        fn()
    return 1e3 * (time.thread_time() - t0) / n


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = [nn.Linear(i, o) for i, o in DIMS]
    x0 = torch.randn(ROWS, DIMS[0][0]) * 0.1
    factors = [torch.randn(ROWS * WORKERS, l.weight.shape[0] + l.weight.shape[1]) for l in layers]
    kept = [torch.empty_like(l.weight) for l in layers]

    def step(weight_grad: bool):
        for l in layers:
            l.weight.requires_grad_(weight_grad)
        h = x0.requires_grad_(True)
        for l in layers:
            h = torch.tanh(l(h))
        h.sum().backward()
        for l in layers:
            l.weight.grad = l.bias.grad = None

    def rebuild_fresh():
        for l, f in zip(layers, factors):
            m = l.weight.shape[0]
            l.weight.grad = torch.empty_like(l.weight)  # what autograd allocated
            g = f[:, :m].t() @ f[:, m:]
            g /= WORKERS
            l.weight.grad.copy_(g)

    def rebuild_in_place():
        for l, f, out in zip(layers, factors, kept):
            m = l.weight.shape[0]
            l.weight.grad = torch.mm((f[:, :m] / WORKERS).t(), f[:, m:], out=out)

    print(f"FC head {DIMS}, {ROWS} rows a worker, {WORKERS} workers; CPU ms per step, single thread")
    print(f"  forward + backward, autograd's weight gradient:  {cpu_ms(lambda: step(True)):6.2f}")
    print(f"  forward + backward, weight gradient left out:    {cpu_ms(lambda: step(False)):6.2f}")
    print(f"  rebuild: fresh product, divided, copied:         {cpu_ms(rebuild_fresh):6.2f}")
    print(f"  rebuild: one matmul into a kept buffer:          {cpu_ms(rebuild_in_place):6.2f}")


if __name__ == "__main__":
    main()
