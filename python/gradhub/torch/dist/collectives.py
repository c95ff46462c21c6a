"""The gradhub backend's collectives: `Collectives`, one torch process
group's gradhub side (on the torch class `classes.py` picks), each collective one or two push_pulls (see the
package's docstring), and the byte-slot buffers gathers are made of."""

from __future__ import annotations

import datetime
import itertools
import threading
from typing import Callable

import torch
import torch.distributed as dist

from ... import api as _api
from ..process_sets import ProcessSet
from ..sums import start_reduction, start_sum
from .job import end_job
from .p2p import PointToPoint
from .work import GradhubBackendError, Work, _all_of, _failure, _Helper, _now, _Op, _unsupported, _watchdog

NAME = "gradhub"
_R = dist.ReduceOp.RedOpType
# Reductions done by gathering every member's tensor and reducing here.
_GATHERED: dict = {
    _R.MIN: lambda g: g.amin(0) if g.dtype != torch.bool else g.all(0),
    _R.MAX: lambda g: g.amax(0) if g.dtype != torch.bool else g.any(0),
    _R.PRODUCT: lambda g: g.prod(0).to(g.dtype) if g.dtype != torch.bool else g.all(0),
    _R.BAND: lambda g: _fold(g, torch.bitwise_and),
    _R.BOR: lambda g: _fold(g, torch.bitwise_or),
    _R.BXOR: lambda g: _fold(g, torch.bitwise_xor),
}
_MAX_NAMES = 256   # persistent names per group (then: named once, freed after the round)
_WINDOW = 4        # rounds of one key that may be in flight at once, under names of their own
BUCKET_PARTS = 64  # parts of one DDP bucket averaged apart at most (average_bucket)


def _fold(g: torch.Tensor, fn) -> torch.Tensor:
    if g.is_floating_point():
        raise TypeError(f"bitwise reduction of {g.dtype}")
    out = g[0].clone()
    for x in g[1:]:
        out = fn(out, x)
    return out


# ---------------------------------------------------------------- buffers


def _words(nbytes: int) -> int:
    return (nbytes + 3) // 4


def _aligned(words: int) -> int:
    """`words` rounded up to a multiple of 4 (16 bytes)."""
    return (words + 3) // 4 * 4


def _as_words(t: torch.Tensor) -> torch.Tensor | None:
    """`t`'s memory as int32 words, if it can be (contiguous, a multiple of 4 bytes)."""
    if not t.is_contiguous() or t.numel() * t.element_size() % 4 or t.data_ptr() % 4:
        return None
    return t.reshape(-1).view(torch.uint8).view(torch.int32) if t.numel() else None


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _slot_write(buf: torch.Tensor, slot: int, words: int, t: torch.Tensor) -> None:
    """Put `t`'s bytes at slot `slot` (of `words` int32 words) of `buf`."""
    b = _bytes_of(t)
    buf.view(torch.uint8)[slot * words * 4: slot * words * 4 + b.numel()].copy_(b)


def _slot_read(buf: torch.Tensor, slot: int, words: int, like: torch.Tensor) -> torch.Tensor:
    n = like.numel() * like.element_size()
    raw = buf.view(torch.uint8)[slot * words * 4: slot * words * 4 + n]
    return raw.view(like.dtype).reshape(like.shape)


# ---------------------------------------------------------------- groups


class _GroupSet(ProcessSet):
    """A sub-group's process set: not registered (torch creates sub-groups
    on their members only); its name prefix is the group's."""

    def __init__(self, ranks: list[int], group_name: str):
        super().__init__(ranks)
        self.process_set_id = f"g{group_name}"


