#!/usr/bin/env bash
# Installs gradhub for development: the system packages its tests use (when
# run as root on a Debian/Ubuntu machine: openssh-server for the SSH launch
# test on emulated hosts, Slurm's controller, daemon and client with munge
# for the srun test), then the package itself with its test and example
# dependencies (the Rust core built by maturin, numpy, torch, pytest), then
# the release wheel from the same compiled core (dist/), then the lab (lab/:
# the measurement harness behind docs/, which the tests import; it depends
# on gradhub, never the reverse), then a second
# environment with the oldest torch the package accepts (.venv-oldest-torch/:
# torch, numpy, pytest; gradhub from this tree on PYTHONPATH), where
# tests/test_torch_versions.py runs the backend's tests
# (OLDEST_TORCH=0 skips it outside CI).
set -euo pipefail
cd "$(dirname "$0")"
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    missing=()
    for pkg in openssh-server openssh-client iproute2 slurmctld slurmd slurm-client munge; do
        dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
    fi
fi
pip install -e ".[dev]"
# The release wheel, for machines without a Rust toolchain (README.md, "Install";
# tests/test_wheel.py installs it in a fresh environment): maturin finds the core
# the editable install above just compiled (the same release profile, features
# and target/) up to date, so this only packs it, in about a second. Its tag is
# the oldest manylinux that the core's glibc symbols allow, which maturin checks
# (manylinux_2_34 built on Debian 12).
# (maturin from PATH, else the module: in a virtual environment that sees the
# system's packages, `python -m maturin` finds no script next to its python.)
rm -f dist/gradhub-*.whl
if command -v maturin >/dev/null; then maturin=(maturin); else maturin=(python -m maturin); fi
"${maturin[@]}" build --release --out dist
# The Rust tests' binaries (`cargo test --release`, the README's next command,
# then finds them built) compile while the lab and the oldest torch install:
# mostly downloads and unpacking, which leave the cores to cargo. Its output
# goes to target/install-cargo-test.log; a failure here is only reported
# (`cargo test` builds again and says why).
cargo_log=target/install-cargo-test.log
mkdir -p target
cargo test --release --no-run >"$cargo_log" 2>&1 &
cargo_pid=$!
trap 'kill "$cargo_pid" 2>/dev/null || true' EXIT  # not left running if a step below fails
pip install -e lab/
if [ "${OLDEST_TORCH:-1}" != 0 ]; then
    oldest=$(python -c 'import tomllib; print(next(d for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["torch"] if d.startswith("torch>=")).split(">=")[1])')
    [ -x .venv-oldest-torch/bin/python ] || python -m venv .venv-oldest-torch
    .venv-oldest-torch/bin/pip install -q "torch~=${oldest}.0" numpy "pytest>=8,<9" pytest-xdist pyyaml expecttest
fi
wait "$cargo_pid" || echo "install.sh: building the Rust tests failed (see $cargo_log)" >&2
