"""The release wheel installs and runs where there is no Rust toolchain.

./install.sh builds it (dist/gradhub-<version>-cp311-abi3-manylinux_<x>_<y>_<arch>.whl,
from the core the editable install compiled; README.md, "Install"). Here it is
installed into a fresh virtual environment (with the system's site-packages,
for torch and numpy, but gradhub from the wheel: its `__file__` is checked),
and, with a PATH that has no cargo, rustc or maturin, the README's quick start
runs as written (`gradhub launch`, 4 workers, 2 servers) and so does a
two-process job on the "gradhub" torch.distributed backend under torchrun.
auditwheel checks that the wheel's manylinux tag claims no more than its
core's glibc symbols allow.

Without the wheel the tests fail in CI (CI set) and are skipped elsewhere."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import free_port_pair, job_env

ROOT = Path(__file__).resolve().parent.parent
DIST = ROOT / "dist"
BUILD = "python -m maturin build --release --out dist"
TOOLCHAIN = ("cargo", "rustc", "rustup", "maturin")


@pytest.fixture(scope="module")
def wheel() -> Path:
    found = sorted(DIST.glob("gradhub-*.whl"), key=lambda p: p.stat().st_mtime)
    if not found:
        why = f"no wheel in dist/: ./install.sh builds it (or `{BUILD}` after `pip install -e .`)"
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail(why)
        pytest.skip(why)
    return found[-1]


def _platform_tag(wheel: Path) -> str:
    return wheel.stem.split("-")[-1]   # name-version-python-abi-platform


def test_the_wheels_manylinux_tag_is_what_its_core_needs(wheel):
    """The tag claims no older glibc than the core's versioned symbols need (auditwheel's reading)."""
    pytest.importorskip("auditwheel")
    tag = _platform_tag(wheel)
    claimed = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", tag)
    assert claimed, f"{wheel.name}: not a manylinux wheel ({tag}): a cluster's pip would refuse it elsewhere"
    out = subprocess.run([sys.executable, "-m", "auditwheel", "show", str(wheel)], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=120).stdout
    needed = re.search(r"consistent with\s+the following platform tag:\s+\"manylinux_(\d+)_(\d+)_(\w+)\"", out)
    assert needed, out
    assert claimed.group(3) == needed.group(3), out
    assert (int(claimed.group(1)), int(claimed.group(2))) >= (int(needed.group(1)), int(needed.group(2))), \
        f"{wheel.name} claims glibc {claimed.group(1)}.{claimed.group(2)}, but its core needs:\n{out}"


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> tuple[Path, dict]:
    """A fresh environment with the wheel installed, and the environment its
    commands run in: PATH = the venv's bin and the system's, no toolchain."""
    root = tmp_path_factory.mktemp("wheel") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(root)], check=True, timeout=120)
    py = root / "bin" / "python"
    # --ignore-installed: the checkout's editable install is in the system's site-packages.
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--ignore-installed",
                    "--disable-pip-version-check", str(wheel)], check=True, timeout=120)
    path = os.pathsep.join([str(root / "bin"), "/usr/local/bin", "/usr/bin", "/bin"])
    for tool in TOOLCHAIN:
        assert shutil.which(tool, path=path) is None, f"{tool} is on the test's PATH {path}"
    env = job_env(PATH=path, VIRTUAL_ENV=str(root), OMP_NUM_THREADS=1)
    for k in ("PYTHONPATH", "PYTHONHOME", "CARGO_HOME", "RUSTUP_HOME", "PYENV_VERSION"):
        env.pop(k, None)
    return root, env


def _run(argv: list[str], env: dict, cwd: Path, timeout: float = 180) -> str:
    p = subprocess.run(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    out = p.stdout.decode(errors="replace")
    assert p.returncode == 0, f"{argv} exited {p.returncode}:\n{out[-6000:]}"
    return out


def test_the_wheel_is_what_the_environment_imports(venv, tmp_path):
    root, env = venv
    out = _run(["python", "-c", "import gradhub, gradhub._core, numpy; "
                "print(gradhub.__file__); print(gradhub._core.__file__); print(gradhub.PROTOCOL_VERSION)"],
               env, tmp_path)
    init, core, protocol = out.split()
    site = root / "lib"
    assert Path(init).is_relative_to(site) and Path(core).is_relative_to(site), out
    assert not Path(core).is_relative_to(ROOT), out
    import gradhub
    assert int(protocol) == gradhub.PROTOCOL_VERSION, \
        f"the wheel speaks protocol {protocol}, this checkout {gradhub.PROTOCOL_VERSION}: rebuild it ({BUILD})"
    # The console script the wheel installs.
    version = _run(["gradhub", "--version"], env, tmp_path)
    assert version.strip() == f"gradhub {gradhub.__version__} (protocol {protocol})", version


def _quick_start() -> str:
    """The README's quick start: its first bash block."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block and "gradhub launch" in block.group(1), section[:2000]
    return block.group(1)


def test_the_readmes_quick_start_runs_from_the_wheel(venv, tmp_path):
    root, env = venv
    script = _quick_start()
    assert "/tmp/train.py" in script, script
    out = _run(["bash", "-euo", "pipefail", "-c", script.replace("/tmp/train.py", str(tmp_path / "train.py"))],
               env, tmp_path)
    for r in range(4):
        assert f"[worker {r}] rank {r} of 4 -> [2.5 2.5 2.5]" in out, out[-6000:]


JOB = textwrap.dedent("""\
    import sys
    import torch, torch.distributed as dist, torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel
    import gradhub, gradhub._core, gradhub.torch

    dist.init_process_group("gradhub")
    r, n = dist.get_rank(), dist.get_world_size()
    t = torch.full((5,), float(r + 1))
    dist.all_reduce(t)
    assert t.tolist() == [n * (n + 1) / 2] * 5, t
    torch.manual_seed(r)                      # different start and data per rank: DDP's broadcast and sums align them
    model = DistributedDataParallel(nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
    flat = nn.utils.parameters_to_vector(model.parameters()).detach()
    every = [torch.empty_like(flat) for _ in range(n)]
    dist.all_gather(every, flat)
    assert all(torch.equal(e, every[0]) for e in every), every
    assert dist.get_backend() == "gradhub", dist.get_backend()
    dist.destroy_process_group()
    # One write, newline included: print() writes the line and its end apart, and
    # the other processes' output (the same pipe) may land between them.
    sys.stdout.write(f"JOB rank {r}/{n} ok: core {gradhub._core.__file__}\\n")
    sys.stdout.flush()
""")


def test_a_two_process_backend_job_runs_from_the_wheel(venv, tmp_path):
    root, env = venv
    (tmp_path / "job.py").write_text(JOB)
    out = _run(["python", "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                "--master-port", str(free_port_pair()), str(tmp_path / "job.py")], env, tmp_path)
    for r in range(2):
        m = re.search(rf"^JOB rank {r}/2 ok: core (\S+?\.so)", out, re.M)
        assert m, out[-6000:]
        assert Path(m.group(1)).is_relative_to(root), m.group(0)
