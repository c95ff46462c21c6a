"""One backend's run of torch's own backend tests: `python -m
gradhub_lab.torch_suite_run BACKEND WORLD_SIZE SELECT_REGEX` runs the tests
of `DistributedTest._DistTestBase` (torch's
`torch.testing._internal.distributed.distributed_test`, shipped in every
wheel) whose names match, as torch's `test_distributed_spawn.py` does (each
test starts WORLD_SIZE processes), and prints one JSON object, test name ->
"passed" | "failed: ..." | "skipped: ...".

START=spawn (the default) starts each test's processes as fresh
interpreters, as torch's `test_distributed_spawn.py` does; START=fork forks
them from this process, which has imported torch, the suite and gradhub but
made no process group and started none of gradhub's threads: the same test
bodies on a fresh process group in each child, without an interpreter's
start-up and exit per process (seconds each), for the quick check CI runs.

For BACKEND=gradhub the suite sees the backend as gloo's peer: its feature
tables and `@require_backend_is_available({"gloo"})` gates are decided when
torch's module is imported, from `os.environ["BACKEND"]`, so while it is
imported that variable reads as a string equal to "gloo" as well as to
"gradhub" (`_GlooPeer`): the tests gloo runs run, with gloo's expectations.
Everything else (the process group made, `dist.get_backend()`) is gradhub.
Spawned processes import this module again, and with it the same setup.
"""

from __future__ import annotations

import json
import os
import re
import sys
import unittest


class _GlooPeer(str):
    """"gradhub", equal to "gloo" too (and hashed as it), for torch's gates."""

    def __eq__(self, other):
        return str.__eq__(self, other) or other == "gloo"

    def __ne__(self, other):
        return not self.__eq__(other)

    def __hash__(self):
        return hash("gloo")


class _Environ(dict):
    def __init__(self, real):
        super().__init__()
        self._real = real

    def __getitem__(self, key):
        v = self._real[key]
        return _GlooPeer(v) if key == "BACKEND" and v == "gradhub" else v

    def __getattr__(self, name):
        return getattr(self._real, name)

    def get(self, key, default=None):
        return self[key] if key in self._real else default

    def __contains__(self, key):
        return key in self._real

    def __setitem__(self, key, value):
        self._real[key] = value


def _import_suite():
    import gradhub.torch  # noqa: F401 - registers the backend

    from torch.testing._internal.common_distributed import DistTestCases

    DistTestCases.backend_feature["plugin"].add("gradhub")   # "available", as gloo is
    real = os.environ
    os.environ = _Environ(real)  # type: ignore[assignment] - while torch's module reads its gates
    try:
        from torch.testing._internal.distributed import distributed_test as dt
    finally:
        os.environ = real
    return dt


_dt = _import_suite()


class TestDistBackendWithSpawn(_dt.TestDistBackend, _dt.DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        if os.environ.get("START", "spawn") == "fork":
            import torch.multiprocessing

            self._start_processes(torch.multiprocessing.get_context("fork").Process)
        else:
            self._spawn_processes()


def main(argv: list[str]) -> int:
    pattern = re.compile(argv[3]) if len(argv) > 3 else re.compile(".")
    names = sorted(n for n in dir(TestDistBackendWithSpawn) if n.startswith("test_") and pattern.search(n))
    outcome: dict[str, str] = {}
    for name in names:
        result = unittest.TestResult()
        TestDistBackendWithSpawn(name).run(result)
        if result.errors or result.failures:
            lines = (result.errors or result.failures)[0][1].strip().splitlines()
            why = [ln.strip() for ln in lines if re.search(r"(Error|Exception|exit code)\b", ln)]
            outcome[name] = "failed: " + (why[-1] if why else lines[-1] if lines else "?")[:300]
        elif result.skipped:
            outcome[name] = "skipped: " + str(result.skipped[0][1])[:200]
        else:
            outcome[name] = "passed"
        print(f"{name}: {outcome[name]}", file=sys.stderr, flush=True)
    print(json.dumps(outcome), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
