"""`gradhub.torch.ddp_forward_overlap` in one process (a gloo group of one):
the schedule's edges, step for step against plain DDP. Several processes,
over the gradhub backend and over gloo: tests/test_backend.py
(tests/workers/backend_ddp_overlap.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import gradhub.torch as ght  # noqa: E402


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def make() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))


def data(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(5, 6, generator=g), torch.randn(5, 2, generator=g)


def pair(opt_cls, **kw):
    """(overlapped DDP, its optimizer, plain DDP, its optimizer), two parameter groups each."""
    models = [nn.parallel.DistributedDataParallel(make(), bucket_cap_mb=0.0005, **kw) for _ in range(2)]
    opts = []
    for m in models:
        first, rest = list(m.module[0].parameters()), [p for layer in m.module[1:] for p in layer.parameters()]
        opts.append(opt_cls([{"params": first, "lr": 0.02}, {"params": rest}], lr=0.05))
    ov = ght.ddp_forward_overlap(models[0], opts[0])
    return ov, models[0], opts[0], models[1], opts[1]


def same(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(x, y, rtol=1e-6, atol=1e-7), (name, (x - y).abs().max())


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.AdamW])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_step_for_step_as_plain_ddp_with_groups_and_a_scheduler(group, opt_cls, set_to_none):
    ov, m, o, ref, ro = pair(opt_cls, gradient_as_bucket_view=True)
    scheds = [torch.optim.lr_scheduler.LambdaLR(x, lambda s: 0.9 ** s) for x in (o, ro)]
    for step in range(8):
        x, y = data(step)
        for model, opt, sched in ((m, o, scheds[0]), (ref, ro, scheds[1])):
            opt.zero_grad(set_to_none=set_to_none)
            F.mse_loss(model(x), y).backward()
            opt.step()
            sched.step()
        if step >= 3:
            # The step before's updates wait for the next forward pass: not applied yet.
            assert ov._pending and not torch.equal(m.module[4].weight, ref.module[4].weight)
    ov.finish()
    same(m, ref)
    assert ov.overlapped == 8 - 2


def test_a_closure_steps_synchronously(group):
    ov, m, o, ref, ro = pair(torch.optim.SGD)
    for step in range(5):
        x, y = data(step)
        for model, opt in ((m, o), (ref, ro)):
            def closure(model=model, opt=opt):
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                return loss
            assert torch.isfinite(opt.step(closure))
        assert not ov._pending
        same(m, ref)


def test_checkpoints_save_and_load_applied_updates(group):
    ov, m, o, ref, ro = pair(torch.optim.SGD, gradient_as_bucket_view=True)
    for step in range(4):
        x, y = data(step)
        for model, opt in ((m, o), (ref, ro)):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    assert ov._pending
    saved = m.module.state_dict()   # applies what is pending first
    assert not ov._pending
    for k, v in ref.module.state_dict().items():
        assert torch.allclose(saved[k], v), k
    x, y = data(9)
    o.zero_grad()
    F.mse_loss(m(x), y).backward()
    o.step()
    assert ov._pending
    o.load_state_dict(ro.state_dict())   # a pending update must not land on the loaded state
    assert not ov._pending


def test_bucket_parts_are_whole_parameters_at_least_the_share_and_the_minimum():
    from gradhub.torch.ddp_overlap import bucket_parts
    sizes = [400, 100, 100, 300, 50, 50, 1000, 8]
    runs = bucket_parts(sizes, 4, 1)
    # Contiguous, covering every parameter once, at most 4, each (but the last) >= the share (502).
    assert [i for a, b in runs for i in range(a, b)] == list(range(len(sizes)))
    assert runs == [(0, 3), (3, 7), (7, 8)]
    assert all(sum(sizes[a:b]) >= 502 for a, b in runs[:-1])
    assert bucket_parts(sizes, 8, 10_000) == [(0, 8)]              # under the minimum: one part
    assert bucket_parts(sizes, 1, 1) == [(0, 8)]
    assert bucket_parts([4] * 10, 64, 1) == [(i, i + 1) for i in range(10)]
    assert bucket_parts([], 4, 1) == []


def test_refusals(group):
    m = nn.parallel.DistributedDataParallel(make())
    with pytest.raises(TypeError, match="must be a DistributedDataParallel"):
        ght.ddp_forward_overlap(make(), torch.optim.SGD(m.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="RMSprop is not supported"):
        ght.ddp_forward_overlap(m, torch.optim.RMSprop(m.parameters()))
    with pytest.raises(ValueError, match="parts must be in 1..64"):
        ght.ddp_forward_overlap(m, torch.optim.SGD(m.parameters(), lr=0.1), parts=0)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(o, 1)
    with pytest.raises(TypeError, match="make the scheduler after"):
        ght.ddp_forward_overlap(m, o)


class Branchy(nn.Module):
    """A layer used only on odd steps: DDP with find_unused_parameters."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 2)
        self.odd = False

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.odd:
            h = torch.tanh(self.b(h))
        return self.c(h)


@pytest.mark.parametrize("as_view", [True, False])
def test_unused_parameters_step_as_plain_ddp(group, as_view):
    models = [nn.parallel.DistributedDataParallel(Branchy(), find_unused_parameters=True, bucket_cap_mb=0.0001,
                                                  gradient_as_bucket_view=as_view) for _ in range(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    ov = ght.ddp_forward_overlap(models[0], opts[0])
    for step in range(8):
        x, y = data(step)
        for model, opt in zip(models, opts):
            model.module.odd = step % 2 == 1
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    ov.finish()
    same(*models)
    assert ov.overlapped >= 8 - 2
