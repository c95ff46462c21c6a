"""Start and watch what a launch plan (plan.py) lists, on this machine or
over ssh alike: the scheduler and the servers, then (an elastic job: once
its shared service is ready) the workers; then `supervise` (proc.py) until
the job ends. An elastic job's later workers (a lost one's replacement, one
on a slot the discovery script found) are the plan's `joiner`s."""

from __future__ import annotations

from typing import Callable

from . import discovery
from .plan import Plan, ProcessSpec
from .proc import Proc, supervise

Start = Callable[[ProcessSpec], Proc]


def start_here(spec: ProcessSpec) -> Proc:
    """A process of the plan on this machine."""
    assert spec.host is None, spec
    return Proc(spec.label, list(spec.argv), dict(spec.env))


def host_of(p: Proc) -> str | None:
    """The host a worker was started on (its label's @host; None: this machine)."""
    return p.label.split("@", 1)[1] if "@" in p.label else None


def run(plan: Plan, start: Start, tool: str, discover: tuple[str, int, float, dict[str, int]] | None = None) -> int:
    """Start `plan`'s processes with `start` and supervise the job; its exit
    code. `discover`: an elastic job that follows its hosts (the discovery
    script, its default slots, its interval, the hosts it found first)."""
    procs: list[Proc] = [start(s) for s in plan.service]
    el = plan.elastic
    rc = el.ready(plan.scheduler, len(plan.servers), procs, tool) if el else None
    if rc is not None:
        return rc
    workers = [start(s) for s in plan.workers]
    procs += workers
    if el is None:
        return supervise(procs, workers, tool)
    ranks = iter(range(len(workers), 1 << 30))

    def join(host: str | None) -> Proc:
        return start(plan.joiner(next(ranks), host))

    def grow(host: str) -> Proc:
        """A worker on a discovered free slot (the follower adds it to `workers`)."""
        p = join(host)
        procs.append(p)
        return p

    retired: set[Proc] = set()  # workers the follower stopped: their hosts left
    follower = None
    if discover is not None:
        script, slots, interval, found = discover
        poller = discovery.Poller(script, slots, interval, found, tool).start()
        follower = discovery.Follower(poller, workers, plan.most_workers, grow, retired.add, tool)

    def replace(lost: Proc) -> Proc | None:
        """A new worker for `lost`: on its host, or (a discovery job) a listed host with a free slot."""
        host = host_of(lost)
        if follower is not None:
            host = follower.free_host(prefer=host)
            if host is None:
                return None
        return join(host)

    try:
        return supervise(procs, workers, tool, min_workers=el.min_workers,
                         replace=replace if el.max_workers is not None else None, max_workers=plan.most_workers,
                         tick=follower.tick if follower else None, retired=retired, stop_service=el.stop)
    finally:
        if follower is not None:
            follower.poller.stop()
