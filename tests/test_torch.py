"""gradhub.torch: training equivalence, the Horovod-compatible API, the DDP hook, user errors."""

import json
import re

import pytest

from conftest import assert_all_passed, free_port, run_launch


# Every pair of model, optimizer and sync mode once (the optimizer is torch's
# own arithmetic on the synced gradients: the full cube repeated the paths).
@pytest.mark.parametrize("model,opt,overlap", [("mlp", "sgd", False), ("mlp", "nesterov", True),
                                               ("cnn", "sgd", True), ("cnn", "nesterov", False)],
                         ids=["mlp-sgd-sync", "mlp-nesterov-overlap", "cnn-sgd-overlap", "cnn-nesterov-sync"])
def test_training_matches_single_process(model, opt, overlap):
    # 4 workers on 4 disjoint shards == one process on the combined batch, within 1e-5 relative.
    # A StepLR schedule also checks that per-parameter updates (overlap, the eager update) follow LR changes.
    cfg = {"model": model, "opt": opt, "overlap": overlap, "steps": 20, "sched": True}
    if not overlap:
        cfg["eager"] = True  # the default: each parameter updated as its gradient comes in
    rc, out = run_launch(4, 2, "torch_train.py", cfg, threads=1)
    assert_all_passed(rc, out, 4)


def test_eager_update_follows_the_state_load_state_dict_puts_in_place():
    # A checkpoint (or an elastic rollback) loaded mid-run replaces the optimizer's state: the eager
    # update's per-parameter updates use the loaded momentum from then on, as one update would.
    cfg = {"model": "cnn", "opt": "nesterov", "steps": 10, "reload_at": 4, "eager": True}
    rc, out = run_launch(2, 1, "torch_train.py", cfg, threads=1)
    assert_all_passed(rc, out, 2)


@pytest.mark.parametrize("opt", ["nesterov", "adamw"])
def test_training_with_one_update_after_every_gradient_matches_single_process(opt):
    # GRADHUB_EAGER_UPDATE=0: step() waits for every gradient, then one update (with a StepLR schedule);
    # and the largest tensors first (GRADHUB_SCHEDULING=size), the worker checks the priorities.
    cfg = {"model": "cnn", "opt": opt, "steps": 12, "sched": True, "eager": False}
    rc, out = run_launch(3, 2, "torch_train.py", cfg, threads=1,
                         env={"GRADHUB_EAGER_UPDATE": "0", "GRADHUB_SCHEDULING": "size"})
    assert_all_passed(rc, out, 3)


# Each fusion setting in both sync modes, and with SGD (1 pass) and AdamW with
# backward_passes_per_step 2 (each sync mode with both too): every pair once.
@pytest.mark.parametrize("fusion,buckets,tensors,overlap,opt,passes", [
    (0, 0, 0, False, "adamw", 2), (0, 0, 0, True, "sgd", 1),
    (262144, 1, 26, False, "sgd", 1), (262144, 1, 26, True, "adamw", 2),
    (1024, 2, 19, False, "adamw", 2), (1024, 2, 19, True, "sgd", 1)],
    ids=["off-sync", "off-overlap", "default-sync", "default-overlap", "small-buckets-sync", "small-buckets-overlap"])
def test_tensor_fusion_trains_like_a_single_process(fusion, buckets, tensors, overlap, opt, passes):
    # 6 Linear + LayerNorm blocks and a head (26 tensors, all small): by default one
    # bucket carries all of them; with 1 KiB buckets only the 19 tensors of at
    # most 256 bytes (biases, norms) travel packed, in 2 buckets. Parameters
    # equal single-process training either way, with SGD and AdamW, and
    # backward_passes_per_step (each bucket goes once its members' last pass is in).
    cfg = {"model": "deep", "opt": opt, "overlap": overlap, "steps": 10, "sfb": "off", "fusion": fusion,
           "passes": passes}
    rc, out = run_launch(3, 2, "torch_train.py", cfg, threads=1)
    assert_all_passed(rc, out, 3)
    assert out.count(f"FUSED {buckets} buckets of {tensors} tensors") == 3, out[-3000:]
    if overlap:
        # A module's weight and bias in one optimizer call before its forward; the
        # last step's 26 in one at finish().
        assert out.count("UPDATES IN GROUPS OF [2, 26]") == 3, out[-3000:]


