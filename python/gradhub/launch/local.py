"""`gradhub launch` without hosts: a whole job on this machine, supervised.

Plans the job (plan.py) on loopback: the scheduler at 127.0.0.1 on --port
or a free port, the servers bound to loopback, -w workers; then starts the
scheduler, the servers and the workers as child processes, prefixes every
output line with the role and rank, and stops everything as soon as one
process fails, returning its exit code (run.py). When all workers succeed,
the scheduler tells the servers to exit; stragglers are terminated after a
grace period. With --min-workers, the job is elastic (elastic.py): it runs
on a shared service started for it, and a lost worker does not end it.
"""

from __future__ import annotations

import os
import secrets
import sys

from .. import _env
from .._ports import free_port
from .elastic import Elastic
from .flags import LaunchOptions
from .plan import Site, layout, plan
from .run import run, start_here

TOOL = "gradhub launch"


def made_up_token() -> str | None:
    """A job token for this launch, unless the user gave one (GRADHUB_JOB_TOKEN(_FILE))."""
    return secrets.token_hex(32) if _env.job_token() is None else None


def launch_local(opts: LaunchOptions) -> int:
    try:
        lay = layout(opts, None)
    except ValueError as e:
        print(f"{TOOL}: {e}", file=sys.stderr)
        return 2
    port = opts.port or free_port()
    el = Elastic(opts) if opts.elastic else None
    store = None
    if el is None:  # torch's env:// rendezvous: rank 0's TCPStore on another free port here
        store_port = free_port()
        while store_port == port:
            store_port = free_port()
        store = ("127.0.0.1", store_port)
    site = Site(scheduler=f"127.0.0.1:{port}", environ=dict(os.environ), token=made_up_token(), store=store,
                elastic=el)
    return run(plan(opts, lay, site), start_here, TOOL)
