"""`gradhub launch -H host1:4,host2:4 ...`: a job across hosts over SSH, the
way horovodrun starts one.

The scheduler runs on this machine, or (`--scheduler-host first`) on the
first worker host, started over ssh like the rest, at that host's address;
one server per worker host (colocated) or per `--server-hosts` host
(CPU-only); `slots` workers per host, ranked host by host. With
`--host-discovery-script` (an elastic job) the hosts are the script's, and
follow it while the job runs (discovery.py). Every remote process is
started by a small bootstrap given on the ssh command line; its environment
(the job token among it) and its command travel over ssh's stdin, so no
other user of either machine can read the token in a process list. Closing that stdin (or the connection dropping)
kills the remote process group; a `TERM` line asks it to stop first.

Before anything starts, every host is checked: reachable over ssh, and
gradhub importable by this Python there; what the checks find (the
scheduler's address, free ports) goes into the job's plan (plan.py), whose
processes are started here (`RemoteProc`) and watched by run.py.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

from .._ports import free_port
from . import discovery
from .elastic import Elastic
from .flags import LaunchOptions
from .hosts import Host, parse_hostfile, parse_hosts
from .local import TOOL, made_up_token
from .plan import Plan, ProcessSpec, Site, forwarded, layout, plan
from .proc import Proc
from .run import run, start_here

# Runs on the remote host (`python -c`): one JSON line on stdin holds the
# environment, the working directory and the command; the command runs in a
# session of its own; a `TERM` line forwards SIGTERM to it, the end of stdin
# (the launcher or the connection gone) SIGKILL, unless "watch" is false (the
# launcher's checks, which send their line and close). Exits with the command's code.
BOOTSTRAP = """\
import json, os, signal, subprocess, sys, threading
job = json.loads(sys.stdin.readline())
env = dict(os.environ); env.update(job["env"])
try:
    os.chdir(job["cwd"])
except OSError:
    pass
try:
    p = subprocess.Popen(job["argv"], env=env, stdin=subprocess.DEVNULL, start_new_session=True)
except OSError as e:
    print(f"gradhub launch: cannot start {job['argv'][0]!r} on this host: {e}", file=sys.stderr)
    sys.exit(127)
def kill(sig):
    try:
        os.killpg(p.pid, sig)
    except OSError:
        pass
def watch():
    for line in sys.stdin:
        if line.strip() == "TERM":
            kill(signal.SIGTERM)
    kill(signal.SIGKILL)
if job["watch"]:
    threading.Thread(target=watch, daemon=True).start()
rc = p.wait()
sys.exit(rc if rc >= 0 else 128 - rc)
"""

class Ssh:
    """How to reach the hosts: the ssh command line before the remote command."""

    def __init__(self, port: int | None, identity: str | None, config: str | None):
        self.argv = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "LogLevel=ERROR", "-T"]
        if config:
            self.argv += ["-F", config]
        if port:
            self.argv += ["-p", str(port)]
        if identity:
            self.argv += ["-i", identity]

    def command(self, host: str) -> list[str]:
        """ssh to `host`, running the bootstrap with this machine's Python."""
        return self.argv + [host, shlex.join([sys.executable, "-c", BOOTSTRAP])]


def _job_line(env: dict[str, str], argv: list[str], watch: bool = True) -> bytes:
    return (json.dumps({"env": forwarded(env), "argv": argv, "cwd": os.getcwd(), "watch": watch}) + "\n").encode()


class RemoteProc(Proc):
    """A process on another host, through ssh and the bootstrap."""

    def __init__(self, label: str, ssh: Ssh, host: str, argv: list[str], env: dict[str, str]):
        super().__init__(label, ssh.command(host), dict(os.environ), stdin=subprocess.PIPE)
        self._stdin_lock = threading.Lock()
        self._remote = (ssh, host, argv, env)
        self._tell(_job_line(env, argv))

    def again(self) -> RemoteProc:
        return RemoteProc(self.label, *self._remote)

    def _tell(self, data: bytes | None) -> None:
        """Write `data` to the bootstrap; None: close its stdin (it kills the process)."""
        stdin = self.p.stdin
        assert stdin is not None
        with self._stdin_lock:
            try:
                if data is None:
                    stdin.close()
                else:
                    stdin.write(data)
                    stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                pass

    def signal(self, sig: int) -> None:
        if sig == signal.SIGTERM:
            self._tell(b"TERM\n")
            return
        self._tell(None)
        super().signal(sig)


# The launcher's check on each host (run by the bootstrap): gradhub imports,
# and, for a scheduler on that host, its address on the route the launcher
# came in by (sshd's SSH_CONNECTION) and a port free there.
PROBE = """\
import json, os, gradhub._core
from gradhub._ports import free_port
seen = os.environ.get("SSH_CONNECTION", "").split()
addr = seen[2] if len(seen) == 4 else None
port = free_port(addr or "0.0.0.0")
store = free_port(addr or "0.0.0.0")
while store == port:
    store = free_port(addr or "0.0.0.0")
print(json.dumps({"addr": addr, "port": port, "store_port": store}))
"""