class Collectives:
    """One torch process group's gradhub side: every collective, on top of
    whichever torch class this torch lets Python extend (`backend_class`)."""

    def __init__(self, rank: int, size: int, ps: ProcessSet, prefix: str, timeout: float, owns_job: bool,
                 store=None):
        super().__init__(rank, size)
        # The group's keys in torch's store (monitored_barrier): a store can
        # outlive its group (init, destroy, init again), so each creation's
        # keys go under a prefix of their own.
        self._keys = None
        # This creation's name, the same on every member (point-to-point
        # links refuse a connection for another group).
        self._group_id = prefix or "default"
        if store is not None:
            gen = (store.add("gradhub/created", 1) - 1) // size
            self._keys = dist.PrefixStore(f"gradhub/{gen}", store)
            self._group_id = f"{self._group_id}#{gen}"
        self._barriers = 0
        self._rank, self._size = rank, size
        self._ps = ps
        self._prefix = prefix
        self._timeout = timeout
        self._owns_job = owns_job
        self._counts: dict[tuple, int] = {}
        self._last: dict[str, object] = {}   # persistent name -> its last round in flight
        self._lock = threading.Lock()
        self._helper: _Helper | None = None
        self._closed = False

    def getBackendName(self) -> str:
        return NAME

    @property
    def supports_coalescing(self) -> bool:
        """No coalescing (torch then calls each operation itself); defined
        here because torch's property, read on a Python subclass, calls
        itself until the stack overflows (batch_isend_irecv reads it)."""
        return False

    def __repr__(self) -> str:
        return f"<gradhub backend rank {self._rank} of {self._size} ({self._prefix or 'default group'})>"

    # -- names

    def _name(self, kind: str, dtype, nbytes: int) -> str:
        """The next operation's name, the same on every member (same call order)."""
        with self._lock:
            key = (kind, str(dtype), nbytes)
            n = self._counts.get(key)
            if n is None:
                if len(self._counts) >= _MAX_NAMES:
                    return _api.AutoName(f"{self._prefix}dist.{kind}{_api.AUTO_MARK}{next(self._once)}")
                n = 0
            self._counts[key] = n + 1
            return f"{self._prefix}dist.{kind}.{str(dtype).replace('torch.', '')}.{nbytes}.{n % _WINDOW}"

    @property
    def _once(self):
        it = getattr(self, "_once_it", None)
        if it is None:
            it = self._once_it = itertools.count()
        return it

    def _before(self, name: str) -> None:
        """A name is used again only once its previous round is in here."""
        prev = self._last.pop(name, None) if not isinstance(name, _api.AutoName) else None
        if prev is not None and not prev.done():
            try:
                prev.wait()
            except Exception:  # noqa: BLE001 - reported by that operation's own Work
                pass

    def _sum(self, buf: torch.Tensor, name: str, live=None, priority: int = 0, want=None, sharded: bool = False,
             live_is_own: bool = False):
        """Start summing `buf` (in place) over the group: an api.Handle.
        `live`, `want`, `sharded`, `live_is_own`: as `gradhub.api.push_pull_async`'s."""
        self._check_open()
        self._before(name)
        try:
            h = start_sum(buf, name, self._ps, priority=priority, live=live, want=want, sharded=sharded,
                          live_is_own=live_is_own)
        except _api.GradhubError as e:
            raise _failure(f"operation {name}", e) from e
        if not isinstance(name, _api.AutoName):
            self._last[name] = h
        return h

    def _check_open(self) -> None:
        if self._closed or not _api.is_initialized():
            raise GradhubBackendError("gradhub: the process group was destroyed (its gradhub job has ended)")

    # -- completion

    def _op(self, what: str, outputs: list[torch.Tensor], timeout: float | None = None) -> _Op:
        """An operation, failed by the watchdog after the group's timeout
        or the call's own (`timeout`)."""
        op = _Op(what, outputs)
        _watchdog.add(op, self._timeout if timeout is None else timeout, own=timeout is not None)
        return op

    def _complete_when(self, op: _Op, handles: list, finish: Callable[[], None] | None = None) -> Work:
        """`op` completes once every handle has: `finish()` runs then (copies out)."""
        left = [len(handles)]
        lock = threading.Lock()

        def one(h):
            try:
                h.wait()
            except Exception as e:  # noqa: BLE001
                op.finish(_failure(op.what, e))
                return
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                try:
                    if finish is not None:
                        finish()
                except Exception as e:  # noqa: BLE001
                    op.finish(_failure(op.what, e))
                    return
                op.finish()

        if not handles:
            one_done = finish
            try:
                if one_done is not None:
                    one_done()
                op.finish()
            except Exception as e:  # noqa: BLE001
                op.finish(_failure(op.what, e))
        for h in handles:
            h.add_done_callback(one)
        return Work(op, self._timeout)

    def _in_thread(self, what: str, outputs: list[torch.Tensor], body: Callable[[], None]) -> Work:
        """Run `body` (several rounds, each waited for) on this group's helper
        thread, in call order; its names must be taken before (here)."""
        op = self._op(what, outputs)
        if self._helper is None:
            self._helper = _Helper()

        def run():
            try:
                body()
            except Exception as e:  # noqa: BLE001
                op.finish(_failure(what, e))
                return
            op.finish()

        self._helper.submit(run)
        return Work(op, self._timeout)

    # -- gathers (the building block of min/max, all_gather, gather, all_to_all)

    def _gather_start(self, t: torch.Tensor, name: str, device=None, wanted: bool = True):
        """Start gathering every member's `t` (same size everywhere): (handle,
        buffer, words per slot). Not `wanted`: this member reads none of it."""
        words = _words(t.numel() * t.element_size())
        buf = torch.zeros(self._size * words, dtype=torch.int32, device=device or t.device)
        _slot_write(buf, self._rank, words, t)
        # (our own slot comes back as we wrote it: its chunks ask for no result)
        h = self._sum(buf, name, live=(self._rank * words, (self._rank + 1) * words),
                      want=None if wanted else _NOTHING, sharded=True, live_is_own=True)
        return h, buf, words

    # ---------------------------------------------------------------- collectives

    def allreduce(self, tensors, opts):
        t = _one(tensors, "all_reduce")
        if t.is_sparse:
            return self._sparse_allreduce(t, opts.reduceOp)
        return self._allreduce(t, opts.reduceOp, "all_reduce")

    def _sparse_allreduce(self, t: torch.Tensor, rop) -> Work:
        """A sparse COO tensor's sum, as gloo's: every member's indices and
        values gathered (their counts first), summed and coalesced here,
        `t` replaced by the sum."""
        if rop.op != _R.SUM:
            raise _unsupported(f"sparse all_reduce with {rop.op.name}", "only SUM, as gloo")
        n, me = self._size, self._rank
        meta_name = self._name("all_reduce.sparse.nnz", torch.int64, n * 8)
        c = t.detach().coalesce()
        idx, vals = c.indices().contiguous(), c.values().contiguous()
        row = vals[0].numel() if vals.dim() > 1 else 1   # dense elements per index

        def body():
            meta = torch.zeros(n, dtype=torch.int64)
            meta[me] = idx.shape[1]
            self._sum(meta, meta_name, live=(me, me + 1)).wait()
            counts = meta.tolist()
            most = max(counts)
            # Slots and the values within them start on 16 bytes (the widest element).
            iw = _aligned(_words(most * idx.shape[0] * 8))
            words = iw + _aligned(_words(most * row * vals.element_size()))
            if most:
                buf = torch.zeros(n * words, dtype=torch.int32)
                raw = buf.view(torch.uint8)
                ib, vb = _bytes_of(idx), _bytes_of(vals)
                raw[me * words * 4: me * words * 4 + ib.numel()].copy_(ib)
                raw[(me * words + iw) * 4: (me * words + iw) * 4 + vb.numel()].copy_(vb)
                self._sum(buf, data_name, live=(me * words, (me + 1) * words)).wait()
            all_idx, all_vals = [], []
            for q, k in enumerate(counts):
                if not k:
                    continue
                base = q * words * 4
                all_idx.append(raw[base: base + k * idx.shape[0] * 8].view(torch.int64).view(idx.shape[0], k))
                vbytes = raw[base + iw * 4: base + iw * 4 + k * row * vals.element_size()]
                all_vals.append(vbytes.view(vals.dtype).view(k, *vals.shape[1:]))
            if all_idx:
                total = torch.sparse_coo_tensor(torch.cat(all_idx, 1), torch.cat(all_vals), t.shape).coalesce()
            else:
                total = torch.sparse_coo_tensor(idx, vals, t.shape).coalesce()
            t.copy_(total)

        data_name = _api.AutoName(f"{self._prefix}dist.all_reduce.sparse{_api.AUTO_MARK}{next(self._once)}")
        return self._in_thread("sparse all_reduce", [t], body)

    def average_bucket(self, t: torch.Tensor, index: int, part: int = 0) -> Work:
        """Average part `part` of DDP's bucket `index` (`t`, a view of its
        buffer) over the group in place, under a name of its own and at a
        priority that puts later buckets, then later parts, sooner among
        this worker's pushes (DDP numbers buckets, and lays out each
        bucket's gradients, in the order they become ready, so the first
        layers' come last and are needed first): what `ddp_forward_overlap`
        starts (torch's all_reduce has neither, and its names cycle through
        `_WINDOW` per size, which would stall a backward pass making more
        buckets of one size)."""
        if not 0 <= part < BUCKET_PARTS:
            raise ValueError(f"average_bucket: part {part} is outside 0..{BUCKET_PARTS - 1}")
        name = f"{self._prefix}dist.ddp_bucket.{index}.{part}.{str(t.dtype).replace('torch.', '')}.{t.numel()}"
        return self._allreduce(t, dist.ReduceOp(dist.ReduceOp.AVG), "all_reduce",
                               priority=index * BUCKET_PARTS + part, name=name)

    def _allreduce(self, t: torch.Tensor, rop, what: str, out: torch.Tensor | None = None,
                   want: tuple[int, int] | None = None, sharded: bool = False, priority: int = 0,
                   name: str | None = None) -> Work:
        """Reduce `t` over the group into `out` (default: `t`, in place);
        `want`: only these elements of the flattened result are read."""
        out = t if out is None else out
        kind = rop.op
        if t.is_sparse:
            raise _unsupported(f"sparse {what}", "all_reduce takes sparse tensors")
        if kind in _GATHERED:
            if kind in (_R.BAND, _R.BOR, _R.BXOR) and t.is_floating_point():
                raise _unsupported(f"{what} with {kind.name} on {t.dtype}", "bitwise ops need integer or bool tensors")
            name = self._name(what + ".gather", t.dtype, t.numel() * t.element_size())
            h, buf, words = self._gather_start(t, name, wanted=want != _NOTHING)
            op = self._op(what, [out])

            def reduce():
                g = torch.stack([_slot_read(buf, q, words, t) for q in range(self._size)])
                out.copy_(_GATHERED[kind](g).reshape(out.shape).to(out.dtype))

            return self._complete_when(op, [h], reduce)
        if kind not in (_R.SUM, _R.AVG, _R.PREMUL_SUM):
            raise _unsupported(f"{what} with op {kind}")
        src = t
        if kind == _R.PREMUL_SUM:
            f = _premul_factor(rop)
            src = t * (f.to(t.device) if isinstance(f, torch.Tensor) else f)
        name = name or self._name(what, t.dtype, t.numel() * t.element_size())
        self._check_open()
        self._before(name)
        target = out if src is t and out.is_contiguous() else None
        try:
            h = start_reduction(src, name, self._ps, average=kind == _R.AVG, target=target, want=want,
                                sharded=sharded, priority=priority)
        except _api.GradhubError as e:
            raise _failure(what, e) from e
        self._last[name] = h
        op = self._op(what, [out])

        def finish():
            r = h.wait()
            if r.data_ptr() != out.data_ptr():
                out.copy_(r.view(out.shape))

        return self._complete_when(op, [h], finish)

    def allreduce_coalesced(self, tensors, opts):
        works = [self._allreduce(t, opts.reduceOp, "all_reduce_coalesced") for t in tensors]
        return _all_of(works, list(tensors), "all_reduce_coalesced", self)

    def allreduce_sparse(self, tensors, opts):
        return self._sparse_allreduce(_one(tensors, "all_reduce"), opts.reduceOp)

    def broadcast(self, tensors, opts):
        t = _one(tensors, "broadcast")
        root = opts.rootRank
        nbytes = t.numel() * t.element_size()
        name = self._name("broadcast", t.dtype, nbytes)
        op = self._op("broadcast", [t])
        if nbytes == 0:
            return self._complete_when(op, [])
        words = _as_words(t)
        direct = words is not None
        buf = words if direct else torch.zeros(_words(nbytes), dtype=torch.int32, device=t.device)
        if self._rank == root:
            if not direct:
                _slot_write(buf, 0, _words(nbytes), t)
            h = self._sum(buf, name)
        else:
            buf.zero_()
            h = self._sum(buf, name, live=(0, 0))

        def finish():
            if not direct and self._rank != root:
                t.copy_(_slot_read(buf, 0, _words(nbytes), t))

        return self._complete_when(op, [h], finish)

    def reduce(self, tensors, opts):
        t = _one(tensors, "reduce")
        if self._rank == opts.rootRank:
            return self._allreduce(t, opts.reduceOp, "reduce")
        # The others' tensors are left as they are (gloo's leave them
        # unspecified), and no result comes back to them.
        return self._allreduce(t.clone(), opts.reduceOp, "reduce", want=_NOTHING)

    def all_gather_single(self, output, input, opts):
        return self._all_gather_flat(output, input, "all_gather_into_tensor")

    def _allgather_base(self, output, input, opts):
        return self._all_gather_flat(output, input, "all_gather_into_tensor")

    def _all_gather_flat(self, output: torch.Tensor, input: torch.Tensor, what: str) -> Work:
        if output.numel() != input.numel() * self._size:
            raise ValueError(f"{what}: the output has {output.numel()} elements, not {self._size} x "
                             f"{input.numel()} (the group's size times the input's)")
        if output.dtype != input.dtype:
            raise TypeError(f"{what}: output dtype {output.dtype} differs from the input's {input.dtype}")
        nbytes = input.numel() * input.element_size()
        name = self._name(what, input.dtype, nbytes)
        op = self._op(what, [output])
        if nbytes == 0:
            return self._complete_when(op, [])
        out_words = _as_words(output)
        if out_words is not None and nbytes % 4 == 0:  # straight into the output
            w = nbytes // 4
            src = _bytes_of(input)
            # Zero the others' slots, write ours (the input may alias our slot).
            mine = src.clone() if _overlaps(output, input) else src
            out_words.zero_()
            out_words.view(torch.uint8)[self._rank * nbytes:(self._rank + 1) * nbytes].copy_(mine)
            h = self._sum(out_words, name, live=(self._rank * w, (self._rank + 1) * w), sharded=True, live_is_own=True)
            return self._complete_when(op, [h])
        h, buf, words = self._gather_start(input, name)

        def finish():
            flat = output.view(self._size, *input.shape) if output.is_contiguous() else None
            for q in range(self._size):
                piece = _slot_read(buf, q, words, input)
                if flat is not None:
                    flat[q].copy_(piece)
                else:
                    output.reshape(self._size, -1)[q].copy_(piece.reshape(-1))

        return self._complete_when(op, [h], finish)

    def allgather(self, output_tensors, input_tensors, opts):
        t = _one(input_tensors, "all_gather")
        outs = _one(output_tensors, "all_gather")
        if len(outs) != self._size:
            raise ValueError(f"all_gather: {len(outs)} output tensors for a group of {self._size}")
        for o in outs:
            if o.numel() != t.numel():
                raise _unsupported("all_gather of tensors of different sizes",
                                   f"every member gives {t.numel()} elements here, an output has {o.numel()}")
        name = self._name("all_gather", t.dtype, t.numel() * t.element_size())
        op = self._op("all_gather", list(outs))
        if t.numel() == 0:
            return self._complete_when(op, [])
        h, buf, words = self._gather_start(t, name)

        def finish():
            for q, o in enumerate(outs):
                o.copy_(_slot_read(buf, q, words, t).reshape(o.shape))

        return self._complete_when(op, [h], finish)

    def allgather_coalesced(self, output_lists, input_tensors, opts):
        """`output_lists[q][i]`: member q's tensor i (one list per member)."""
        if len(output_lists) != self._size or any(len(outs) != len(input_tensors) for outs in output_lists):
            raise ValueError(f"all_gather_coalesced: {len(output_lists)} output lists for a group of {self._size}, "
                             f"each needs {len(input_tensors)} tensors (one per input)")
        works = [self.allgather([[outs[i] for outs in output_lists]], [t], opts) for i, t in enumerate(input_tensors)]
        return _all_of(works, [o for outs in output_lists for o in outs], "all_gather_coalesced", self)

    def all_gather_single_coalesced(self, outputs, inputs, opts):
        works = [self._all_gather_flat(o, i, "all_gather_into_tensor_coalesced") for o, i in zip(outputs, inputs)]
        return _all_of(works, list(outputs), "all_gather_into_tensor_coalesced", self)

    def gather(self, output_tensors, input_tensors, opts):
        t = _one(input_tensors, "gather")
        root = opts.rootRank
        outs = output_tensors[0] if output_tensors else []
        name = self._name("gather", t.dtype, t.numel() * t.element_size())
        op = self._op("gather", list(outs))
        if t.numel() == 0:
            return self._complete_when(op, [])
        h, buf, words = self._gather_start(t, name, wanted=self._rank == root)

        def finish():
            if self._rank == root:
                if len(outs) != self._size:
                    raise ValueError(f"gather: {len(outs)} output tensors on the root for a group of {self._size}")
                for q, o in enumerate(outs):
                    o.copy_(_slot_read(buf, q, words, t).reshape(o.shape))

        return self._complete_when(op, [h], finish)

    def gather_single(self, output, input, opts):
        """`dist.gather_single` (torch 2.15): every member's `input` into the
        root's one `output` (empty elsewhere)."""
        root = opts.rootRank
        nbytes = input.numel() * input.element_size()
        name = self._name("gather_single", input.dtype, nbytes)
        op = self._op("gather_single", [output])
        if self._rank == root and output.numel() != input.numel() * self._size:
            raise ValueError(f"gather_single: the output has {output.numel()} elements, not {self._size} x "
                             f"{input.numel()} (the group's size times the input's)")
        if nbytes == 0:
            return self._complete_when(op, [])
        h, buf, words = self._gather_start(input, name, wanted=self._rank == root)

        def finish():
            if self._rank == root:
                rows = output.reshape(self._size, -1)
                for q in range(self._size):
                    rows[q].copy_(_slot_read(buf, q, words, input).reshape(-1))

        return self._complete_when(op, [h], finish)

    def scatter(self, output_tensors, input_tensors, opts):
        out = _one(output_tensors, "scatter")
        root = opts.rootRank
        nbytes = out.numel() * out.element_size()
        name = self._name("scatter", out.dtype, nbytes)
        op = self._op("scatter", [out])
        if nbytes == 0:
            return self._complete_when(op, [])
        words = _words(nbytes)
        buf = torch.zeros(self._size * words, dtype=torch.int32, device=out.device)
        if self._rank == root:
            ins = input_tensors[0]
            if len(ins) != self._size:
                raise ValueError(f"scatter: {len(ins)} input tensors on the root for a group of {self._size}")
            for q, x in enumerate(ins):
                if x.numel() != out.numel():
                    raise _unsupported("scatter of tensors of different sizes")
                _slot_write(buf, q, words, x)
        # Each member reads its own slot only.
        mine = (self._rank * words, (self._rank + 1) * words)
        h = self._sum(buf, name, want=mine) if self._rank == root else self._sum(buf, name, live=(0, 0), want=mine)

        def finish():
            out.copy_(_slot_read(buf, self._rank, words, out))

        return self._complete_when(op, [h], finish)

    def reduce_scatter(self, output_tensors, input_tensors, opts):
        out = _one(output_tensors, "reduce_scatter")
        ins = _one(input_tensors, "reduce_scatter")
        if len(ins) != self._size:
            raise ValueError(f"reduce_scatter: {len(ins)} input tensors for a group of {self._size}")
        if any(x.numel() != out.numel() for x in ins):
            raise _unsupported("reduce_scatter of tensors of different sizes")
        flat = torch.cat([x.reshape(-1) for x in ins])
        return self._reduce_scatter_flat(out, flat, opts.reduceOp, "reduce_scatter")

    def reduce_scatter_single(self, output, input, opts):
        return self._reduce_scatter_flat(output, input, opts.reduceOp, "reduce_scatter_tensor")

    def _reduce_scatter_base(self, output, input, opts):
        return self._reduce_scatter_flat(output, input, opts.reduceOp, "reduce_scatter_tensor")

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        works = [self._reduce_scatter_flat(o, i, opts.reduceOp, "reduce_scatter_tensor_coalesced")
                 for o, i in zip(outputs, inputs)]
        return _all_of(works, list(outputs), "reduce_scatter_tensor_coalesced", self)

    def _reduce_scatter_flat(self, output: torch.Tensor, input: torch.Tensor, rop, what: str) -> Work:
        if input.numel() != output.numel() * self._size:
            raise ValueError(f"{what}: the input has {input.numel()} elements, not {self._size} x "
                             f"{output.numel()} (the group's size times the output's)")
        # The whole input is pushed (a copy: the input is the caller's); only
        # this member's shard of the sum comes back.
        full = input.detach().reshape(-1).clone()
        op = self._op(what, [output])
        n = output.numel()
        inner = self._allreduce(full, rop, what, want=(self._rank * n, (self._rank + 1) * n), sharded=True)

        def copy(_fut=None):
            output.copy_(full[self._rank * n:(self._rank + 1) * n].view(output.shape))

        def done(h):
            try:
                if h._op._error is not None:  # (set before its future completes, which calls this)
                    raise h._op._error
                copy()
            except Exception as e:  # noqa: BLE001
                op.finish(e if isinstance(e, dist.DistBackendError) else _failure(what, e))
                return
            op.finish()

        inner._op.future.add_done_callback(lambda _f: done(inner))
        return Work(op, self._timeout)

    def alltoall(self, output_tensors, input_tensors, opts):
        if len(output_tensors) != self._size or len(input_tensors) != self._size:
            raise ValueError(f"all_to_all: {len(input_tensors)} inputs and {len(output_tensors)} outputs for a "
                             f"group of {self._size}")
        t0 = input_tensors[0]
        flat_in = torch.cat([x.reshape(-1) for x in input_tensors])
        sizes = [x.numel() for x in input_tensors]
        return self._all_to_all(list(output_tensors), flat_in, sizes, t0.dtype, "all_to_all")

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts):
        n = self._size
        rows_in = input.shape[0] if input.dim() else 1
        row = input.numel() // max(rows_in, 1) if input.numel() else 0
        if not input_split_sizes:
            if rows_in % n:
                raise ValueError(f"all_to_all_single: {rows_in} rows do not split evenly over {n} members")
            input_split_sizes = [rows_in // n] * n
        if not output_split_sizes:
            out_rows = output.shape[0] if output.dim() else 1
            if out_rows % n:
                raise ValueError(f"all_to_all_single: {out_rows} output rows do not split evenly over {n} members")
            output_split_sizes = [out_rows // n] * n
        outs = list(output.reshape(-1).split([s * row for s in output_split_sizes])) if output.is_contiguous() \
            else None
        if outs is None:
            raise _unsupported("all_to_all_single into a non-contiguous output")
        return self._all_to_all(outs, input.reshape(-1), [s * row for s in input_split_sizes], input.dtype,
                                "all_to_all_single", keep=[output])

    def _all_to_all(self, outs: list[torch.Tensor], flat_in: torch.Tensor, sizes: list[int], dtype, what: str,
                    keep: list[torch.Tensor] | None = None) -> Work:
        """Every member's input (split into `sizes` elements per destination)
        gathered; each keeps the parts sent to it. The sizes first, on a helper thread."""
        n, me = self._size, self._rank
        meta_name = self._name(what + ".sizes", torch.int64, n * 8)
        flat_in = flat_in.detach().clone()
        elem = flat_in.element_size()

        def body():
            meta = torch.zeros(n * n, dtype=torch.int64)
            meta[me * n:(me + 1) * n] = torch.tensor(sizes, dtype=torch.int64)
            self._sum(meta, meta_name, live=(me * n, (me + 1) * n)).wait()
            m = meta.view(n, n).tolist()
            words = _words(max(sum(r) for r in m) * elem)
            buf = torch.zeros(n * words, dtype=torch.int32, device=flat_in.device)
            _slot_write(buf, me, words, flat_in)
            h = self._sum(buf, data_name, live=(me * words, (me + 1) * words))
            h.wait()
            for q in range(n):
                start = sum(m[q][:me])
                if m[q][me] != outs[q].numel():
                    raise ValueError(f"{what}: member {q} sends {m[q][me]} elements to member {me}, which expects "
                                     f"{outs[q].numel()}")
                raw = buf.view(torch.uint8)[q * words * 4 + start * elem: q * words * 4 + (start + m[q][me]) * elem]
                outs[q].copy_(raw.view(dtype).reshape(outs[q].shape))

        data_name = _api.AutoName(f"{self._prefix}dist.{what}{_api.AUTO_MARK}{next(self._once)}")
        return self._in_thread(what, keep or outs, body)

    # torch 2.12's names for three of the above (its dist.* call these)
    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts):
        return self.all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts):
        return self.all_gather_single_coalesced(outputs, inputs, opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts):
        return self.reduce_scatter_single_coalesced(outputs, inputs, opts)

    def barrier(self, opts):
        name = self._name("barrier", torch.float32, 4)
        own = opts.timeout.total_seconds() if isinstance(opts.timeout, datetime.timedelta) else -1.0
        op = self._op("barrier", [], timeout=own if own > 0 else None)   # (unset: -1 ms)
        h = self._sum(torch.zeros(1), name)
        return self._complete_when(op, [h])

    # -- point-to-point (`p2p`)

    @property
    def _p2p(self) -> PointToPoint:
        p = getattr(self, "_p2p_side", None)
        if p is None:
            with self._lock:
                p = getattr(self, "_p2p_side", None)
                if p is None:
                    p = self._p2p_side = PointToPoint(self._rank, self._size, self._keys, self._group_id, self._timeout)
        return p

    def send(self, tensors, dst, tag):
        self._check_open()
        return self._p2p.send(_one(tensors, "send"), dst, tag)

    def recv(self, tensors, src, tag):
        self._check_open()
        return self._p2p.recv(_one(tensors, "recv"), src, tag)

    def recv_anysource(self, tensors, tag):
        self._check_open()
        return self._p2p.recv(_one(tensors, "recv"), None, tag)

    def monitored_barrier(self, opts, wait_all_ranks=False):
        """gloo's monitored barrier, through torch's store: every other
        member checks in with member 0, which names who did not within the
        timeout (the first in rank order, or all with `wait_all_ranks`) and
        otherwise lets them all go. Blocking, as gloo's."""
        t = opts if isinstance(opts, datetime.timedelta) else opts.timeout   # (the ProcessGroup form gets the timeout)
        timeout = t.total_seconds() if isinstance(t, datetime.timedelta) else float(t)
        if self._keys is None:
            raise _unsupported("monitored_barrier on a group created without torch's store")
        self._barriers += 1
        key = f"monitored_barrier/{self._barriers}"
        go, start, ms = f"{key}/go", _now(), round(timeout * 1000)

        def arrived(k: str, within: float) -> bool:
            try:
                self._keys.wait([k], datetime.timedelta(seconds=max(within, 1e-3)))
                return True
            except Exception:  # noqa: BLE001 - the store's timeout
                return False

        if self._rank != 0:
            self._keys.set(f"{key}/{self._rank}", "1")
            if not (arrived(go, timeout) and self._keys.get(go) == b"ok"):
                raise GradhubBackendError(
                    f"Rank {self._rank} successfully reached monitoredBarrier, but received errors while waiting "
                    f"for send/recv from rank 0. Please check rank 0 logs for faulty rank.")
            return None

        def fail(message: str) -> GradhubBackendError:
            self._keys.set(go, "failed")   # the others stop waiting
            return GradhubBackendError(message)

        failed, done = [], []
        for q in range(1, self._size):
            # (as gloo: waiting for all, each member gets the whole timeout)
            left = timeout if wait_all_ranks else timeout - (_now() - start)
            if left <= 0 and not wait_all_ranks:
                raise fail(f"Rank 0 timed out in monitoredBarrier after {ms} ms. Original timeout {ms} ms; ranks "
                           f"{done} checked in")
            if arrived(f"{key}/{q}", left):
                done.append(q)
            elif wait_all_ranks:
                failed.append(q)
            else:
                raise fail(f"[Rank 0]: Rank {q} failed to pass monitoredBarrier in {ms} ms")
        if failed:
            raise fail(f"[Rank 0]: Ranks {', '.join(map(str, failed))} failed to pass monitoredBarrier in {ms} ms")
        self._keys.set(go, "ok")
        return None

    def shutdown(self) -> None:
        self._close()

    def abort(self) -> None:
        self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._helper is not None:
            self._helper.stop()
        p2p = getattr(self, "_p2p_side", None)
        if p2p is not None:
            p2p.close()
        if self._owns_job:
            end_job()


# `want` for a member that reads none of a result (a reduce's or a gather's non-root).
_NOTHING = (0, 0)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device:
        return False
    a0, a1 = a.data_ptr(), a.data_ptr() + a.numel() * a.element_size()
    b0, b1 = b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()
    return a0 < b1 and b0 < a1


def _premul_factor(rop):
    """A PREMUL_SUM's factor (a float or a tensor): `rop.factor`, or where
    torch does not expose it (2.12), from the op's pickled state."""
    f = getattr(rop, "factor", None)
    return f if f is not None else rop.__getstate__()[1]


def _one(tensors, what: str):
    if len(tensors) != 1:
        raise _unsupported(f"{what} of {len(tensors)} tensors per process (the multi-device form)",
                           "one tensor per process")
    return tensors[0]
