"""Shared helpers for test worker scripts: deterministic data and references."""

import json
import os

import numpy as np

CONFIG = json.loads(os.environ.get("GH_TEST", "{}"))


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even f32 -> bf16 bit patterns (NaN-free inputs)."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return b.astype(np.uint16)


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def data(rank: int, size: int, dtype: str, seed: int, integer: bool = False) -> np.ndarray:
    """Worker `rank`'s input: the same on every worker that asks for it."""
    rng = np.random.default_rng([seed, rank, size])
    x = rng.integers(-50, 50, size).astype(np.float32) if integer else rng.standard_normal(size).astype(np.float32)
    if dtype == "float32":
        return x
    if dtype == "float16":
        return x.astype(np.float16)
    return f32_to_bf16_bits(x)


def as_f32(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return bf16_bits_to_f32(x)
    return x.astype(np.float32)


def reference(n: int, size: int, dtype: str, seed: int, integer: bool, average: bool) -> np.ndarray:
    """Sum of every worker's input, accumulated in f64, in f32."""
    acc = np.zeros(size, dtype=np.float64)
    for r in range(n):
        acc += as_f32(data(r, size, dtype, seed, integer), dtype)
    if average:
        acc /= n
    return acc


def check(result: np.ndarray, n: int, size: int, dtype: str, seed: int, integer: bool, average: bool, what: str):
    ref = reference(n, size, dtype, seed, integer, average)
    got = as_f32(result, dtype).astype(np.float64)
    if dtype == "float32":
        if integer and not average:
            ok = np.array_equal(got, ref)
            tol = 0.0
        else:
            tol = 1e-5 * n
            ok = np.allclose(got, ref, rtol=1e-6 * n, atol=tol)
    else:
        # Accumulated in f32 and rounded to the 16-bit type once per level:
        # the sum of the workers that share a host (host stage, which pushes
        # it in the tensor's dtype), then the server's sum of the hosts. These
        # tests run every worker on one host, so the host's sum is the total:
        # within two roundings of the type (relative eps 2^-11 / 2^-8), plus a
        # little for the f32 accumulation order.
        eps = 2.0**-11 if dtype == "float16" else 2.0**-8
        tol = np.abs(ref) * eps * 2.02 + 1e-6 * n
        ok = bool(np.all(np.abs(got - ref) <= tol))
    if not ok:
        bad = np.flatnonzero(~np.isclose(got, ref, rtol=0, atol=np.max(tol) if np.ndim(tol) else tol))[:5]
        raise AssertionError(f"{what}: mismatch at {bad.tolist()}: got {got[bad]} want {ref[bad]}")
