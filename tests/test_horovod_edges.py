"""Horovod's own expectations at the edges of gradhub.torch, each
on 2 and 3 workers, many cases per job (the worker scripts list them):
torch_horovod_edges.py (error types, integer scaling, reducescatter's
gradient, optimizer details, sparse, disagreements, barrier, join) and
torch_horovod_suite.py (the way Horovod's CI runs its tests: every case in
one process per worker, state left behind by the cases before)."""

import pytest

from conftest import assert_all_passed, run_launch


@pytest.mark.parametrize("workers", [2, 3])
def test_horovod_edges_error_types_scaling_gradients_sparse_join_barrier(workers):
    rc, out = run_launch(workers, 2, "torch_horovod_edges.py", timeout=180)
    assert_all_passed(rc, out, workers)


@pytest.mark.parametrize("workers", [2, 3])
def test_horovod_cases_in_one_process_per_worker(workers):
    rc, out = run_launch(workers, 2, "torch_horovod_suite.py", timeout=180)
    assert_all_passed(rc, out, workers)
