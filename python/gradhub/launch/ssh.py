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
gradhub importable by this Python there.
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
from .hosts import Host, parse_hostfile, parse_hosts, parse_server_hosts, worker_slots
from . import discovery, elastic
from .local import job_env, node_env, scheduler_argv, server_argv, torch_rendezvous_env
from .proc import Proc, supervise

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

# Variables that describe this login, not the job: the remote login has its own.
_LOCAL_ONLY = {"HOME", "USER", "LOGNAME", "SHELL", "HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "TERM", "DISPLAY",
               "MAIL", "TMUX", "STY", "LS_COLORS", "OLDPWD", "INVOCATION_ID", "JOURNAL_STREAM"}
_LOCAL_PREFIXES = ("SSH_", "XDG_", "DBUS_")


def forwarded(env: dict[str, str]) -> dict[str, str]:
    """The part of the launcher's environment a remote process gets."""
    return {k: v for k, v in env.items() if k not in _LOCAL_ONLY and not k.startswith(_LOCAL_PREFIXES)}


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


def _hosts(args) -> tuple[list[Host], dict[str, int] | None]:
    """The worker hosts; and, with --host-discovery-script, the set it found."""
    if args.host_discovery_script:
        found = discovery.run_script(args.host_discovery_script, args.slots_per_host)
        return [Host(h, n) for h, n in found.items()], found
    return (parse_hostfile(args.hostfile) if args.hostfile else parse_hosts(args.hosts)), None


def launch_ssh(args, command: list[str]) -> int:
    tool = "gradhub launch"
    try:
        hosts, found = _hosts(args)
        server_hosts = parse_server_hosts(args.server_hosts) if args.server_hosts else []
        n = args.workers
        if found is not None and n is None:  # every slot found, up to --max-workers
            n = min(sum(found.values()), args.max_workers or sum(found.values()))
        slots = worker_slots(hosts, n)
        problem = elastic.check(args, len(slots))
        if problem:
            raise ValueError(problem)
    except ValueError as e:
        print(f"{tool}: {e}", file=sys.stderr)
        return 2
    used = sorted({h.name for _, h, _ in slots}, key=[h.name for h in hosts].index)
    servers = server_hosts or used
    ssh = Ssh(args.ssh_port, args.ssh_identity_file, args.ssh_config)
    every = list(dict.fromkeys(used + servers))
    with ThreadPoolExecutor(max_workers=min(16, len(every))) as pool:
        checked = list(pool.map(lambda h: _check_host(ssh, h, dict(os.environ)), every))
    problems = [p for p, _ in checked if p]
    remote_sched = args.scheduler_host == "first"
    try:
        # The scheduler's address: the first host's own (as it saw the
        # launcher's ssh come in), or this machine's on the route to it.
        sched_ip = (checked[0][1].get("addr") or _bare(used[0])) if remote_sched else _address_towards(used[0])
    except OSError as e:
        problems = problems or [f"cannot find this machine's address towards {used[0]}: {e}"]
    if problems:
        for p in problems:
            print(f"{tool}: {p}", file=sys.stderr)
        print(f"{tool}: nothing was started", file=sys.stderr)
        return 2
    port = args.port or (checked[0][1]["port"] if remote_sched else free_port())
    sched = f"[{sched_ip}]:{port}" if ":" in sched_ip else f"{sched_ip}:{port}"
    base = job_env(args, sched, len(slots), len(servers))
    el = elastic.Elastic(args) if args.min_workers is not None else None
    svc_env = el.service_env(base) if el else base
    print(f"{tool}: {'an elastic job on a shared service' if el else 'scheduler'} on "
          f"{used[0] if remote_sched else 'this machine'} at {sched}; {len(slots)} workers on {', '.join(used)}; "
          f"{len(servers)} {'CPU-only' if server_hosts else 'colocated'} servers", file=sys.stderr, flush=True)
    sched_argv = scheduler_argv(args, sched, el is not None)
    sched_env = {**svc_env, "GRADHUB_ROLE": "scheduler"}
    procs: list[Proc] = [RemoteProc(f"scheduler@{used[0]}", ssh, used[0], sched_argv, sched_env) if remote_sched
                         else Proc("scheduler", sched_argv, sched_env)]
    for s, host in enumerate(servers):
        argv = server_argv(args, not server_hosts, None if el else s)
        procs.append(RemoteProc(f"server {s}@{host}", ssh, host, argv, {**svc_env, "GRADHUB_ROLE": "server"}))
    rc = el.ready(sched, len(servers), procs, tool) if el else None
    if rc is not None:
        return rc
    per_host = {h: sum(1 for _, x, _ in slots if x.name == h) for h in used}
    # torch's env:// rendezvous: rank 0's TCPStore on a port free on its host (not for an elastic job).
    first = min(slots, key=lambda s: s[0])[1].name
    seen = checked[every.index(first)][1]
    torch_env = {} if el else torch_rendezvous_env(seen.get("addr") or _bare(first), seen["store_port"], len(slots))
    workers = []
    for rank, host, local in slots:
        n = str(per_host[host.name])
        env = {**base, **torch_env, **node_env(used.index(host.name), len(used)), "GRADHUB_ROLE": "worker",
               "GRADHUB_RANK": str(rank),
               "GRADHUB_LOCAL_RANK": str(local), "GRADHUB_LOCAL_SIZE": n, "LOCAL_RANK": str(local),
               "LOCAL_WORLD_SIZE": n}
        if torch_env:
            env["RANK"] = str(rank)
        workers.append(RemoteProc(f"worker {rank}@{host.name}", ssh, host.name, command,
                                  el.worker_env(env) if el else env))
    procs += workers
    if el is None:
        return supervise(procs, workers, tool)
    more = iter(range(len(slots), 1 << 30))

    def start(host: str) -> Proc:
        """A worker joining the running job on `host` (an elastic job's local ranks are the scheduler's)."""
        rank = next(more)
        env = {**base, "GRADHUB_ROLE": "worker", "GRADHUB_RANK": str(rank)}
        return RemoteProc(f"worker {rank}@{host}", ssh, host, command, el.worker_env(env))

    def grow(host: str) -> Proc:
        """A worker on a discovered free slot (the follower adds it to `workers`)."""
        p = start(host)
        procs.append(p)
        return p

    most = el.max_workers or len(slots)
    retired: set[Proc] = set()  # workers the follower stopped: their hosts left
    follower = None
    if found is not None:
        poller = discovery.Poller(args.host_discovery_script, args.slots_per_host, args.discovery_interval, found,
                                  tool).start()
        follower = discovery.Follower(poller, workers, most, grow, retired.add, tool)

    def replace(lost: Proc) -> Proc | None:
        """A new worker for `lost`: on its host, or (a discovery job) a listed host with a free slot."""
        host = lost.label.split("@", 1)[1]
        if follower is not None:
            free = follower.free_host(prefer=host)
            return start(free) if free is not None else None
        return start(host)

    try:
        return supervise(procs, workers, tool, min_workers=el.min_workers,
                         replace=replace if el.max_workers is not None else None, max_workers=most,
                         tick=follower.tick if follower else None, retired=retired, stop_service=el.stop)
    finally:
        if follower is not None:
            follower.poller.stop()