@pytest.mark.parametrize("model,opt,overlap,fusion,passes", [("cnn", "nesterov", False, 0, 1),
                                                          ("deep", "adamw", True, 262144, 2)],
                         ids=["cnn-unfused-sync", "deep-fused-overlap"])
def test_training_through_the_torch_local_stage_matches_single_process(cluster_factory, model, opt, overlap,
                                                                       fusion, passes):
    # GRADHUB_LOCAL_STAGE=torch on CPU (gloo), on two emulated hosts (2 + 1
    # workers: shares staged and summed through the servers): per-tensor
    # reductions with priorities, then fusion buckets with forward overlap
    # and backward_passes_per_step, equal single-process training as through
    # the shared-memory stage.
    cfg = {"model": model, "opt": opt, "overlap": overlap, "steps": 10, "sfb": "off", "fusion": fusion,
           "passes": passes}
    c = cluster_factory(3, 2, GRADHUB_LOCAL_STAGE="torch")
    for w in range(3):
        c.start_worker(w, "torch_train.py", cfg, GRADHUB_HOST_ID=f"train-{w // 2}")
    for w in range(3):
        assert c.procs[f"worker{w}"].wait(timeout=180) == 0, c.log(f"worker{w}")
        log = c.log(f"worker{w}")
        assert f"PASS {w}" in log, log
        if fusion:
            assert "FUSED 1 buckets of 26 tensors" in log, log


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_overlap_with_parameters_used_outside_their_modules_forward(opt):
    # Tied weights, functional calls and a custom autograd function on
    # parameters of modules that are never called: each update is applied at
    # the parameter's first use, so training equals single-process training.
    cfg = {"model": "outside", "opt": opt, "overlap": True, "steps": 12}
    rc, out = run_launch(2, 1, "torch_train.py", cfg)
    assert_all_passed(rc, out, 2)


def test_overlap_with_custom_autograd_functions_on_parameters_of_modules_never_called():
    # The parent's forward() applies custom autograd functions (computing out
    # of sight of torch function modes) to its children's parameters: found in
    # autograd's graph, and updated before the parent's forward.
    cfg = {"model": "funcs", "opt": "sgd", "overlap": True, "steps": 12}
    rc, out = run_launch(2, 1, "torch_train.py", cfg)
    assert_all_passed(rc, out, 2)


@pytest.mark.parametrize("model,opt,sfb,overlap,passes,double", [
    ("fc", "sgd", "force", True, 1, False), ("fc", "adamw", "force", False, 2, False),
    ("fc-nobias", "sgd", "force", False, 2, False),
    ("mlp", "sgd", "auto", False, 1, False), ("mlp", "sgd", "auto", False, 1, True),
    ("cnn", "sgd", "force", False, 1, False)])
def test_sufficient_factors_train_like_a_single_process(model, opt, sfb, overlap, passes, double):
    # 4 workers; weights exchanged as factors (rebuilt on every worker) give
    # the single-process parameters. fc: 3-D input, a layer called twice, a
    # frozen one, and a tied one that must fall back to the servers (said once).
    # double: a float64 model's factors stay float64 (to 1e-12, not float32's ~1e-8).
    # fc-nobias: the first layer has no bias, so its weight's own gradient is
    # computed by autograd (the input needs none) and replaced by the factors'.
    cfg = {"model": model.removesuffix("-nobias"), "opt": opt, "sfb": sfb, "overlap": overlap, "passes": passes,
           "steps": 10, "fc1_bias": not model.endswith("-nobias")}
    if double:
        cfg.update(double=True, param_tol=1e-12, loss_tol=1e-12)
    if model.startswith("fc"):
        cfg["sfb_layers"] = ["fc1.weight", "shared.weight", "out.weight"]
    elif model == "mlp":
        # auto, 2 rows a worker: 8 x (64 + 20) < 64 x 20 and 8 x (32 + 64) < 32 x 64 go as factors,
        # 8 x (5 + 32) > 5 x 32 through the servers.
        cfg.update(batch=2, sfb_layers=["0.weight", "2.weight"])
    else:
        cfg["sfb_layers"] = ["6.weight", "8.weight"]
    rc, out = run_launch(4, 2, "torch_train.py", cfg, env={"GRADHUB_LOG": "debug"})  # each layer's choice
    assert_all_passed(rc, out, 4)
    assert "goes back to the servers" not in out
    if model.startswith("fc"):
        assert out.count("'tied.weight' goes through the servers") == 4, out[-3000:]
        assert f"sufficient factors: 'fc1.weight' (48 x 10, {64 * passes} rows over the workers): factors (forced)" in out
        assert out.count("sufficient factors (forced): fc1.weight") == 1, out[-3000:]  # said once, in words


