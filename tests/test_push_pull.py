"""End-to-end push_pull through real scheduler, server and worker processes."""

import pytest

from conftest import assert_all_passed, run_launch

ALL = ["float32", "float16", "bfloat16"]


@pytest.mark.parametrize(
    "workers,servers,threads,launch_args",
    [
        (1, 1, 1, []),
        (2, 1, 2, []),
        (3, 2, 1, ["--colocated"]),
        (4, 3, 2, []),
        (4, 2, 1, ["--colocated-servers", "1"]),  # mixed colocated and CPU-only
    ],
)
def test_sums_all_dtypes_and_sizes(workers, servers, threads, launch_args):
    cfg = {"sizes": [1, 2, 3, 17, 1000, 65_537, 262_147], "dtypes": ALL, "rounds": 3}
    rc, out = run_launch(workers, servers, "check_sums.py", cfg, threads=threads, launch_args=launch_args)
    assert_all_passed(rc, out, workers)


def test_large_tensors_small_partitions():
    # Tens of MB per tensor, many chunks per server thread (64 KiB partitions):
    # the credit stays at its least default, 512 KiB.
    cfg = {"sizes": [10_000_003], "dtypes": ["float32"], "rounds": 2, "credit": 512 << 10}
    rc, out = run_launch(2, 2, "check_sums.py", cfg, threads=2, launch_args=["--partition-bytes", "65536"])
    assert_all_passed(rc, out, 2)
    # 1 MiB chunks: the default credit holds four of them.
    cfg = {"sizes": [3_000_017], "dtypes": ["float32"], "rounds": 2, "credit": 4 << 20}
    rc, out = run_launch(2, 2, "check_sums.py", cfg, threads=1, launch_args=["--partition-bytes", str(1 << 20)])
    assert_all_passed(rc, out, 2)
    cfg = {"sizes": [4_000_001], "dtypes": ["float16", "bfloat16"], "rounds": 1}
    rc, out = run_launch(2, 1, "check_sums.py", cfg, threads=1)
    assert_all_passed(rc, out, 2)


def test_random_floats_and_average():
    cfg = {"sizes": [5, 4099, 100_000], "dtypes": ALL, "rounds": 2, "integer": False, "average": True}
    rc, out = run_launch(3, 2, "check_sums.py", cfg)
    assert_all_passed(rc, out, 3)


def test_many_tensors_in_flight_with_priorities():
    sizes = [1, 3, 100, 1000, 5000, 33_333, 100_000, 250_001]
    cfg = {"sizes": sizes, "dtypes": ALL, "rounds": 4, "in_flight": True}
    rc, out = run_launch(4, 2, "check_sums.py", cfg, threads=2, launch_args=["--partition-bytes", "65536"])
    assert_all_passed(rc, out, 4)


def test_batched_declaration_in_different_orders():
    cfg = {"sizes": [10, 1000, 70_000], "dtypes": ALL, "rounds": 2, "declare": True, "in_flight": True}
    rc, out = run_launch(3, 2, "check_sums.py", cfg, threads=2)
    assert_all_passed(rc, out, 3)


def test_opposite_submission_orders_do_not_deadlock():
    # Small credit and partitions: each rank's queue holds many chunks the other sends last.
    rc, out = run_launch(2, 1, "cross_order.py", launch_args=["--partition-bytes", "65536"],
                         env={"GRADHUB_CREDIT_BYTES": 262144}, timeout=180)
    assert_all_passed(rc, out, 2)


@pytest.mark.parametrize("launch_args", [[], ["--no-host-reduce"]], ids=["host-stage", "sockets"])
def test_unnamed_calls_and_reused_names_keep_no_state_behind(launch_args):
    rc, out = run_launch(3, 2, "state.py", launch_args=launch_args)
    assert_all_passed(rc, out, 3)
