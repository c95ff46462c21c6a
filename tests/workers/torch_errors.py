"""Worker: user errors in gradhub.torch get helpful messages."""

import numpy as np
import warnings

import torch

import gradhub
import gradhub.torch as hvd


def expect(exc, text, fn):
    try:
        fn()
    except exc as e:
        assert text in str(e), f"expected {text!r} in {e!r}"
        return
    raise AssertionError(f"expected {exc.__name__} containing {text!r}")


# Before init.
expect(RuntimeError, "call gradhub.init() first", lambda: hvd.allreduce(torch.ones(2)))
expect(RuntimeError, "not initialized", lambda: hvd.rank())
expect(RuntimeError, "before DistributedOptimizer",
       lambda: hvd.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)))
hvd.init()
r, n = hvd.rank(), hvd.size()

# DistributedOptimizer's Horovod arguments, checked before anything is declared.
lin = torch.nn.Linear(2, 2)
sgd = torch.optim.SGD(lin.parameters(), lr=0.1)
expect(ValueError, "only supported with op=Average",
       lambda: hvd.DistributedOptimizer(sgd, op=hvd.Sum, gradient_predivide_factor=2.0))
expect(ValueError, "must be positive", lambda: hvd.DistributedOptimizer(sgd, gradient_predivide_factor=0.0))
expect(ValueError, "Average or Sum", lambda: hvd.DistributedOptimizer(sgd, op=hvd.Max))
expect(TypeError, "ProcessSet", lambda: hvd.DistributedOptimizer(sgd, process_set=object()))
expect(ValueError, "num_groups", lambda: hvd.DistributedOptimizer(sgd, num_groups=-1))
expect(ValueError, "does not have", lambda: hvd.DistributedOptimizer(sgd, groups=[[torch.nn.Parameter(torch.ones(1))]]))
expect(ValueError, "more than one", lambda: hvd.DistributedOptimizer(sgd, groups=[[lin.weight], [lin.weight]]))
expect(NotImplementedError, "Adasum", lambda: hvd.allreduce(torch.ones(2), op=hvd.Adasum))

# Mismatched shapes under one name across ranks.
expect(hvd.GradhubError, "declared inconsistently",
       lambda: hvd.allreduce(torch.ones(3 + r), name="mismatch"))
# Disagreements Horovod raises on: different broadcast roots (the data would
# be summed), allgather with different trailing dimensions. Every worker raises.
if n > 1:
    x = torch.full((3,), float(r))
    expect(ValueError, "disagree on the root rank: worker 0 says 0, worker 1 says 1",
           lambda: hvd.broadcast(x, root_rank=min(r, 1), name="roots"))
    assert torch.equal(x, torch.full((3,), float(r))), "a refused broadcast leaves its input alone"
    expect(ValueError, "disagree on the root rank", lambda: gradhub.broadcast(np.zeros(3, np.float32),
                                                                              root_rank=min(r, 1), name="np.roots"))
    expect(ValueError, "disagree on everything but the first dimension",
           lambda: hvd.allgather(torch.ones(2, 3 + min(r, 1)), name="trailing"))
    expect(ValueError, "differs in shape or dtype",
           lambda: hvd.allgather(torch.ones(2, 2, 3) if r == 0 else torch.ones(2, 3, 2), name="trailing2"))
# A name reused with another shape is a new tensor (as in Horovod).
hvd.allreduce(torch.ones(4), name="reused")
assert torch.equal(hvd.allreduce(torch.ones(5), name="reused", op=hvd.Sum), torch.full((5,), float(n)))
# In-place op on a tensor that requires grad.
p = torch.nn.Parameter(torch.ones(3))
expect(ValueError, "requires grad", lambda: hvd.allreduce_(p, name="p"))
expect(ValueError, "requires grad", lambda: hvd.broadcast_(p, 0, name="p2"))
# CUDA requested without a GPU: torch cannot even build such a tensor here,
# so exercise gradhub's host-copy check with a stand-in that claims to be on CUDA.
if not torch.cuda.is_available():
    from gradhub.buffers import host_memory

    class OnCuda:
        device = torch.device("cuda", 0)

    expect(RuntimeError, "no GPU is available", lambda: host_memory(OnCuda()))
    expect(ValueError, "CPU and CUDA tensors", lambda: host_memory(torch.ones(2, device="meta")))
    expect(ValueError, "CPU and CUDA tensors", lambda: hvd.allreduce(torch.ones(2, device="meta"), name="meta"))
# Wrong arguments.
expect(ValueError, "not both", lambda: hvd.allreduce(torch.ones(2), average=True, op=hvd.Sum))
expect(ValueError, "out of range", lambda: hvd.broadcast(torch.ones(2), root_rank=n))
expect(TypeError, "handle", lambda: hvd.synchronize(torch.ones(1)))
model = torch.nn.Linear(2, 2)
expect(ValueError, "named_parameters should be a sequence of (name, parameter)",
       lambda: hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=list(model.parameters())))
# step() after synchronize() without skip_synchronize(): Horovod's warning.
m2 = torch.nn.Linear(2, 1)
opt2 = hvd.DistributedOptimizer(torch.optim.SGD(m2.parameters(), lr=0.1), named_parameters=m2.named_parameters())
m2(torch.ones(1, 2)).sum().backward()
opt2.synchronize()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    opt2.step()
assert any("skip_synchronize" in str(w.message) for w in caught), caught
opt2.zero_grad()
m2(torch.ones(1, 2)).sum().backward()
opt2.synchronize()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with opt2.skip_synchronize():
        opt2.step()
assert not caught, caught
hvd.shutdown()
assert not hvd.is_initialized()
# The job ended with the shutdown: joining it again is a clear error, not a hang.
expect(RuntimeError, "after shutdown()", hvd.init)
assert not hvd.is_initialized()
print("PASS", r, flush=True)