def test_sufficient_factors_under_bfloat16_autocast():
    # The layers multiply bfloat16 inputs: their factors are taken in
    # bfloat16 too, the exactness check allows for autograd's 16-bit sums,
    # and the tied layer still falls back. Loss curve as single-process
    # training under the same autocast.
    cfg = {"model": "fc", "opt": "adamw", "sfb": "force", "autocast": True, "steps": 10, "loss_tol": 0.01,
           "sfb_layers": ["fc1.weight", "shared.weight", "out.weight"]}
    rc, out = run_launch(4, 2, "torch_train.py", cfg)
    assert_all_passed(rc, out, 4)
    assert out.count("'tied.weight' goes through the servers") == 4, out[-3000:]


def test_sufficient_factors_go_back_to_the_servers_when_the_batch_grows():
    # auto at 2 rows a worker takes factors for two layers; from step 4 on
    # the batch is 8 times larger, which makes both cost more than their
    # gradients: they go back to the servers, every worker at once, and
    # training still equals single-process training.
    cfg = {"model": "mlp", "opt": "sgd", "sfb": "auto", "batch": 2, "grow": 8, "grow_at": 4, "steps": 8,
           "sfb_layers": []}
    rc, out = run_launch(4, 2, "torch_train.py", cfg, env={"GRADHUB_LOG": "debug"})  # each layer's choice
    assert_all_passed(rc, out, 4)
    assert out.count("8 rows over the workers): factors;") == 2, out[-3000:]
    for layer in ("0.weight", "2.weight"):
        assert f"'{layer}' goes back to the servers: 64 rows" in out, out[-3000:]


def test_sufficient_factors_slots_grow_with_the_batch():
    # Forced factors, 2 rows a worker, then 3 times more from step 4: each
    # worker's rows overflow their slot once, that step is gathered in full
    # (every worker alike), the slots grow, and training still equals
    # single-process training.
    cfg = {"model": "mlp", "opt": "sgd", "sfb": "force", "batch": 2, "grow": 3, "grow_at": 4, "steps": 7,
           "sfb_layers": ["0.weight", "2.weight", "4.weight"]}
    rc, out = run_launch(4, 2, "torch_train.py", cfg, env={"GRADHUB_LOG": "debug"})
    assert_all_passed(rc, out, 4)
    for layer in ("0.weight", "2.weight", "4.weight"):
        assert out.count(f"'{layer}' gathered in full this step; its slots grow from 2 to 6 rows") == 1, out[-3000:]


def test_sufficient_factors_come_back_when_the_batch_shrinks():
    # auto at 8 rows a worker keeps every layer on the servers; from step 3
    # on the batch is 4 times smaller, so at the recheck after step 10 two
    # layers take factors, every worker at once, and training still equals
    # single-process training.
    cfg = {"model": "mlp", "opt": "sgd", "sfb": "auto", "batch": 8, "grow": 0.25, "grow_at": 3, "steps": 14,
           "sfb_layers": ["0.weight", "2.weight"]}
    rc, out = run_launch(4, 2, "torch_train.py", cfg, env={"GRADHUB_LOG": "debug"})  # each layer's choice
    assert_all_passed(rc, out, 4)
    assert out.count("32 rows over the workers): servers;") == 3, out[-3000:]
    for layer in ("0.weight", "2.weight"):
        assert f"'{layer}' takes factors again: 8 rows" in out, out[-3000:]
    assert "'4.weight' takes factors again" not in out


def test_overlap_with_parameter_list_containers():
    # ParameterList/ParameterDict never run forward: their parameters are
    # updated when the owning module runs.
    rc, out = run_launch(2, 1, "torch_train.py", {"model": "plist", "opt": "sgd", "overlap": True, "steps": 10})
    assert_all_passed(rc, out, 2)


@pytest.mark.parametrize("model,overlap", [("mlp", False), ("cnn", True)])
def test_adamw_loss_curve_and_identical_workers(model, overlap):
    cfg = {"model": model, "opt": "adamw", "overlap": overlap, "steps": 20, "loss_tol": 0.01}
    rc, out = run_launch(4, 2, "torch_train.py", cfg)
    assert_all_passed(rc, out, 4)


