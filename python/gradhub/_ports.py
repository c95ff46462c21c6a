"""Choosing a port for a job's scheduler or server before starting it.

A port that the kernel handed out as ephemeral (bind to port 0) can be taken
again by any outgoing connection before the process that should listen on it
starts, and a worker retrying a connect to a port nobody listens on yet can
even connect to itself on it; both were seen as 'Address already in use' in
CI. Ports are therefore drawn below the ephemeral range, checked free, and
never handed out twice by one process.
"""

from __future__ import annotations

import random
import socket

_given: set[int] = set()
_rng = random.Random()


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
            return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, outside the ephemeral range, not returned before."""
    lo, hi = _ephemeral_range()
    # Below the ephemeral range if it leaves room, else above it.
    span = (10000, lo - 1) if lo - 10000 >= 2000 else (hi + 1, 65535)
    for _ in range(200):
        p = _rng.randint(*span)
        if p in _given:
            continue
        try:
            with socket.socket() as s:
                s.bind((host, p))
        except OSError:
            continue
        _given.add(p)
        return p
    raise RuntimeError(f"no free port found in {span[0]}-{span[1]} on {host}")