def _check_host(ssh: Ssh, host: str, env: dict[str, str]) -> tuple[str | None, dict]:
    """Why the job cannot run on `host` (or None), and what the probe found there."""
    probe = [sys.executable, "-c", PROBE]
    try:
        p = subprocess.run(ssh.command(host), input=_job_line(env, probe, watch=False), capture_output=True, timeout=60)
    except subprocess.TimeoutExpired:
        return f"{host}: no answer over ssh within 60 s", {}
    except OSError as e:
        return f"cannot run ssh: {e}", {}
    said = (p.stderr + p.stdout).decode(errors="replace").strip().splitlines()
    tail = said[-1] if said else f"exit code {p.returncode}"
    if p.returncode == 0:
        try:
            return None, json.loads(p.stdout.decode(errors="replace").strip().splitlines()[-1])
        except (ValueError, IndexError):
            return f"{host}: the launcher's check printed nothing it could read ({tail})", {}
    if p.returncode == 255:
        return f"cannot reach {host} over ssh: {tail or 'ssh failed'}", {}
    if p.returncode == 127:
        return f"{host}: no Python at {sys.executable} (gradhub launch runs the same Python path on every host)", {}
    return f"{host}: gradhub is not installed for {sys.executable} there ({tail})", {}


def _bare(host: str) -> str:
    """`host` without user@ or IPv6 brackets: a name or address to connect to."""
    return host.rpartition("@")[2].strip("[]")


def _address_towards(host: str) -> str:
    """This machine's address on the route to `host`."""
    family, _, _, _, addr = socket.getaddrinfo(_bare(host), 22, proto=socket.IPPROTO_UDP)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return s.getsockname()[0]


def _hosts(opts: LaunchOptions) -> tuple[list[Host], dict[str, int] | None]:
    """The worker hosts; and, with --host-discovery-script, the set it found."""
    if opts.host_discovery_script:
        found = discovery.run_script(opts.host_discovery_script, opts.slots_per_host)
        return [Host(h, n) for h, n in found.items()], found
    assert opts.hosts or opts.hostfile
    return (parse_hostfile(opts.hostfile) if opts.hostfile else parse_hosts(opts.hosts)), None


def banner(p: Plan, cpu_servers: bool) -> str:
    """What the launcher says of a plan across hosts before it starts it."""
    sched = p.processes[0]
    return (f"{TOOL}: {'an elastic job on a shared service' if p.elastic else 'scheduler'} on "
            f"{sched.host or 'this machine'} at {p.scheduler}; {len(p.workers)} workers on {', '.join(p.hosts)}; "
            f"{len(p.servers)} {'CPU-only' if cpu_servers else 'colocated'} servers")


def launch_ssh(opts: LaunchOptions) -> int:
    try:
        hosts, found = _hosts(opts)
        lay = layout(opts, hosts)
    except ValueError as e:
        print(f"{TOOL}: {e}", file=sys.stderr)
        return 2
    used = lay.hosts
    ssh = Ssh(opts.ssh_port, opts.ssh_identity_file, opts.ssh_config)
    every = lay.every_host
    with ThreadPoolExecutor(max_workers=min(16, len(every))) as pool:
        checked = list(pool.map(lambda h: _check_host(ssh, h, dict(os.environ)), every))
    problems = [p for p, _ in checked if p]
    remote_sched = opts.scheduler_host == "first"
    try:
        # The scheduler's address: the first host's own (as it saw the
        # launcher's ssh come in), or this machine's on the route to it.
        sched_ip = (checked[0][1].get("addr") or _bare(used[0])) if remote_sched else _address_towards(used[0])
    except OSError as e:
        problems = problems or [f"cannot find this machine's address towards {used[0]}: {e}"]
    if problems:
        for p in problems:
            print(f"{TOOL}: {p}", file=sys.stderr)
        print(f"{TOOL}: nothing was started", file=sys.stderr)
        return 2
    port = opts.port or (checked[0][1]["port"] if remote_sched else free_port())
    sched = f"[{sched_ip}]:{port}" if ":" in sched_ip else f"{sched_ip}:{port}"
    el = Elastic(opts) if opts.elastic else None
    # torch's env:// rendezvous: rank 0's TCPStore on a port free on its host (not for an elastic job).
    first = lay.slots[0][1]
    assert first is not None
    seen = checked[every.index(first)][1]
    store = None if el else (seen.get("addr") or _bare(first), seen["store_port"])
    job = plan(opts, lay, Site(scheduler=sched, environ=dict(os.environ), token=made_up_token(), store=store,
                               elastic=el))
    print(banner(job, lay.cpu_servers), file=sys.stderr, flush=True)

    def start(spec: ProcessSpec) -> Proc:
        if spec.host is None:
            return start_here(spec)
        return RemoteProc(spec.label, ssh, spec.host, list(spec.argv), dict(spec.env))

    follow = None if found is None else (opts.host_discovery_script, opts.slots_per_host, opts.discovery_interval,
                                         found)
    return run(job, start, TOOL, follow)
