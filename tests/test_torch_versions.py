"""Every torch the package accepts: the backend's tests (test_backend.py)
again under the oldest torch pyproject.toml declares, in the environment
./install.sh makes for it (.venv-oldest-torch/: that torch, numpy, pytest, expecttest;
gradhub from this tree). Where torch's `Backend` has no Python constructor
the backend is a `ProcessGroup` (`gradhub.torch.dist.backend_class`): this
runs that path; the rest of the suite runs the newest."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-oldest-torch"


def _oldest() -> str:
    with open(ROOT / "pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["optional-dependencies"]["torch"]
    return next(d for d in deps if d.startswith("torch>=")).split(">=")[1]


def _python() -> Path:
    py = VENV / "bin" / "python"
    if not py.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{VENV} is missing: ./install.sh makes it (the oldest torch's environment)")
        pytest.skip(f"{VENV} is missing (./install.sh makes it; OLDEST_TORCH=0 skipped it)")
    return py


def test_the_oldest_environment_has_the_oldest_declared_torch():
    out = subprocess.run([str(_python()), "-c", "import torch; print(torch.__version__)"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    version = out.stdout.strip()
    assert version.split("+")[0].rsplit(".", 1)[0] == _oldest(), (version, _oldest())


def test_the_backend_passes_its_tests_on_the_oldest_torch():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRADHUB_", "GH_ZYGOTE", "PYTEST_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), str(ROOT / "lab"), env.get("PYTHONPATH", "")])
    r = subprocess.run([str(_python()), "-m", "pytest", "-n", "0", "-q", "-p", "no:cacheprovider",
                        "tests/test_backend.py"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = (r.stdout + r.stderr)[-8000:]
    assert r.returncode == 0, tail
    assert " passed" in tail and " failed" not in tail, tail
    # The path this environment exists for: the ProcessGroup form of the backend.
    which = subprocess.run([str(_python()), "-c", "from gradhub.torch.dist import backend_class; "
                            "print(backend_class().__name__)"], env=env, capture_output=True, text=True, timeout=120)
    assert which.returncode == 0, which.stderr
    print(f"torch {_oldest()}: {tail.strip().splitlines()[-1]}; backend class {which.stdout.strip()}",
          file=sys.stderr)
