"""Closed forms of the traffic the simulator and the benchmarks compare
with: BytePS's optimal communication time and its per-link bytes (BytePS
§4.1), a ring all-reduce's, and a shaped link's token bucket."""

from __future__ import annotations


def byteps_optimum_time(n: int, k: int, model_bytes: float, rate_bps: float) -> float:
    """BytePS's optimal communication time per iteration (seconds):
    2n(n-1)M / ((n^2 + kn - 2k) B), for n worker machines, 0 <= k <= n CPU machines."""
    if n < 1 or k < 0:
        raise ValueError("need n >= 1 and k >= 0")
    if n == 1:
        return 0.0
    k = min(k, n)  # beyond n, more CPU machines do not help (BytePS §4.1)
    return 2 * n * (n - 1) * model_bytes * 8 / ((n * n + k * n - 2 * k) * rate_bps)


def allreduce_time(n: int, model_bytes: float, rate_bps: float) -> float:
    """Ring all-reduce: 2(n-1)M / (nB)."""
    return 2 * (n - 1) * model_bytes * 8 / (n * rate_bps)


def server_shares(hosts: int, k: int, workers_per_host: int = 1, host_reduce: bool = True,
                  colocated: bool = True) -> tuple[float, float]:
    """(c, s): the share of the model each colocated and each CPU-only server
    sums, by BytePS's split as the scheduler places it (weights n-k and
    2(n-1), n = the machines that push: hosts with the host stage, every
    worker without it): c = (n-k)/(n^2+kn-2k) when n = hosts."""
    n = hosts * (1 if host_reduce else max(1, workers_per_host))
    w_gpu = max(n - k, 0) if colocated else 0
    w_cpu = 2 * (n - 1)
    total = (hosts if colocated else 0) * w_gpu + k * w_cpu
    if total <= 0:  # e.g. one pushing machine: spread evenly
        m = (hosts if colocated else 0) + k
        return (1 / m if colocated else 0.0), (1 / m if k else 0.0)
    return w_gpu / total, (w_cpu / total if k else 0.0)


def host_link_bytes(hosts: int, k: int, model_bytes: float, workers_per_host: int = 1,
                    host_reduce: bool = True, colocated: bool = True) -> float:
    """Bytes through one worker host's link per iteration, in each direction,
    for a parameter-server job: one colocated server per worker host summing
    c of the model, k CPU-only servers the rest (`server_shares`).

    Upload: pushes to every server but the host's own, (1-c)M, plus the own
    server's results for the other hosts, (n-1)cM; download mirrors it. So
    M(1 + (n-2)c) per direction (n = hosts): 2(n-1)/n M for k = 0, M for
    k >= n, and M for n = 2 whatever k. Without the host stage each of the W
    workers of a host pushes and pulls for itself: W M(1 + (n-2)c), with c
    from the split over all n W workers. Without colocated servers (c = 0)
    a host pushes and pulls M (W M without the stage)."""
    if hosts < 1 or (hosts == 1 and colocated and k == 0):
        return 0.0
    c, _ = server_shares(hosts, k, workers_per_host, host_reduce, colocated)
    per_host = model_bytes * (1 + (hosts - 2) * c)
    return per_host * (1 if host_reduce else max(1, workers_per_host))


def server_link_bytes(hosts: int, k: int, model_bytes: float, workers_per_host: int = 1,
                      host_reduce: bool = True, colocated: bool = True) -> float:
    """Bytes through one CPU-only server's link per iteration and direction:
    each pushing machine sends it s M and gets s M back."""
    if k < 1:
        return 0.0
    _, s = server_shares(hosts, k, workers_per_host, host_reduce, colocated)
    return hosts * (1 if host_reduce else max(1, workers_per_host)) * s * model_bytes


def ring_host_link_bytes(hosts: int, workers_per_host: int, model_bytes: float) -> float:
    """Bytes through one host's link per iteration and direction for a ring
    all-reduce (gloo) over hosts x W processes ranked host by host (as
    torchrun ranks them): each host has one outgoing and one incoming ring
    edge, each carrying 2(N-1)/N M."""
    n = hosts * workers_per_host
    if hosts < 2:
        return 0.0
    return 2 * (n - 1) / n * model_bytes


def tbf_burst(rate_bps: int) -> int:
    """A shaped link's token bucket, as the emulated cluster's tc shaper
    sets it (gradhub_lab/netns.py): a burst of ~4 ms at line rate (at least
    64 KiB so GSO super-packets pass); 20 ms of queue behind it. On shared
    cores the simulator lets a worker's main thread carry that much of its
    sends along the path."""
    return max(int(rate_bps) // 8 // 250, 64 * 1024)
