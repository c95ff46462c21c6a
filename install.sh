#!/usr/bin/env bash
# Installs gradhub for development: the system packages its tests use (when
# run as root on a Debian/Ubuntu machine: openssh-server for the SSH launch
# test on emulated hosts, Slurm's controller, daemon and client with munge
# for the srun test), then the package itself with its test and example
# dependencies (the Rust core built by maturin, numpy, torch, pytest), then
# the lab (lab/: the measurement harness behind docs/, which the tests
# import; it depends on gradhub, never the reverse).
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
pip install -e lab/
