"""An emulated cluster on one machine: one network namespace per host, each
joined to a bridge by a veth pair whose two ends are rate-limited with tc
token buckets (the host side shapes its upload, the bridge side its
download, so a server's incast is limited too).

Only private addresses inside namespaces created here are used. Everything is
torn down on exit, also on Ctrl-C/SIGTERM; `cleanup()` removes leftovers of
an earlier run that was killed hard.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass

from gradhub.tools import setting
from gradhub.plan.cluster import parse_rate
from gradhub.plan.theory import tbf_burst

PREFIX = "ghb"
SUBNET = "10.231"


class ClusterError(RuntimeError):
    pass


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(list(argv), capture_output=True, text=True)
    if check and p.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed: {p.stderr.strip() or p.stdout.strip()}")
    return p


def check_available() -> str | None:
    """None if namespaces can be used here, else the reason why not."""
    if os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces and tc); run as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"{PREFIX}probe{os.getpid()}"
    r = _run("ip", "netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"cannot create network namespaces here: {r.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def cleanup(prefix: str = PREFIX) -> list[str]:
    """Remove namespaces and bridges left by earlier runs with this prefix."""
    removed = []
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.strip() else ""
        if ns.startswith(prefix):
            _run("ip", "netns", "del", ns, check=False)
            removed.append(ns)
    for line in _run("ip", "-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith(prefix):
            _run("ip", "link", "del", name, check=False)
            removed.append(name)
    return removed


def link_counters(dev: str | None) -> tuple[int, int] | None:
    """(tx, rx) bytes of a network device in the caller's namespace (inside
    an emulated host, its shaped eth0), or None if there is none."""
    if not dev:
        return None
    try:
        return tuple(int(open(f"/sys/class/net/{dev}/statistics/{c}_bytes").read()) for c in ("tx", "rx"))
    except (OSError, ValueError):
        return None


@dataclass
class Host:
    name: str
    ns: str
    ip: str
    veth: str

    def cmd(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *argv]


class EmulatedCluster:
    """`with EmulatedCluster(["w0", "w1", "s0"], rate="1gbit") as c: c.hosts["w0"].cmd([...])`.

    A host named "sched" (always added, unshaped) runs the scheduler. With
    `racks` (host name -> rack index), each rack's hosts share a bridge of
    their own (the top-of-rack switch, unlimited), joined to the core bridge
    by one veth pair shaped to `core_rate` each way (the rack's oversubscribed
    uplink); `core_links` names each rack's end (tx: the rack's upload)."""

    _count = 0

    def __init__(self, names: list[str], rate: str | None = "1gbit", tag: str | None = None,
                 racks: dict[str, int] | None = None, core_rate: str | None = None):
        why = check_available()
        if why:
            raise ClusterError(why)
        self.rate_bps = parse_rate(rate) if rate else None
        # Unique per cluster: interface deletion in the kernel is asynchronous,
        # so names are never reused within a process (and fit IFNAMSIZ).
        EmulatedCluster._count += 1
        self.tag = tag or f"{os.getpid() % 10000}{EmulatedCluster._count % 100}"
        self.bridge = f"{PREFIX}br{self.tag}"
        self.names = ["sched"] + [n for n in names if n != "sched"]
        self.hosts: dict[str, Host] = {}
        self._old_handlers = {}
        self.racks = dict(racks or {})
        self.core_bps = parse_rate(core_rate) if core_rate else None
        self.core_links: dict[int, str] = {}
        self._rack_devs: list[str] = []

    def __enter__(self) -> "EmulatedCluster":
        for s in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[s] = signal.signal(s, self._on_signal)
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        return self

    def _on_signal(self, signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    def __exit__(self, *exc):
        self.teardown()
        for s, h in self._old_handlers.items():
            signal.signal(s, h)
        return False

    def _build(self):
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "link", "set", self.bridge, "up")
        bridges = {}
        for r in sorted(set(self.racks.values())):
            br, up, down = f"{PREFIX}br{self.tag}r{r}", f"{PREFIX}{self.tag}c{r}", f"{PREFIX}{self.tag}k{r}"
            _run("ip", "link", "add", br, "type", "bridge")
            self._rack_devs += [up, br]
            _run("ip", "link", "set", br, "up")
            _run("ip", "link", "add", up, "type", "veth", "peer", "name", down)
            _run("ip", "link", "set", up, "master", br)
            _run("ip", "link", "set", down, "master", self.bridge)
            for dev in (up, down):
                _run("ip", "link", "set", dev, "up")
                if self.core_bps:
                    self._shape(["tc"], dev, self.core_bps)   # up: the rack's upload; down: its download
            bridges[r] = br
            self.core_links[r] = up
        for i, name in enumerate(self.names):
            ns, veth = f"{PREFIX}{self.tag}{name}", f"{PREFIX}{self.tag}v{i}"
            ip = f"{SUBNET}.{i // 250}.{i % 250 + 1}"
            _run("ip", "netns", "add", ns)
            host = Host(name, ns, ip, veth)
            self.hosts[name] = host
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "link", "set", veth, "master", bridges.get(self.racks.get(name, -1), self.bridge))
            _run("ip", "link", "set", veth, "up")
            _run("ip", "-n", ns, "addr", "add", f"{ip}/16", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            if self.rate_bps and name != "sched":
                self._shape(["ip", "netns", "exec", ns, "tc"], "eth0")   # upload
                self._shape(["tc"], veth)                                # download
        # Let the bridge forward without iptables in the way.
        _run("sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=0", check=False)

    def _shape(self, tc: list[str], dev: str, rate: int | None = None):
        rate = rate or self.rate_bps
        burst = tbf_burst(rate)
        _run(*tc, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate}bit", "burst", str(burst),
             "latency", setting("GRADHUB_BENCH_TBF_LATENCY"))

    def qdisc_drops(self) -> int:
        """Packets the token buckets dropped so far (all hosts, both
        directions): a sign of flows overrunning the emulated links."""
        total = 0
        for h in self.hosts.values():
            if h.name == "sched" or not self.rate_bps:
                continue
            for tc in (["ip", "netns", "exec", h.ns, "tc"], ["tc"]):
                out = _run(*tc, "-s", "qdisc", "show", "dev", "eth0" if len(tc) > 1 else h.veth, check=False).stdout
                total += sum(int(x) for x in re.findall(r"dropped (\d+)", out))
        return total

    def teardown(self):
        for h in list(self.hosts.values()):
            _run("ip", "link", "del", h.veth, check=False)  # synchronous, unlike namespace teardown
            _run("ip", "netns", "del", h.ns, check=False)
        self.hosts.clear()
        for dev in self._rack_devs:
            _run("ip", "link", "del", dev, check=False)
        self._rack_devs.clear()
        _run("ip", "link", "del", self.bridge, check=False)
