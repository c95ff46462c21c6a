"""`gradhub-lab torch-suite`: torch's own backend tests
(`DistributedTest._DistTestBase`, the suite torch runs against gloo and
NCCL) on gradhub and on gloo side by side, as a new backend's author runs
them: each backend and world size in a process of its own
(`torch_suite_run.py`), the same selection of CPU tests, then a table of
every test gloo passes that gradhub does not, with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

# The CPU tests of collectives, groups, point-to-point, object collectives,
# barriers and DDP (names), less those for devices this machine has not.
SELECTION = (r"^test_(all_reduce|all_gather|allgather|reduce|broadcast|scatter|gather|all_to_all|barrier|send_recv|"
             r"isend|irecv|batch_isend_irecv|monitored_barrier|.*object|new_group|backend|get_backend|get_rank|"
             r"destroy|DistributedDataParallel|ddp|sparse|average_parameters|periodic|static_graph)(?!.*(cuda|nccl|gpu|"
             r"Gpu|GPU|hpu|xpu))")
# What CI runs: one test of each kind the backend must keep passing.
QUICK = (r"^test_(all_reduce_sum|all_gather|broadcast|barrier|reduce_sum|scatter|sparse_all_reduce_sum|"
         r"monitored_barrier_gloo|all_gather_coalesced_simple|all_gather_object_default_pg|all_gather_object_subgroup|"
         r"DistributedDataParallelCPU|send_recv_any_source|batch_isend_irecv_gloo_tags|barrier_timeout_arg)$")


def run_backend(backend: str, world: int, select: str, timeout: float = 3600, start: str = "fork") -> dict[str, str]:
    """One backend's outcomes (test -> "passed" | "failed: ..." | "skipped: ...").
    `start`: how each test's processes start (`torch_suite_run`): "fork" (the
    quick check: children of one process that imported torch and gradhub and
    started nothing, about 1 s a test here instead of 10) or "spawn" (fresh
    interpreters, as torch's `test_distributed_spawn.py`: the lab's runs)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GRADHUB_")}
        env.update(BACKEND=backend, WORLD_SIZE=str(world), TEMP_DIR=tmp, PYTHONUNBUFFERED="1",
                   PYTORCH_PRINT_REPRO_ON_FAILURE="0", START=start)
        r = subprocess.run([sys.executable, "-m", "gradhub_lab.torch_suite_run", backend, str(world), select],
                           capture_output=True, text=True, timeout=timeout, env=env)
    last = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not last:
        raise RuntimeError(f"torch's suite on {backend} (world {world}) did not report:\n{r.stderr[-3000:]}")
    return json.loads(last[-1])


def compare(gloo: dict[str, str], gradhub: dict[str, str]) -> dict:
    """The tests gloo passes, and those of them gradhub does not (with why)."""
    ref = sorted(n for n, o in gloo.items() if o == "passed")
    missing = {n: gradhub.get(n, "not run") for n in ref if gradhub.get(n) != "passed"}
    return {"gloo_passed": len(ref), "gradhub_passed": len(ref) - len(missing), "not_passed": missing,
            "gradhub_only": sorted(n for n, o in gradhub.items() if o == "passed" and gloo.get(n) != "passed")}


def main(worlds: list[int], select: str, json_out: str | None, start: str = "spawn") -> int:
    import torch

    records = []
    for world in worlds:
        gloo = run_backend("gloo", world, select, start=start)
        mine = run_backend("gradhub", world, select, start=start)
        c = compare(gloo, mine)
        print(f"torch {torch.__version__}, {world} processes, {len(gloo)} tests selected: gloo passes "
              f"{c['gloo_passed']}, gradhub {c['gradhub_passed']} of them", flush=True)
        for name, why in c["not_passed"].items():
            print(f"  {name}: {why}", flush=True)
        records.append({"torch": torch.__version__, "world": world, "start": start, "selected": len(gloo), **c,
                        "gloo": gloo, "gradhub": mine})
    if json_out:
        with open(json_out, "w") as f:
            json.dump(records, f, indent=1)
    return 0
