"""Frameworks on the torch.distributed backend "gradhub": PyTorch Lightning
(`DDPStrategy(process_group_backend="gradhub")`, examples/lightning_ddp.py)
and Hugging Face Accelerate (a gradhub process group made before the
`Accelerator`, examples/accelerate_train.py; Hugging Face Transformers'
`Trainer` the same way, examples/hf_trainer.py), each on 2 processes started
by torchrun and by `gradhub launch`. Each example checks on every rank
that all ranks end with identical parameters, equal to one process
training on the combined batches, and that the loss fell, then prints
`PASS rank <r>/2`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ZYGOTE, alarming, free_port_pair, job_env

pytest.importorskip("torch")

EXAMPLES = Path(__file__).parent.parent / "examples"
STEPS = 8


def run(argv: list[str], timeout: float = 240) -> tuple[int, str]:
    # OMP_NUM_THREADS: one thread per worker, so neither torchrun nor Accelerate warns that it set it.
    p = subprocess.run(argv, env=job_env(OMP_NUM_THREADS=1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       timeout=timeout)
    return p.returncode, p.stdout.decode(errors="replace")


def torchrun(script: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(free_port_pair()), str(EXAMPLES / script), "--steps", str(STEPS)]


def gradhub_launch(script: str) -> list[str]:
    # Each worker forked from the session's zygote (tests/zygote.py: torch already imported), the example as __main__.
    return [sys.executable, "-m", "gradhub", "launch", "-w", "2", "-s", "1", "--", sys.executable, str(ZYGOTE),
            str(EXAMPLES / script), "--steps", str(STEPS)]


FRAMEWORKS = [("lightning", "lightning_ddp.py"), ("accelerate", "accelerate_train.py")]


@pytest.mark.parametrize("start", [torchrun, gradhub_launch], ids=["torchrun", "gradhub_launch"])
@pytest.mark.parametrize("package,script", FRAMEWORKS, ids=[f[0] for f in FRAMEWORKS])
def test_framework_trains_on_the_gradhub_backend(package, script, start):
    pytest.importorskip(package)
    rc, out = run(start(script))
    assert rc == 0, out[-6000:]
    for r in range(2):
        assert f"PASS rank {r}/2: " in out, out[-6000:]
    # gradhub's own lines (its processes', the launcher's, its Python warnings), not the frameworks' advice.
    ours = [line for line in alarming(out) if "gradhub" in line.lower()]
    assert not ours, "\n".join(ours) + "\n" + out[-6000:]


# Hugging Face Transformers' Trainer (examples/hf_trainer.py): TrainingArguments refuses ddp_backend="gradhub",
# so the script makes the gradhub process group first and the Trainer keeps it. 20 steps: the loss's fall the
# example asserts (to half) takes more than the 8 above; the training itself takes well under a second.
HF_STEPS = 20
HF_PASS = re.compile(r"PASS rank (\d)/2: Trainer on gradhub, (\d+) steps; .*\(sha256 ([0-9a-f]+)\); "
                     r"loss ([\d.]+) -> ([\d.]+)$", re.M)


@pytest.mark.parametrize("start", [torchrun, gradhub_launch], ids=["torchrun", "gradhub_launch"])
def test_hf_trainer_trains_on_the_gradhub_backend(start):
    pytest.importorskip("transformers")
    argv = start("hf_trainer.py")
    assert argv[-2:] == ["--steps", str(STEPS)]
    rc, out = run(argv[:-1] + [str(HF_STEPS)])
    assert rc == 0, out[-6000:]
    passed = {int(m.group(1)): m.groups()[1:] for m in HF_PASS.finditer(out)}
    assert sorted(passed) == [0, 1], out[-6000:]
    # Every rank trained every step and ends with the same parameters (their digests, printed by each rank)...
    assert {p[0] for p in passed.values()} == {str(HF_STEPS)}, passed
    assert passed[0][1] == passed[1][1], f"the ranks' parameters differ: {passed}"
    # ... and the loss over the whole data set fell.
    for _, _, before, after in passed.values():
        assert float(after) < float(before), passed
    ours = [line for line in alarming(out) if "gradhub" in line.lower()]
    assert not ours, "\n".join(ours) + "\n" + out[-6000:]