@pytest.mark.parametrize("model,opt,overlap", [("mlp", "sgd", False), ("cnn", "nesterov", True)])
def test_optimizer_on_server_matches_single_process(model, opt, overlap):
    # The servers run the SGD update fused per chunk and return parameters;
    # a StepLR schedule changes the learning rate on the servers mid-run.
    cfg = {"model": model, "opt": opt, "overlap": overlap, "server": True, "steps": 20, "sched": True}
    rc, out = run_launch(4, 2, "torch_train.py", cfg, threads=2)
    assert_all_passed(rc, out, 4)


def test_adamw_on_server():
    cfg = {"model": "mlp", "opt": "adamw", "server": True, "steps": 20, "loss_tol": 0.01, "sched": True}
    rc, out = run_launch(4, 2, "torch_train.py", cfg, launch_args=["--colocated-servers", "1"])
    assert_all_passed(rc, out, 4)


def test_backward_passes_per_step_accumulates_locally():
    cfg = {"model": "mlp", "opt": "sgd", "passes": 3, "steps": 10}
    rc, out = run_launch(2, 1, "torch_train.py", cfg)
    assert_all_passed(rc, out, 2)


def test_fp16_compression_trains_close():
    cfg = {"model": "mlp", "opt": "adamw", "compression": "fp16", "steps": 20, "loss_tol": 0.02}
    rc, out = run_launch(3, 2, "torch_train.py", cfg)
    assert_all_passed(rc, out, 3)


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_api_functions(workers):
    rc, out = run_launch(workers, 2, "torch_api.py", threads=2)
    assert_all_passed(rc, out, workers)


@pytest.mark.parametrize("workers,overlap", [(1, False), (2, False), (3, False), (3, True)])
def test_parameters_without_a_gradient_on_some_workers_do_not_hang_the_step(workers, overlap):
    # With overlap the heads' weights and biases share a fusion bucket that
    # step() pushes with zeros for the head a worker did not use.
    rc, out = run_launch(workers, 1, "torch_unused.py", {"overlap": overlap}, timeout=120)
    assert_all_passed(rc, out, workers)


def test_gradient_predivide_factor_trains_like_plain_averaging():
    cfg = {"model": "mlp", "opt": "sgd", "steps": 10, "predivide": 4.0}
    rc, out = run_launch(3, 2, "torch_train.py", cfg)
    assert_all_passed(rc, out, 3)


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "sparse_as_dense"])
def test_sparse_gradients_train_like_one_process(dense):
    cfg = {"model": "embed", "opt": "sgd0", "steps": 10, "sparse_as_dense": dense}
    rc, out = run_launch(2, 1, "torch_train.py", cfg)
    assert_all_passed(rc, out, 2)


@pytest.mark.parametrize("workers", [2, 3])
def test_horovod_names_beyond_allreduce(workers, tmp_path):
    rc, out = run_launch(workers, 2, "torch_horovod_names.py", env={"GH_TIMELINE_DIR": str(tmp_path)})
    assert_all_passed(rc, out, workers)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_join_with_uneven_data_matches_training_with_zeros_from_joined_workers(workers):
    rc, out = run_launch(workers, 2, "torch_join.py")
    assert_all_passed(rc, out, workers)


def test_join_with_sufficient_factors():
    # The optimizer's gradients take part in join with zeros, also those
    # exchanged as factors: a joined worker's slot says no rows.
    rc, out = run_launch(3, 2, "torch_join.py", env={"GRADHUB_SFB": "force"})
    assert_all_passed(rc, out, 3)
    assert "sufficient factors (forced): 0.weight, 2.weight" in out, out[-3000:]


def test_join_without_the_host_stage():
    rc, out = run_launch(3, 1, "torch_join.py", env={"GRADHUB_HOST_REDUCE": "0"})
    assert_all_passed(rc, out, 3)


@pytest.mark.parametrize("workers,host_stage", [(2, "1"), (4, "1"), (3, "0")])
def test_process_sets_reduce_over_their_members_alone(workers, host_stage):
    rc, out = run_launch(workers, 2, "torch_process_sets.py", env={"GRADHUB_HOST_REDUCE": host_stage})
    assert_all_passed(rc, out, workers)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_exchange_collectives_reducescatter_alltoall_grouped_sparse(workers):
    rc, out = run_launch(workers, 2, "torch_exchange.py")
    assert_all_passed(rc, out, workers)


