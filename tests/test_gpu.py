"""CUDA only: gradhub.torch.cuda_copies (side stream, events, pinned
buffers reused) and the torch local stage on NCCL, one worker per GPU.
Skipped, with the reason, where CUDA is absent; `gradhub bench gpu` is the
fuller check to run on a GPU machine."""

import pytest

torch = pytest.importorskip("torch")

from conftest import assert_all_passed, run_launch  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device: gradhub.torch.cuda_copies and the NCCL local stage run only under CUDA "
           "(run `gradhub bench gpu` on a GPU machine)")

DTYPES = ["float32", "float16", "bfloat16", "float64", "int32", "int64", "uint8"]


def test_cuda_copies_copy_a_share_out_and_back_through_one_reused_pinned_buffer():
    from gradhub.torch import copies
    from gradhub.torch.cuda_copies import CudaCopies

    st = CudaCopies()
    n, start = 10_001, 2_500
    host = st.buffers.get("t", n, torch.float32)
    assert host.is_pinned() and st.buffers.get("t", n, torch.float32) is host
    share = torch.arange(3_000, dtype=torch.float32, device="cuda") + 1
    host.fill_(7)  # the last round's result: zeroed outside the share
    d2h, h2d = copies.counters.snapshot()
    st.to_host(share, host, start)
    assert torch.equal(host[start:start + 3_000], share.cpu())
    assert not host[:start].any() and not host[start + 3_000:].any()
    host[start:start + 3_000].mul_(2)  # what the core would write back
    back = torch.empty_like(share)
    st.from_host(host, start, back)
    st.wait(st.record(back))
    assert torch.equal(back, share * 2)
    nbytes = share.numel() * share.element_size()
    assert copies.counters.snapshot() == (d2h + nbytes, h2d + nbytes)


@pytest.mark.parametrize("stage", ["auto", "shm"])
def test_cuda_tensors_sum_exactly_and_stage_one_share_per_gpu(stage):
    workers = min(torch.cuda.device_count(), 4)
    cfg = {"sizes": [1, 17, 65_537], "dtypes": DTYPES, "rounds": 2, "in_flight": True, "train": True,
           "device": "cuda", "stage": "torch" if stage == "auto" else "shm"}
    rc, out = run_launch(workers, 1, "torch_local_stage.py", cfg, env={"GRADHUB_LOCAL_STAGE": stage})
    assert_all_passed(rc, out, workers)



def test_the_backend_on_cuda_tensors_collectives_ddp_and_fsdp2_equal_one_process():
    # Two processes whatever the GPUs (on one GPU they share it; the shared-memory local stage).
    from conftest import free_port

    rc, out = run_launch(2, 1, "backend_cuda.py", {"port": free_port()}, env={"GRADHUB_LOCAL_STAGE": "shm"})
    assert_all_passed(rc, out, 2)
    assert out.count("FSDP2 on CUDA: 20 steps equal one process") == 2, out[-6000:]
    assert out.count("point-to-point on CUDA tensors: exact") == 2, out[-6000:]


def test_a_pipeline_of_cuda_stages_over_the_backend_trains_equal_to_one_process():
    # torch.distributed.pipelining, one stage per process, activations on CUDA through the backend's point-to-point.
    from test_backend import run_torchrun_style

    results = run_torchrun_style(2, "backend_pipeline.py", ["h", "h"], GH_PIPE_DEVICE="cuda")
    for q, (rc, out) in enumerate(results):
        assert rc == 0 and f"stage {q} of 2: GPipe then 1F1B equal one process (on cuda)" in out, out[-6000:]
