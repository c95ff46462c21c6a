"""What needs the source checkout (`gradhub bench core`'s raw-TCP baseline,
the lab's `torch-options`): where it is, and the compiled raw-TCP baseline
(examples/tcp_baseline.rs), built with cargo on first use."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path


class CheckoutError(RuntimeError):
    """The checkout or the Rust toolchain a developer benchmark needs is missing."""


def _is_checkout(d: Path) -> bool:
    return (d / "Cargo.toml").is_file() and (d / "examples" / "tcp_baseline.rs").is_file()


def checkout_root() -> Path:
    """The gradhub source checkout: the one this package is installed from
    (`pip install -e .`), else the current directory."""
    here = Path(__file__).resolve().parents[3]  # <checkout>/python/gradhub/bench/checkout.py
    for d in (here, Path.cwd()):
        if _is_checkout(d):
            return d
    raise CheckoutError("this benchmark needs the gradhub source checkout (Cargo.toml, examples/); "
                        "install gradhub from it with `pip install -e .` or run the command inside it")


def tcp_baseline() -> Path:
    """Path of the compiled raw-TCP baseline, built with
    `cargo build --release --example tcp_baseline` if it is missing or older
    than its source."""
    root = checkout_root()
    src = root / "examples" / "tcp_baseline.rs"
    exe = root / "target" / "release" / "examples" / "tcp_baseline"
    if exe.is_file() and exe.stat().st_mtime >= src.stat().st_mtime:
        return exe
    cargo = shutil.which("cargo")
    if cargo is None:
        raise CheckoutError("building the raw-TCP baseline needs cargo (a Rust toolchain, https://rustup.rs)")
    argv = [cargo, "build", "--release", "--example", "tcp_baseline", "--message-format=json-render-diagnostics"]
    print("building the raw-TCP baseline: cargo build --release --example tcp_baseline", file=sys.stderr, flush=True)
    p = subprocess.run(argv, cwd=root, stdout=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise CheckoutError(f"cargo build --release --example tcp_baseline failed (exit code {p.returncode})")
    for line in p.stdout.splitlines():  # the executable's path, wherever the target directory is
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if msg.get("reason") == "compiler-artifact" and msg.get("target", {}).get("name") == "tcp_baseline" \
                and msg.get("executable"):
            return Path(msg["executable"])
    if exe.is_file():
        return exe
    raise CheckoutError(f"cargo built tcp_baseline but it is not at {exe}")
