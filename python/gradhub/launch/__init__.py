"""`gradhub launch`: a whole job, supervised. Its flags (flags.py) give the
options from which a pure function makes the job's plan (plan.py: every
process, where it runs, its argv and its environment); the launchers start
and watch what the plan lists (run.py): on this machine (local.py) or
across hosts over SSH (ssh.py, hosts from hosts.py, or an elastic job's
from a discovery script: discovery.py; elastic jobs: elastic.py). An srun
step's plan: slurm.py. Output handling: output.py; child processes and
supervision: proc.py."""

from __future__ import annotations

from .proc import Proc, supervise

__all__ = ["Proc", "launch", "supervise"]


def launch(opts) -> int:
    """Run the job the launch options (flags.LaunchOptions) describe: its
    command as every worker; returns the launcher's exit code."""
    if opts.remote:
        from .ssh import launch_ssh

        return launch_ssh(opts)
    from .local import launch_local

    return launch_local(opts)
