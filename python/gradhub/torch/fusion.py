"""Tensor fusion for `DistributedOptimizer` (what Horovod's fusion buffer and
DDP's buckets do): the gradients of small parameters travel packed in
buckets, one push_pull per bucket and step instead of one per parameter, so
a model with hundreds of small tensors (biases, norms) pays the per-operation
cost (Python, the core's bookkeeping, a round trip per chunk) a few times per
step rather than hundreds.

- **Buckets** are fixed at construction, the same on every worker: the
  parameters whose gradient is at most `threshold / 4` bytes, in reverse
  registration order (roughly the order backward produces them), grouped by
  dtype into buckets of at most `threshold` bytes. Each bucket is declared
  as one tensor (`allreduce.fusion.<first member's name>`).
- **A step**: a member's gradient is copied into its slice of the bucket when
  it is ready; the bucket is pushed when its last member's is, at the highest
  priority of its members (forward order, as for any tensor). Waiting for a
  member waits for its bucket and copies the member's slice back into
  `.grad`. A parameter with no gradient this step is filled with zeros by
  `synchronize()` as always, which completes its bucket.
- Not fused: parameters above the size, gradients compressed (the wire
  dtype is the compressor's), the optimizer on the servers (whose state is
  kept per parameter on the servers), and, with sufficient factors on,
  matrices (an `nn.Linear` weight may be exchanged as factors, decided at
  its first steps).
"""

from __future__ import annotations

import torch

# Summed by the servers in place and copied back slice by slice.
_FUSIBLE = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class _Bucket:
    def __init__(self, name: str, params: list, dtype: torch.dtype):
        self.name = name
        self.params = params
        self.slices: dict[int, tuple[int, int]] = {}
        off = 0
        for p in params:
            self.slices[id(p)] = (off, p.numel())
            off += p.numel()
        self.buf = torch.empty(off, dtype=dtype)
        self.ready = 0
        self.priority = None
        self.handle = None  # this step's operation, once every member is in


class _Member:
    """What `DistributedOptimizer` holds for a fused parameter this step:
    quacks like `ops.Handle`."""

    def __init__(self, bucket: _Bucket, p, grad: torch.Tensor, name: str):
        self._b, self._grad = bucket, grad
        self._off, self._n = bucket.slices[id(p)]
        self.name = name

    def done(self) -> bool:
        return self._b.handle is not None and self._b.handle.done()

    def wait(self, timeout: float | None = None):
        b = self._b
        if b.handle is None:
            missing = len(b.params) - b.ready
            raise RuntimeError(f"'{self.name}' is fused in '{b.name}', which waits for {missing} more gradient(s) "
                               f"of this step: call synchronize() (or step()) first")
        b.handle.wait(timeout)
        self._grad.copy_(b.buf[self._off:self._off + self._n].view_as(self._grad))
        return self._grad


class Fusion:
    def __init__(self, opt, threshold: int, matrices: bool = True):
        self._opt = opt
        self.buckets: list[_Bucket] = []
        self.of: dict[int, _Bucket] = {}
        open_: dict[torch.dtype, list] = {}
        size: dict[torch.dtype, int] = {}

        def close(dtype):
            params = open_.pop(dtype, [])
            size.pop(dtype, None)
            if len(params) > 1:
                b = _Bucket(opt._gh_ps._name(f"allreduce.fusion.{opt._gh_names[id(params[0])]}", ""), params, dtype)
                self.buckets.append(b)
                self.of.update((id(p), b) for p in params)

        for p in reversed(opt._gh_params):
            nbytes = p.numel() * p.element_size()
            if not p.requires_grad or p.dtype not in _FUSIBLE or p.is_sparse or nbytes > threshold // 4:
                continue
            if p.dim() == 2 and not matrices:
                continue
            if size.get(p.dtype, 0) + nbytes > threshold:
                close(p.dtype)
            open_.setdefault(p.dtype, []).append(p)
            size[p.dtype] = size.get(p.dtype, 0) + nbytes
        for dtype in list(open_):
            close(dtype)

    def declarations(self) -> list:
        names = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
                 torch.float64: "float64"}
        return [(b.name, (b.buf.numel(), names[b.buf.dtype])) for b in self.buckets]

    def start(self, p, grad: torch.Tensor) -> _Member:
        """p's gradient of this step is ready: into its bucket, which goes
        when it is whole."""
        opt = self._opt
        b = self.of[id(p)]
        if b.ready == 0:
            b.handle = None  # last step's, waited for already
        off, n = b.slices[id(p)]
        b.buf[off:off + n].copy_(grad.reshape(-1))
        prio = opt._gh_priority(p)
        b.priority = prio if b.ready == 0 else max(b.priority, prio)
        b.ready += 1
        if b.ready == len(b.params):
            b.ready = 0
            b.handle = opt._gh_reduce(b.buf, b.name, b.priority)
        return _Member(b, p, grad, opt._gh_names[id(p)])
