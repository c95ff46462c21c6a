"""Worker: push_pull tensors whose float sum depends on the order it is made
in, sleeping a random time (GH_TEST `delay_seed`) before each push so that
pushes arrive in a different order every run; prints a hash of every dtype's
results. With GRADHUB_DETERMINISTIC=1 it also checks that each result is the
sum in rank order, element by element, in the tensor's own type.

Config: `hosts` (by rank, which emulated host the worker is on: workers on one
host sum there first), `racks` (the job reduces within racks), `rounds`,
`size`, `delay_seed`.
"""

import functools
import hashlib
import os
import time

import numpy as np

CONFIG = __import__("common").CONFIG
ME = int(os.environ["GRADHUB_RANK"])
HOSTS = CONFIG["hosts"]
# Emulated hosts, read by gradhub.init() (the launcher put every worker on this machine's).
os.environ["GRADHUB_HOST_ID"] = f"det-{HOSTS[ME]}"
os.environ["GRADHUB_LOCAL_RANK"] = str(HOSTS[:ME].count(HOSTS[ME]))
os.environ["GRADHUB_LOCAL_SIZE"] = str(HOSTS.count(HOSTS[ME]))

import gradhub  # noqa: E402
from common import bf16_bits_to_f32, f32_to_bf16_bits  # noqa: E402

gradhub.init()
r, n = gradhub.rank(), gradhub.size()
deterministic = os.environ.get("GRADHUB_DETERMINISTIC") == "1"
size, rounds = CONFIG.get("size", 40_000), CONFIG.get("rounds", 12)
delays = np.random.default_rng([CONFIG["delay_seed"], r])

# Per element, one worker holds +B, one -B, the others a small s lost when
# added to B: the sum is 0 if s meets B before -B does, else a multiple of
# s, so any two arrival orders that differ give different bits somewhere.
BIG_SMALL = {"float32": (2.0 ** 24, 1.0), "float64": (2.0 ** 53, 1.0), "float16": (2.0 ** 15, 2.0 ** -10),
             "bfloat16": (2.0 ** 24, 1.0), "int64": (2 ** 40, 1)}


@functools.lru_cache(maxsize=None)
def round_roles(rnd: int) -> np.ndarray:
    """Each element's role (column: worker) in round `rnd`, the same for every
    dtype and worker: sorted once (the sort was most of the workers' CPU)."""
    return np.argsort(np.random.default_rng([rnd, size]).random((size, n)), axis=1)


def inputs(rank: int, rnd: int, dtype: str) -> np.ndarray:
    """Worker `rank`'s tensor in round `rnd` (the same in every run)."""
    roles = round_roles(rnd)[:, rank]
    big, small = BIG_SMALL[dtype]
    if dtype == "int64":
        return np.where(roles == 0, big, np.where(roles == 1, -big, small)).astype(np.int64)
    x = np.where(roles == 0, big, np.where(roles == 1, -big, small))
    if dtype == "bfloat16":
        return f32_to_bf16_bits(x.astype(np.float32))
    return x.astype(dtype)


def rank_order_sum(rnd: int, dtype: str) -> np.ndarray:
    """Every worker's tensor added in rank order, as GRADHUB_DETERMINISTIC
    promises: each host's workers first (a 16-bit host sum is made in f32
    and rounded to its type once, to travel), then the hosts' sums, in the
    order of their ranks; 16-bit sums in f32, rounded once at the end."""
    half = dtype in ("float16", "bfloat16")
    wide = lambda x: (bf16_bits_to_f32(x) if dtype == "bfloat16" else x.astype(np.float32)) if half else x
    narrow = lambda x: (f32_to_bf16_bits(x) if dtype == "bfloat16" else x.astype(np.float16)) if half else x
    total = None
    for host in sorted(set(HOSTS), key=HOSTS.index):
        acc = None
        for w in [w for w in range(n) if HOSTS[w] == host]:
            x = wide(inputs(w, rnd, dtype))
            acc = x if acc is None else acc + x
        acc = wide(narrow(acc))
        total = acc if total is None else total + acc
    return narrow(total)


for dtype in BIG_SMALL:
    h = hashlib.sha256()
    for rnd in range(rounds):
        x = inputs(r, rnd, dtype)
        time.sleep(delays.uniform(0, 0.01))
        gradhub.push_pull(x, name=f"det.{dtype}", dtype="bfloat16" if dtype == "bfloat16" else None, timeout=120)
        # (Across racks each chunk's owner rack comes first: the reference is flat, so racks check bits only.)
        if (deterministic and not CONFIG.get("racks")) or dtype == "int64":
            want = rank_order_sum(rnd, dtype)
            assert x.tobytes() == want.tobytes(), (dtype, rnd, np.flatnonzero(x != want)[:5], x[x != want][:5])
        h.update(x.tobytes())
    print(f"HASH {dtype} {h.hexdigest()}", flush=True)

print("PASS", r, flush=True)
gradhub.shutdown()