@pytest.mark.parametrize("hosts", [["a", "a", "b", "b"], ["a", "a", "a", "b"]], ids=["2+2", "3+1"])
def test_cross_rank_and_size_follow_the_hosts(cluster_factory, hosts, tmp_path):
    c = cluster_factory(len(hosts), 1)
    for w, h in enumerate(hosts):
        c.start_worker(w, "torch_horovod_names.py", {"hosts": hosts}, GRADHUB_HOST_ID=f"cross-{h}",
                       GH_TIMELINE_DIR=str(tmp_path))
    for w in range(len(hosts)):
        assert c.procs[f"worker{w}"].wait(timeout=120) == 0, c.log(f"worker{w}")
        assert f"PASS {w}" in c.log(f"worker{w}")


@pytest.mark.parametrize("stage", ["auto", "torch"])
def test_ddp_comm_hook_matches_gloo_allreduce(stage):
    rc, out = run_launch(3, 2, "torch_ddp.py", {"port": free_port()}, env={"GRADHUB_LOCAL_STAGE": stage})
    assert_all_passed(rc, out, 3)


def test_user_errors_have_helpful_messages():
    rc, out = run_launch(2, 1, "torch_errors.py")
    assert_all_passed(rc, out, 2)


def test_fusion_buckets_pack_unpack_and_answer_a_late_member_from_its_own_step():
    # The bucket logic alone, against a stand-in optimizer whose "reduction" doubles the bucket.
    import torch

    from gradhub.torch.fusion import Fusion

    class Op:
        def __init__(self, buf):
            self.buf, self.waited = buf, False

        def done(self):
            return self.waited

        def wait(self, timeout=None):
            if not self.waited:
                self.buf.mul_(2)
                self.waited = True

    class Ps:
        def _name(self, name, _):
            return name

    class Mode:  # the synchronous schedule: checks no gradient
        checks_gradients = False

    class Opt:
        _gh_ps, _gh_mode = Ps(), Mode()
        _gh_passes, _gh_sparse_as_dense, _gh_prio = 1, False, {}

        def __init__(self, params):
            self._gh_params = params
            self._gh_names = {id(p): f"p{i}" for i, p in enumerate(params)}
            self._gh_handles, self._gh_sparse, self.pushed = {}, [], []

        def _gh_tag(self):
            return ""

        def _gh_priority(self, p):
            return next(i for i, q in enumerate(self._gh_params) if q is p)

        def _gh_reduce(self, buf, name, priority):
            self.pushed.append((name, priority, buf.clone()))
            return Op(buf)

    a, b = torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(4))
    big = torch.nn.Parameter(torch.zeros(10_000))
    opt = Opt([a, b, big])
    f = Fusion(opt, 1024)  # tensors of at most 256 bytes: a and b, not big
    assert len(f.buckets) == 1 and set(f.of) == {id(a), id(b)} and f.declarations() == [("allreduce.fusion.p1",
                                                                                          (10, "float32"))]
    hook_a, hook_b = f.hook(a), f.hook(b)
    a.grad, b.grad = torch.arange(6.0).view(2, 3), torch.ones(4)
    ga, gb = a.grad, b.grad
    hook_a(a)
    assert opt.pushed == [] and opt._gh_handles == {}
    hook_b(b)
    # Packed in reverse registration order, pushed once at the members' highest priority,
    # one operation the handle of both.
    name, prio, packed = opt.pushed[0]
    assert (name, prio) == ("allreduce.fusion.p1", 1) and packed.tolist() == [1, 1, 1, 1, 0, 1, 2, 3, 4, 5]
    h1 = opt._gh_handles[id(a)]
    assert opt._gh_handles == {id(a): h1, id(b): h1} and not h1.done()
    with pytest.raises(RuntimeError, match="computed twice"):
        hook_a(a)
    opt._gh_handles.pop(id(a)).wait()
    assert ga.tolist() == [[0, 2, 4], [6, 8, 10]] and gb.tolist() == [2, 2, 2, 2] and h1.done()
    # Next step: a's new gradient arrives while b's update of the last step is still to be applied.
    a.grad = torch.ones(2, 3)
    hook_a(a)
    opt._gh_handles.pop(id(b)).wait()
    assert gb.tolist() == [2, 2, 2, 2]  # its own step's, unpacked once
    # b has no gradient this step: synchronize() fills it with zeros, which completes the bucket.
    b.grad = torch.zeros(4)
    f.fill(b)
    assert len(opt.pushed) == 2 and opt.pushed[1][2].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 1, 1]
    h2 = opt._gh_handles[id(a)]
    assert h2 is not h1
    h2.wait()
    assert a.grad.tolist() == [[2, 2, 2], [2, 2, 2]] and b.grad.tolist() == [0, 0, 0, 0]


