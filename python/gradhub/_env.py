"""Job configuration from the environment.

gradhub reads its own GRADHUB_* variables first and falls back to torchrun's
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so a
script started by `gradhub launch` or by torchrun needs no extra setup.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


def _int(name: str, default: int | None = None) -> int | None:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"environment variable {name}={v!r} is not an integer") from None


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass
class WorkerEnv:
    scheduler: str | None
    rank: int
    num_workers: int
    num_servers: int
    local_rank: int | None
    local_size: int | None
    namespace: int
    credit_bytes: int | None
    connect_timeout: float
    torchrun: bool


def worker_env() -> WorkerEnv:
    torchrun = "MASTER_ADDR" in os.environ and "WORLD_SIZE" in os.environ
    scheduler = os.environ.get("GRADHUB_SCHEDULER")
    if not scheduler and torchrun:
        port = _int("GRADHUB_SCHEDULER_PORT") or (_int("MASTER_PORT", 29500) + 1)
        scheduler = f"{os.environ['MASTER_ADDR']}:{port}"
    rank = _int("GRADHUB_RANK", _int("RANK", -1))
    num_workers = _int("GRADHUB_NUM_WORKERS", _int("WORLD_SIZE", 0))
    local_size = _int("LOCAL_WORLD_SIZE")
    default_servers = 0
    if torchrun and num_workers and local_size:
        default_servers = max(1, num_workers // local_size)  # one per node
    return WorkerEnv(
        scheduler=scheduler,
        rank=rank,
        num_workers=num_workers,
        num_servers=_int("GRADHUB_NUM_SERVERS", default_servers),
        local_rank=_int("LOCAL_RANK"),
        local_size=local_size,
        namespace=_int("GRADHUB_NAMESPACE", 0),
        credit_bytes=_int("GRADHUB_CREDIT_BYTES"),
        connect_timeout=float(os.environ.get("GRADHUB_CONNECT_TIMEOUT", "60")),
        torchrun=torchrun,
    )
