"""Worker: gradhub.torch.elastic's state objects, sampler and run().

Config: lose (a worker rank that exits abruptly inside the training
function after the first commit: the others must roll back to that
commit and get ElasticResetError, as the job cannot re-form yet).
"""

import copy
import os

import torch

import gradhub.torch as hvd
from common import CONFIG

torch.set_num_threads(1)
hvd.init()
r, n = hvd.rank(), hvd.size()
elastic = hvd.elastic

torch.manual_seed(r)  # every worker starts from different parameters: sync() must give rank 0's
model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
sampler = elastic.ElasticSampler(list(range(23)), shuffle=True, seed=7)
state = elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=3 if r == 0 else 0, batch=0)
resets = []
state.register_reset_callbacks([lambda: resets.append(hvd.size())])


def same_everywhere(t: torch.Tensor) -> bool:
    return all(torch.equal(t, x) for x in hvd.allgather_object(t, name=None))


def step(seed: int) -> None:
    g = torch.Generator().manual_seed(seed * 100 + r)
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    for p in model.parameters():
        hvd.allreduce_(p.grad, op=hvd.Average, name=None)
    opt.step()


@elastic.run
def train(st, lose=None):
    # After sync(): rank 0's parameters, optimizer state and values everywhere.
    flat = torch.cat([p.detach().reshape(-1) for p in st.model.parameters()])
    assert same_everywhere(flat), "parameters differ after sync()"
    assert st.epoch == 3, st.epoch
    # The sampler: disjoint shares, padded to the same length, covering the epoch.
    shares = hvd.allgather_object(list(st.sampler), name=None)
    assert {len(s) for s in shares} == {-(-23 // n)}, shares
    assert set().union(*map(set, shares)) == set(range(23)), shares
    st.sampler.record_batch(0, 2)
    step(1)
    st.batch = 1
    st.commit()
    committed = copy.deepcopy(st.model.state_dict()), copy.deepcopy(st.optimizer.state_dict())
    if lose is not None:
        global saved
        saved = committed
        if r == lose:
            os._exit(9)  # a worker lost mid-epoch
        for s in range(2, 50):
            step(s)  # fails once the loss is known
        raise AssertionError("the lost worker was never noticed")
    step(2)
    st.batch = 2
    st.restore()  # back to the commit: parameters, momentum, values
    for k, v in st.model.state_dict().items():
        assert torch.equal(v, committed[0][k]), k
    mom = [s["momentum_buffer"] for s in st.optimizer.state_dict()["state"].values()]
    assert all(torch.equal(a, b["momentum_buffer"]) for a, b in zip(mom, committed[1]["state"].values()))
    assert st.batch == 1, st.batch
    # The sampler after sync(): every worker's first batch processed, none of it again.
    st.sampler.sync()
    done = set().union(*map(set, hvd.allgather_object(shares[r][:2], name=None)))
    assert st.sampler.processed_indices == done, (st.sampler.processed_indices, done)
    rest = hvd.allgather_object(list(st.sampler), name=None)
    assert set().union(*map(set, rest)) == set(range(23)) - done and not done & set(rest[r])
    st.sampler.set_epoch(4)
    assert not st.sampler.processed_indices and len(st.sampler) == -(-23 // n)
    st.on_reset()
    assert resets == [n], resets
    return "trained"


lose = CONFIG.get("lose")
if lose is None:
    assert train(state) == "trained"
    # A user's error is not a reset: no rollback, raised as it is.
    try:
        elastic.run(lambda st: hvd.broadcast_object(0, root_rank=r, name="disagree"))(state)
        raise AssertionError("root ranks that disagree were not an error")
    except hvd.GradhubMismatchError as e:
        print("MISMATCH RAISED", type(e).__name__, flush=True)
else:
    try:
        train(state, lose=lose)
        raise AssertionError("a lost worker did not end train()")
    except elastic.ElasticResetError as e:
        assert f"worker {lose}" in str(e), e
        for k, v in state.model.state_dict().items():
            assert torch.equal(v, saved[0][k]), k  # rolled back to the commit
        print("ROLLED BACK", flush=True)
        os._exit(0)
print("PASS", r, flush=True)
hvd.shutdown()