def test_autotune_trains_like_a_single_process_saves_and_reloads_its_choice(tmp_path):
    # 3 workers tune overlap (allowed: auto), fusion and chunk size (the job's 1 KiB, 512, 256:
    # the model's 20x20 weights take 2, 4 and 7 chunks) while training; the
    # credit is set by the user, so it stays. Every switch happens between
    # steps, so the parameters still equal single-process training, and the
    # tensors of every layout not chosen are released.
    choice, log = tmp_path / "autotune.json", tmp_path / "trials.csv"
    env = {"GRADHUB_AUTOTUNE": "1", "GRADHUB_AUTOTUNE_WARMUP_STEPS": "1", "GRADHUB_AUTOTUNE_STEPS_PER_TRIAL": "1",
           "GRADHUB_AUTOTUNE_LOG": str(log), "GRADHUB_AUTOTUNE_FILE": str(choice),
           "GRADHUB_CREDIT_BYTES": str(256 << 10), "GRADHUB_OVERLAP_FORWARD": "auto"}
    cfg = {"model": "deep", "opt": "sgd", "steps": 24, "sfb": "off", "autotune": True}
    args = ["--partition-bytes", "1024"]
    rc, out = run_launch(3, 2, "torch_train.py", cfg, launch_args=args, env=env)
    assert_all_passed(rc, out, 3)
    assert "7 trials of 1 steps after 1 warm-up steps" in out and "fixed: credit_bytes" in out, out[-4000:]
    for k in range(1, 8):
        assert f"autotune: trial {k}: " in out, out[-4000:]
    assert "autotune: trial 8" not in out and "autotune: chose " in out, out[-4000:]
    rows = log.read_text().splitlines()
    assert rows[0].split(",") == ["trial", "overlap_forward", "fusion_threshold", "partition_bytes", "credit_bytes",
                                  "step_seconds", "best"]
    tried = [r.split(",") for r in rows[1:]]
    assert len(tried) == 7 and {t[4] for t in tried} == {str(256 << 10)}, rows
    assert {t[1] for t in tried} == {"False", "True"} and {t[3] for t in tried} == {"1024", "512", "256"}, rows
    assert {t[2] for t in tried} == {"0", str(64 << 10), str(256 << 10), str(1 << 20)}, rows
    saved = json.loads(choice.read_text())
    assert saved["job"] == {"workers": 3, "tensors": 26, "bytes": 11460}, saved
    held = set(re.findall(r"HELD (\d+) beyond", out))
    assert len(held) == 1 and out.count("tuner done") == 3, out[-4000:]
    # The next start loads the choice and runs no trial.
    rc, out = run_launch(3, 2, "torch_train.py", cfg, launch_args=args, env=env)
    assert_all_passed(rc, out, 3)
    s = saved["settings"]
    assert f"autotune: loaded overlap_forward={'on' if s['overlap_forward'] else 'off'}" in out, out[-4000:]
    assert "autotune: trial" not in out, out[-4000:]
    # As many tensors held beyond the layout as after tuning: nothing of the other layouts is left.
    assert set(re.findall(r"HELD (\d+) beyond", out)) == held, out[-4000:]


def _tune(monkeypatch, start, tunable: set, step_time, applied: list):
    """Run an Autotuner (of a fake worker 1 of 2) to its end on a made-up
    clock, a step of settings s taking step_time(s); the settings it applies
    are appended to `applied`."""
    from gradhub.torch import autotune

    class Opt:
        class _gh_ps:
            rank, size = staticmethod(lambda: 1), staticmethod(lambda: 2)

    clock = [0.0]
    monkeypatch.setattr(autotune, "apply", lambda opt, s: applied.append(s))
    monkeypatch.setattr(autotune.Autotuner, "_slowest", lambda self, t: t)
    monkeypatch.setattr(autotune._api, "release", lambda *names: None)
    monkeypatch.setattr(autotune.time, "perf_counter", lambda: clock[0])
    t = autotune.Autotuner(Opt(), start, tunable, 1 << 20, warmup=2, steps=3, log=None, file=None)
    for _ in range(200):
        if t.done:
            break
        clock[0] += step_time(t.current)
        t.after_step()
    assert t.done
    return t


