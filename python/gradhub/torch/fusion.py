"""Tensor fusion for `DistributedOptimizer` (what Horovod's fusion buffer and
DDP's buckets do): the gradients of small parameters travel packed in
buckets, one push_pull per bucket and step instead of one per parameter, so
a model with hundreds of small tensors (biases, norms) pays the per-operation
cost (the core's bookkeeping, a round trip per chunk, Python) a few times per
step rather than hundreds.

- **Buckets** are fixed at construction, the same on every worker: the
  parameters whose gradient is at most `threshold / 4` bytes, in reverse
  registration order (roughly the order backward produces them), grouped by
  dtype and device into buckets of at most `threshold` bytes. Each bucket is declared
  as one tensor (`allreduce.fusion.<first member's name>`).
- **A step**: a member's gradient hook only counts it in (a few bytecodes:
  what remains per parameter is autograd's call of the hook). When the last
  member's last backward pass is in, the members' gradients are packed into
  the bucket in one `_foreach_copy_` and the bucket is pushed at the highest
  priority of its members (forward order, as for any tensor; computed again
  only when the order changes, once). Every member's handle is then the bucket's
  operation of this step (`_BucketStep`), entered for all of them in one
  dict update; its first wait copies every member's slice back into its
  `.grad` in one `_foreach_copy_` (the slices are views of the bucket made
  once). A parameter with no gradient this step is filled with zeros by
  `synchronize()` as always (`Fusion.fill`), which completes its bucket.
- An update applied late (forward overlap) waits on its own step's
  operation, which holds that step's gradients: a bucket's next step cannot
  be packed before then, since each member's update is applied before its
  next gradient is accumulated.
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
        self.ids = [id(p) for p in params]
        self.index = {id(p): i for i, p in enumerate(params)}
        # On the members' device: a CUDA bucket goes through PyTorch's copies like any CUDA gradient.
        self.buf = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=params[0].device)
        # Each member's slice, shaped like it (views made once: the buffer stays).
        self.views = list(torch.split(self.buf, [p.numel() for p in params]))
        self.views = [v.view(p.shape) for v, p in zip(self.views, params)]
        self.counts = [0] * len(params)  # backward passes counted in this step, by member
        self.arrived = 0                 # their sum
        # The members' highest priority, and the order it was computed for
        # (the optimizer replaces its priorities when the forward pass tells the order, and when
        # autotuning switches forward overlap).
        self.priority = 0
        self.priority_for = None


class _BucketStep:
    """One bucket's operation of one step: every member's handle (quacks
    like `ops.Handle`)."""

    __slots__ = ("name", "_b", "_handle", "_grads", "_unpacked")

    def __init__(self, bucket: _Bucket, handle, grads: list):
        self.name = bucket.name
        self._b, self._handle, self._grads, self._unpacked = bucket, handle, grads, False

    def done(self) -> bool:
        return self._unpacked or self._handle.done()

    def wait(self, timeout: float | None = None):
        if not self._unpacked:
            self._handle.wait(timeout)
            torch._foreach_copy_(self._grads, self._b.views)
            self._unpacked = True

    def add_done_callback(self, fn) -> None:
        """`fn(self)` once the bucket's operation has finished (see `ops.Handle`)."""
        self._handle.add_done_callback(lambda _h: fn(self))


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

    def hook(self, p):
        """p's gradient hook: count p's backward pass into its bucket, which
        goes when every member's last pass is in."""
        opt, b = self._opt, self.of[id(p)]
        i, pid, passes = b.index[id(p)], id(p), opt._gh_passes
        full = len(b.params) * passes
        # Forward overlap checks that no update is pending; the other modes check nothing.
        check = opt._gh_mode.check_gradient if opt._gh_mode.checks_gradients else None

        def count(param):
            if check is not None:
                check(pid)
            if pid in opt._gh_handles or b.counts[i] == passes:
                raise RuntimeError(
                    f"gradient of '{opt._gh_names[pid]}' was computed twice before step(); "
                    f"call optimizer.step() (or use backward_passes_per_step) between backward passes")
            b.counts[i] += 1
            b.arrived += 1
            if b.arrived == full:
                self._push(b)

        return count

    def fill(self, p) -> None:
        """synchronize(): p produced no gradient this step (its `.grad` is
        set, to zeros if it was None): count it in whole."""
        b = self.of[id(p)]
        i = b.index[id(p)]
        b.arrived += self._opt._gh_passes - b.counts[i]
        b.counts[i] = self._opt._gh_passes
        if b.arrived == len(b.params) * self._opt._gh_passes:
            self._push(b)

    def abandon(self) -> None:
        """The step failed (an elastic reset): no member has counted in."""
        for b in self.buckets:
            b.counts = [0] * len(b.params)
            b.arrived = 0

    def accumulating(self) -> bool:
        """Some member is between backward passes (backward_passes_per_step)."""
        passes = self._opt._gh_passes
        return passes > 1 and any(0 < c < passes for b in self.buckets for c in b.counts)

    def flush(self) -> None:
        """Push every bucket not pushed yet this step, with zeros for the
        members that produced no gradient (forward overlap's step(), which
        does not go through synchronize()): every worker reduces every
        bucket every step, as synchronize() has it, or a worker that used
        none of a bucket's members this step would push it a step late, into
        the other workers' round of this one."""
        handles = self._opt._gh_handles
        for b in self.buckets:
            if b.arrived or not any(id(p) in handles for p in b.params):
                for p, c in zip(list(b.params), list(b.counts)):
                    if c < self._opt._gh_passes:
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                        self.fill(p)

    def _push(self, b: _Bucket) -> None:
        opt = self._opt
        grads = [p.grad for p in b.params]
        for j, g in enumerate(grads):
            if g.is_sparse:
                # Reduced dense, made sparse again at synchronize(), as unfused.
                grads[j] = b.params[j].grad = g.to_dense()
                opt._gh_sparse.append((b.params[j], g.sparse_dim()))
        if b.priority_for is not opt._gh_prio:
            b.priority, b.priority_for = max(opt._gh_priority(p) for p in b.params), opt._gh_prio
        torch._foreach_copy_(b.views, grads)
        step = _BucketStep(b, opt._gh_reduce(b.buf, b.name, b.priority), grads)
        b.counts = [0] * len(b.params)
        b.arrived = 0
        opt._gh_handles.update(dict.fromkeys(b.ids, step))
