"""Worker: exact push_pull rounds while the scheduler is killed and started
again; every `declare_every` rounds a tensor of a new name (a declaration,
which waits for the scheduler) and a barrier (which does too).

Config (GH_TEST JSON): rounds, sleep (seconds after each round), declare_every.
"""

import time

import gradhub
from common import CONFIG, check, data

gradhub.init()
r, n = gradhub.rank(), gradhub.size()
rounds = CONFIG.get("rounds", 40)
every = CONFIG.get("declare_every", 10)
names = [(f"{dt}.{s}", s, dt) for dt in ("float32", "bfloat16") for s in (3, 1000, 70_001)]
kw = lambda dt: {"dtype": "bfloat16"} if dt == "bfloat16" else {}

for rnd in range(rounds):
    seed = 1000 + rnd
    todo = list(names)
    if rnd % every == every - 1:
        todo.append((f"new.{rnd}", 5000, "float32"))
    arrays = {name: data(r, s, dt, seed, True) for name, s, dt in todo}
    for name, s, dt in todo:
        gradhub.push_pull(arrays[name], name=name, timeout=60, **kw(dt))
    for name, s, dt in todo:
        check(arrays[name], n, s, dt, seed, True, False, f"rank {r} round {rnd} {name}")
    if rnd % every == every - 1:
        gradhub.barrier()
    print(f"ROUND {rnd}", flush=True)
    time.sleep(float(CONFIG.get("sleep", 0.0)))

print("PASS", r, flush=True)
gradhub.shutdown()
