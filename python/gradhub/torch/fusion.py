"""Tensor fusion for `DistributedOptimizer` (what Horovod's fusion buffer and
DDP's buckets do): the gradients of small parameters travel packed in
buckets, one push_pull per bucket and step instead of one per parameter, so
a model with hundreds of small tensors (biases, norms) pays the per-operation
cost (Python, the core's bookkeeping, a round trip per chunk) a few times per
step rather than hundreds.

- **Buckets** are fixed at construction, the same on every worker: the
  parameters whose gradient is at most `threshold / 4` bytes, in reverse
  registration order (roughly the order backward produces them), grouped by
  dtype and device into buckets of at most `threshold` bytes. Each bucket is declared
  as one tensor (`allreduce.fusion.<first member's name>`).
- **A step**: when the last member's gradient is ready, all of them are
  packed into the bucket in one `torch.cat` and the bucket is pushed, at the
  highest priority of its members (forward order, as for any tensor).
  Waiting for a member waits for its bucket, whose first wait copies every
  member's slice back into its `.grad` in one `_foreach_copy_` (the slices
  are views of the bucket made once). So a member costs a few Python
  operations per step, not torch calls of its own. A parameter with no
  gradient this step is filled with zeros by `synchronize()` as always,
  which completes its bucket.
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
        self.index = {id(p): i for i, p in enumerate(params)}
        # On the members' device: a CUDA bucket goes through PyTorch's copies like any CUDA gradient.
        self.buf = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=params[0].device)
        # Each member's slice, shaped like it (views made once: the buffer stays).
        self.views = list(torch.split(self.buf, [p.numel() for p in params]))
        self.views = [v.view(p.shape) for v, p in zip(self.views, params)]
        self.grads: list = [None] * len(params)
        self.ready = 0
        self.priority = None
        self.handle = None  # this step's operation, once every member is in
        self.unpacked = False
        # Steps, counted when their first member arrives; and the last one
        # unpacked (a member of an older step was copied back then).
        self.gen = 0
        self.unpacked_gen = -1

    def push(self, opt) -> None:
        torch.cat([g.reshape(-1) for g in self.grads], out=self.buf)
        self.handle = opt._gh_reduce(self.buf, self.name, self.priority)

    def wait(self, timeout: float | None, who: str, gen: int) -> None:
        if gen != self.gen:
            # An older step's member (forward overlap: an update applied
            # late). Its step was unpacked before the next one began: a new
            # step's first gradient comes from a parameter whose update was
            # applied, which unpacked the bucket.
            if gen > self.unpacked_gen:
                raise RuntimeError(f"internal: '{who}' waits for step {gen} of '{self.name}', never unpacked")
            return
        if self.handle is None:
            missing = len(self.params) - self.ready
            raise RuntimeError(f"'{who}' is fused in '{self.name}', which waits for {missing} more gradient(s) "
                               f"of this step: call synchronize() (or step()) first")
        if not self.unpacked:
            self.handle.wait(timeout)
            torch._foreach_copy_(self.grads, self.views)
            self.unpacked = True
            self.unpacked_gen = self.gen
            self.grads = [None] * len(self.params)


class _Member:
    """What `DistributedOptimizer` holds for a fused parameter this step:
    quacks like `ops.Handle`."""

    def __init__(self, bucket: _Bucket, grad: torch.Tensor, name: str):
        self._b, self._grad, self._gen = bucket, grad, bucket.gen
        self.name = name

    def done(self) -> bool:
        b = self._b
        return self._gen != b.gen or (b.handle is not None and b.handle.done())

    def wait(self, timeout: float | None = None):
        self._b.wait(timeout, self.name, self._gen)
        return self._grad


class Fusion:
    def __init__(self, opt, threshold: int, matrices: bool = True):
        self._opt = opt
        self.buckets: list[_Bucket] = []
        self.of: dict[int, _Bucket] = {}
        # Open buckets by (dtype, device): a bucket's members share both.
        open_: dict[tuple, list] = {}
        size: dict[tuple, int] = {}

        def close(kind):
            params = open_.pop(kind, [])
            size.pop(kind, None)
            if len(params) > 1:
                name = opt._gh_ps._name(f"allreduce.fusion.{opt._gh_names[id(params[0])]}{opt._gh_tag()}", "")
                b = _Bucket(name, params, kind[0])
                self.buckets.append(b)
                self.of.update((id(p), b) for p in params)

        for p in reversed(opt._gh_params):
            nbytes = p.numel() * p.element_size()
            if not p.requires_grad or p.dtype not in _FUSIBLE or p.is_sparse or nbytes > threshold // 4:
                continue
            if p.dim() == 2 and not matrices:
                continue
            kind = (p.dtype, p.device)
            if size.get(kind, 0) + nbytes > threshold:
                close(kind)
            open_.setdefault(kind, []).append(p)
            size[kind] = size.get(kind, 0) + nbytes
        for kind in list(open_):
            close(kind)

    def declarations(self) -> list:
        names = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
                 torch.float64: "float64"}
        return [(b.name, (b.buf.numel(), names[b.buf.dtype])) for b in self.buckets]

    def start(self, p, grad: torch.Tensor) -> _Member:
        """p's gradient of this step is ready: into its bucket, which goes
        when it is whole."""
        opt = self._opt
        b = self.of[id(p)]
        prio = opt._gh_priority(p)
        if b.ready == 0:  # a new step (the last one's was unpacked: see `_Bucket.wait`)
            b.handle, b.unpacked, b.priority = None, False, prio
            b.gen += 1
        elif prio > b.priority:
            b.priority = prio
        b.grads[b.index[id(p)]] = grad
        b.ready += 1
        if b.ready == len(b.params):
            b.ready = 0
            b.push(opt)
        return _Member(b, grad, opt._gh_names[id(p)])
