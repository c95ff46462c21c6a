"""`gradhub launch --min-workers M`: the job as an elastic job, on a shared
service the launch starts for it alone (a service-mode scheduler and
servers, a made-up master token, the job's name and token), with the
launch flags that say so (flags.py; plan.py checks them and gives each
role's environment from `Elastic`'s). Supervision of an elastic job (a lost
worker does not end it) is proc.py's `Losses`.

The service forms each generation of the job and gives its ranks; the
launcher only starts the processes, and gives every worker the job's
starting size and bounds (GRADHUB_NUM_WORKERS, _MIN_WORKERS, _MAX_WORKERS).
"""

from __future__ import annotations

import json
import secrets
import time

from .. import _core
from .proc import Proc, stop_procs, stop_unready, stopped_on_signals

# Seconds to wait for the service to be up with every server registered:
# a job takes the servers registered when its first worker arrives.
SERVICE_READY_S = 60.0
# Seconds to wait, at the end, for the service to see its job's end.
SERVICE_IDLE_S = 5.0


class Elastic:
    """One launch's elastic job: its service's master token, the job's name
    and token, and the environment of each role."""

    def __init__(self, opts):
        """`opts`: the launch options (min_workers, max_workers); the secrets are made up here."""
        self.min_workers: int = opts.min_workers
        self.max_workers: int | None = opts.max_workers
        self.master = secrets.token_hex(32)
        self.job = "launch-" + secrets.token_hex(4)
        self.token = _core.job_token(self.master, self.job)

    def service_env(self, base: dict[str, str]) -> dict[str, str]:
        """The scheduler's and servers' environment: the master token, no job token."""
        env = {**base, "GRADHUB_SERVICE_TOKEN": self.master}
        env.pop("GRADHUB_JOB_TOKEN", None)
        env.pop("GRADHUB_SERVICE_TOKEN_FILE", None)
        return env

    def worker_env(self, base: dict[str, str]) -> dict[str, str]:
        """A worker's environment: the job's name, token and bounds; never the master token."""
        env = {**base, "GRADHUB_JOB": self.job, "GRADHUB_JOB_TOKEN": self.token,
               "GRADHUB_MIN_WORKERS": str(self.min_workers)}
        if self.max_workers is not None:
            env["GRADHUB_MAX_WORKERS"] = str(self.max_workers)
        for k in ("GRADHUB_SERVICE_TOKEN", "GRADHUB_SERVICE_TOKEN_FILE", "GRADHUB_JOB_TOKEN_FILE"):
            env.pop(k, None)
        return env

    def ready(self, address: str, servers: int, service: list[Proc], tool: str) -> int | None:
        """Wait until the service at `address` answers with `servers`
        servers registered (Ctrl-C stops it); None, or, when it did not
        (a process of the service exited, or the wait timed out), the
        launch's exit code once the service's processes were stopped."""
        self.address, self.service = address, list(service)
        with stopped_on_signals(service):
            why = self._wait_ready(address, servers, service)
        return None if why is None else stop_unready(service, why, tool)

    def stop(self) -> None:
        """The job is done: stop its service quietly. Once no job runs on it
        (its last generation's end reached every server, or a few seconds
        passed), the servers first, then the scheduler: each then finds
        nothing running, so neither reports a loss."""
        deadline = time.monotonic() + SERVICE_IDLE_S
        while time.monotonic() < deadline:
            try:
                st = json.loads(_core.service_status(self.address, self.master, 1.0))
            except _core.GradhubError:
                break
            if not st["jobs"] and not any(s["jobs"] for s in st["servers"]):
                break
            time.sleep(0.1)
        stop_procs([p for p in self.service if p.role == "server"])
        stop_procs(self.service)

    def _wait_ready(self, address: str, servers: int, service: list[Proc]) -> str | None:
        deadline = time.monotonic() + SERVICE_READY_S
        seen = "no answer"
        while time.monotonic() < deadline:
            gone = next((p for p in service if p.poll() is not None), None)
            if gone is not None:
                return f"the job's service did not start: {gone.label} exited (code {gone.rc})"
            try:
                st = json.loads(_core.service_status(address, self.master, 1.0))
                seen = f"{len(st['servers'])} of {servers} servers registered"
                if len(st["servers"]) >= servers:
                    return None
            except _core.GradhubError as e:
                seen = str(e)
            time.sleep(0.1)
        return f"the job's service at {address} was not ready within {SERVICE_READY_S:.0f} s ({seen})"
