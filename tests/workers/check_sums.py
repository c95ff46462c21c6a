"""Worker: push_pull many sizes and dtypes for several rounds, check against numpy.

Config (GH_TEST JSON): sizes, dtypes, rounds, average, in_flight (async all at
once with random priorities), reverse_declare (odd ranks declare in reverse),
credit (the credit per connection this worker must have been given), sleep
{rank: seconds after each round} (a straggler).
"""

import os
import time

import numpy as np

import gradhub
from common import CONFIG, check, data

gradhub.init()
r, n = gradhub.rank(), gradhub.size()
print(f"LOCAL {gradhub.local_rank()} of {gradhub.local_size()}", flush=True)
if "NODE_RANK" in os.environ:   # the launcher's node, under torchrun's names (Lightning reads them)
    print(f"NODE {os.environ['NODE_RANK']} GROUP {os.environ['GROUP_RANK']} OF {os.environ['GROUP_WORLD_SIZE']} "
          f"LOCAL_WORLD_SIZE {os.environ['LOCAL_WORLD_SIZE']}", flush=True)
if "credit" in CONFIG:
    assert gradhub.api.credit_bytes() == CONFIG["credit"], (gradhub.api.credit_bytes(), CONFIG["credit"])
sizes = CONFIG.get("sizes", [1, 2, 3, 17, 1000, 262_147])
dtypes = CONFIG.get("dtypes", ["float32", "float16", "bfloat16"])
rounds = CONFIG.get("rounds", 2)
average = CONFIG.get("average", False)
integer = CONFIG.get("integer", True)
in_flight = CONFIG.get("in_flight", False)

names = [(f"{dt}.{s}", s, dt) for dt in dtypes for s in sizes]
if CONFIG.get("declare", False):
    decls = [(name, (s, dt)) for name, s, dt in names]
    if r % 2 == 1:
        decls.reverse()
    gradhub.declare(decls)

for rnd in range(rounds):
    seed = 1000 + rnd
    arrays = {name: data(r, s, dt, seed, integer) for name, s, dt in names}
    kw = lambda dt: {"dtype": "bfloat16"} if dt == "bfloat16" else {}
    if in_flight:
        prio = np.random.default_rng([rnd, 7]).integers(-100, 100, len(names))  # same on every rank
        order = list(range(len(names)))
        np.random.default_rng([rnd, r]).shuffle(order)  # submission order differs per rank
        handles = {}
        for i in order:
            name, s, dt = names[i]
            handles[name] = gradhub.push_pull_async(arrays[name], name=name, average=average,
                                                    priority=int(prio[i]), **kw(dt))
        for name, h in handles.items():
            h.wait(timeout=120)
    else:
        for name, s, dt in names:
            gradhub.push_pull(arrays[name], name=name, average=average, timeout=120, **kw(dt))
    for name, s, dt in names:
        check(arrays[name], n, s, dt, seed, integer, average, f"rank {r} round {rnd} {name}")
    time.sleep(float(CONFIG.get("sleep", {}).get(str(r), 0.0)))

print("PASS", r, flush=True)
gradhub.shutdown()