def test_autotune_keeps_the_start_unless_a_trial_is_faster_and_walks_one_knob_at_a_time(monkeypatch):
    # The tuner's decisions with made-up step times: a trial replaces the
    # best only when at least 2 % faster, each knob is tried at the best of
    # the knobs before it, and the best is applied at the end.
    from gradhub.torch import autotune

    cost = {}

    def step_time(s):
        return cost.get(("fusion_threshold", s.fusion_threshold), 0) + cost.get(("credit_bytes", s.credit_bytes), 0) \
            + cost.get(("overlap_forward", s.overlap_forward), 0) + 1.0

    start = autotune.Settings(False, 256 << 10, 1 << 20, 512 << 10)
    applied = []

    def run(costs, tunable):
        cost.clear()
        cost.update(costs)
        applied.clear()
        return _tune(monkeypatch, start, tunable, step_time, applied)

    # Nothing measurably faster (1.5 % is noise): the start stays, and is
    # applied again after the last trial.
    t = run({("fusion_threshold", 64 << 10): -0.015, ("credit_bytes", 2 << 20): -0.01},
            {"fusion_threshold", "credit_bytes"})
    assert t.best == start and len(t.trials) == 1 + 3 + 3 and applied[-1] == start, (t.best, applied)
    # Fusion off is 10 % faster, then a 2 MiB credit 5 % more: both kept, the
    # credit tried with fusion off; the last trial (4x credit, slower) is
    # followed by applying the best.
    t = run({("fusion_threshold", 0): -0.1, ("credit_bytes", 1 << 20): -0.05, ("credit_bytes", 2 << 20): 0.3},
            {"fusion_threshold", "credit_bytes", "overlap_forward"})
    want = autotune.Settings(False, 0, 1 << 20, 1 << 20)
    assert t.best == want and applied[-1] == want, (t.best, applied)
    credit_trials = [tr["settings"] for tr in t.trials if tr["settings"].credit_bytes != start.credit_bytes]
    assert credit_trials and all(s.fusion_threshold == 0 for s in credit_trials), credit_trials
    assert [tr["settings"] for tr in t.trials][:2] == [start, autotune.Settings(True, 256 << 10, 1 << 20, 512 << 10)]


def test_autotune_tries_forward_overlap_only_when_the_user_allowed_it(monkeypatch):
    # Forward overlap changes what training does (parameters updated at the
    # next forward): autotune tries it only with overlap_forward="auto" (or
    # GRADHUB_OVERLAP_FORWARD=auto), never when it is left unset.
    from gradhub import _env
    from gradhub.torch import autotune

    here = dict(elementwise=True, on_server=False, plain=True, declared_ahead=True)
    others = {"fusion_threshold", "partition_bytes", "credit_bytes"}
    assert autotune.tunable(set(), overlap_auto=False, **here) == others
    assert autotune.tunable(set(), overlap_auto=True, **here) == set(autotune.KNOBS)
    # Allowed, but not where it does not apply; the knobs the user set stay.
    assert autotune.tunable(set(), overlap_auto=True, **dict(here, elementwise=False)) == others
    assert autotune.tunable(set(), overlap_auto=True, **dict(here, on_server=True)) == {"credit_bytes"}
    assert autotune.tunable({"credit_bytes"}, overlap_auto=True, **dict(here, plain=False, declared_ahead=False)) \
        == {"overlap_forward"}
    # The environment: unset or a flag is not "auto"; "auto" is not a fixed knob.
    for var in ("GRADHUB_OVERLAP_FORWARD", "GRADHUB_FUSION_THRESHOLD", "GRADHUB_CREDIT_BYTES"):
        monkeypatch.delenv(var, raising=False)
    assert _env.torch_options().overlap_forward is False
    monkeypatch.setenv("GRADHUB_OVERLAP_FORWARD", "1")
    assert _env.torch_options().overlap_forward is True
    monkeypatch.setenv("GRADHUB_OVERLAP_FORWARD", "Auto")
    assert _env.torch_options().overlap_forward == "auto" and _env.autotune_options().fixed == frozenset()

    # A tuner of the other knobs never switches overlap on, however much faster it would be.
    applied = []
    t = _tune(monkeypatch, autotune.Settings(False, 256 << 10, 1 << 20, 512 << 10),
              autotune.tunable(set(), overlap_auto=False, **here), lambda s: 0.1 if s.overlap_forward else 1.0, applied)
    assert t.trials and all(not tr["settings"].overlap_forward for tr in t.trials) and applied, t.trials
    assert all(not s.overlap_forward for s in applied) and not t.best.overlap_forward


