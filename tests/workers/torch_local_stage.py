"""Worker: exact sums through gradhub.torch with the local stage of
GRADHUB_LOCAL_STAGE, and the bytes the copy layer copied.

Config: sizes, dtypes, rounds, in_flight (every tensor started at once,
with priorities, then waited for), average, named (False: generated names),
stage ("torch": the torch stage must have staged each worker's share and
nothing more; "shm": it must have staged nothing), train (one
DistributedOptimizer step, unfused: the bytes staged are this worker's
shares of the gradients), device ("cuda": tensors on this worker's GPU,
cuda:<local rank>). The "hosts" may be emulated by GRADHUB_HOST_ID.
"""

import torch

import gradhub.torch as hvd
from common import CONFIG
from gradhub.torch import copies, local_stage

torch.set_num_threads(1)
hvd.init()
r, n = hvd.rank(), hvd.size()
lr, ls = hvd.local_rank(), hvd.local_size()
dev = torch.device("cpu")
if CONFIG.get("device") == "cuda":
    torch.cuda.set_device(lr)
    dev = torch.device("cuda", lr)
sizes = CONFIG.get("sizes", [1, 3, 17, 1000, 65_537])
dtypes = [getattr(torch, d) for d in CONFIG.get("dtypes", ["float32", "float16", "bfloat16", "float64", "int32",
                                                             "int64", "uint8"])]
rounds = CONFIG.get("rounds", 2)
stage = CONFIG.get("stage", "torch")
WIRE = {torch.uint8: torch.int64}  # the wire dtype gradhub.torch sums a uint8 in


def value(q: int, s: int, dt: torch.dtype, rnd: int) -> torch.Tensor:
    """Worker q's input: small integers, exact in every dtype (bfloat16 to 256) summed over 4 workers."""
    return ((torch.arange(s) % 7) + (q % 5) + rnd).to(dt)


# The whole job on one host: one all-reduce of the host's group, nothing staged.
whole_job = stage == "torch" and ls == n


def my_share(numel: int) -> int:
    """Elements of a tensor this worker stages with the torch stage: its 1/W share (the last one short)."""
    if whole_job:
        return 0
    share = -(-numel // ls)
    start = min(lr * share, numel)
    return min(start + share, numel) - start


def host_totals(mine: int) -> int:
    """The sum of `mine` over this worker's host (its workers share the host key)."""
    got = hvd.allgather_object((local_stage.host_key(), mine), name=None)
    return sum(b for k, b in got if k == local_stage.host_key())


expected_bytes = 0
total_bytes = 0
before = copies.counters.snapshot()
for rnd in range(rounds):
    handles, want = {}, {}
    for dt in dtypes:
        for s in sizes:
            name = f"t.{dt}.{s}" if CONFIG.get("named", True) else None
            t = value(r, s, dt, rnd).to(dev)
            ref = sum(value(q, s, torch.float64, rnd) for q in range(n))
            if CONFIG.get("average", False) and dt.is_floating_point:
                ref = ref / n
                op = hvd.Average
            else:
                op = hvd.Sum
            es = torch.empty(0, dtype=WIRE.get(dt, dt)).element_size()
            expected_bytes += my_share(s) * es
            total_bytes += s * es
            key = (str(dt), s)
            want[key] = ref
            if CONFIG.get("in_flight", False):
                handles[key] = hvd.allreduce_async(t, op=op, name=name, priority=s % 11)
            else:
                handles[key] = hvd.allreduce(t, op=op, name=name)
    for key, h in handles.items():
        got = hvd.synchronize(h) if isinstance(h, hvd.Handle) else h
        ref = want[key]
        assert got.dtype == getattr(torch, key[0].split(".")[1]) and got.device == dev, (key, got.dtype, got.device)
        got = got.cpu()
        assert torch.equal(got.to(torch.float64), ref.to(got.dtype).to(torch.float64)), \
            (key, rnd, got[:8].tolist(), ref[:8].tolist())

d2h, h2d = (a - b for a, b in zip(copies.counters.snapshot(), before))
if stage == "torch":
    # Each worker copied its share to the host and back; the host's workers together the whole tensors once.
    assert d2h == expected_bytes and h2d == expected_bytes, (d2h, h2d, expected_bytes)
    assert host_totals(d2h) == (0 if whole_job else total_bytes), (host_totals(d2h), total_bytes)
else:
    assert d2h == 0 and h2d == 0, (d2h, h2d)

if CONFIG.get("train", False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.Tanh(), torch.nn.Linear(31, 5)).to(dev)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), fusion_threshold=0,
                                   sufficient_factors="off")
    hvd.broadcast_parameters(model.state_dict())
    x = torch.randn(8, 13, generator=torch.Generator().manual_seed(r)).to(dev)
    before = copies.counters.snapshot()[0]
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    staged = copies.counters.snapshot()[0] - before
    grads = sum(my_share(p.numel()) * p.element_size() for p in model.parameters())
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    want = grads if stage == "torch" else 0
    assert staged == want, (staged, want, whole)
    if stage == "torch":
        assert host_totals(staged) == (0 if whole_job else whole), (host_totals(staged), whole)
    print(f"STAGED {staged} of {whole} gradient bytes", flush=True)

print(f"LOCAL {lr} of {ls} STAGE {stage}" + (" WHOLE JOB" if whole_job else ""), flush=True)
print("PASS", r, flush=True)
hvd.shutdown()
