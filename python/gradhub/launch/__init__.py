"""`gradhub launch`: a whole job, supervised, on this machine (local.py) or
across hosts over SSH (ssh.py, hosts from hosts.py, or an elastic job's
from a discovery script: discovery.py). Output handling:
output.py; child processes and supervision: proc.py."""

from __future__ import annotations

from .proc import Proc, supervise

__all__ = ["Proc", "launch", "supervise"]


def launch(args, command: list[str]) -> int:
    """Run `command` as every worker of a job the launch flags describe;
    returns the launcher's exit code."""
    if any(getattr(args, a, None) for a in ("hosts", "hostfile", "host_discovery_script")):
        from .ssh import launch_ssh

        return launch_ssh(args, command)
    from .local import launch_local

    return launch_local(args, command)