def test_autotune_file_from_another_job_or_unreadable_is_tuned_again(tmp_path, capsys):
    # A saved choice is used only for the same workers and parameters, in
    # range for this job; anything else says why and tunes again.
    from gradhub.torch import autotune

    job = {"workers": 2, "tensors": 3, "bytes": 1200}
    path = tmp_path / "choice.json"
    s = autotune.Settings(True, 64 << 10, 128 << 10, 1 << 20)
    autotune.save(str(path), job, s, 0.1, 0.2)
    assert autotune.load(str(path), job, 256 << 10) == s
    assert autotune.load(str(tmp_path / "none.json"), job, 256 << 10) is None
    assert autotune.load(str(path), dict(job, workers=4), 256 << 10) is None
    assert "tuned for" in capsys.readouterr().err
    assert autotune.load(str(path), job, 64 << 10) is None  # chunks larger than this job's partition
    assert "out of range" in capsys.readouterr().err
    path.write_text("{not json")
    assert autotune.load(str(path), job, 256 << 10) is None
    assert "cannot use" in capsys.readouterr().err


def test_eager_update_waits_for_each_operation_as_it_finishes():
    # The synchronous schedule's eager update alone (optimizer._wait_each),
    # against stand-in handles finished by another thread in a set order:
    # `each` gets the parameters of every operation as it finishes (a
    # fusion bucket's all at once), before the later ones are done; a
    # failed operation raises from its wait().
    import threading
    import time

    from gradhub.torch.optimizer import _wait_each

    class Op:
        def __init__(self, fail=False):
            self.fail, self.finished, self.waited, self.cbs = fail, False, 0, []
            self.lock = threading.Lock()

        def add_done_callback(self, fn):
            with self.lock:
                if not self.finished:
                    self.cbs.append(fn)
                    return
            fn(self)

        def done(self):
            return self.finished

        def finish(self):
            with self.lock:
                self.finished = True
                cbs, self.cbs = self.cbs, []
            for fn in cbs:
                fn(self)

        def wait(self, timeout=None):
            assert self.finished, "waited before it finished"
            self.waited += 1
            if self.fail:
                raise RuntimeError("push_pull failed")

    a, bucket, c = Op(), Op(), Op()
    a.finish()  # done before the step
    handles = {1: a, 2: bucket, 3: bucket, 4: c}
    calls = []

    def each(pids):  # each operation finishes only after the call for the one before
        calls.append((sorted(pids), c.finished))
        nxt = c if bucket.finished else bucket
        if not nxt.finished:
            threading.Timer(0.02, nxt.finish).start()

    t0 = time.monotonic()
    _wait_each(handles, each)
    assert time.monotonic() - t0 < 5
    assert calls == [([1], False), ([2, 3], False), ([4], True)]
    assert (a.waited, bucket.waited, c.waited) == (1, 1, 1)

    bad, late = Op(fail=True), Op()
    threading.Timer(0.05, bad.finish).start()
    with pytest.raises(RuntimeError, match="push_pull failed"):
        _wait_each({1: bad, 2: late}, calls.append)

    # Operations whose wait() may run a collective (`ordered`) are waited in
    # the order given, the same on every worker, whatever order they finish in.
    first, plain, second = Op(), Op(), Op()
    first.ordered = second.ordered = True
    second.finish()
    plain.finish()
    got = []

    def each2(pids):
        got.append(sorted(pids))
        if not first.finished:
            threading.Timer(0.02, first.finish).start()

    _wait_each({1: first, 2: plain, 3: second}, each2)
    assert got == [[2], [1, 3]] and second.waited == 1
