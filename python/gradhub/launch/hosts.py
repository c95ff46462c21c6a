"""Host specs of a multi-host launch, as horovodrun takes them: `-H
host1:4,host2:4`, a hostfile (`host slots=4` or `host:4` per line, `#`
comments), `--server-hosts h3,h4`. Parsing only; a malformed spec is a
ValueError that says what is wrong and where."""

from __future__ import annotations

import re
from dataclasses import dataclass

# A host name or IPv4 address, or a bracketed IPv6 address; an optional user@.
_HOST = re.compile(r"^(?:[A-Za-z0-9._-]+@)?(?:[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])$")


@dataclass(frozen=True)
class Host:
    name: str      # as given to ssh (may carry user@)
    slots: int     # worker processes on it


def _host(name: str, where: str) -> str:
    if not _HOST.match(name):
        raise ValueError(f"{where}: {name!r} is not a host name or address")
    return name


def _slots(text: str, where: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"{where}: slots {text!r} is not a whole number") from None
    if n < 1:
        raise ValueError(f"{where}: a host needs at least one slot, not {n}")
    return n


def _entry(item: str, where: str) -> Host:
    """`host` (one slot), `host:N` or `host slots=N`."""
    item = item.strip()
    m = re.match(r"^(\S+)\s+slots\s*=\s*(\S+)$", item)
    if m:
        return Host(_host(m.group(1), where), _slots(m.group(2), where))
    if item.startswith("[") and "]" in item:  # [v6]:N
        addr, _, rest = item.partition("]")
        return Host(_host(addr + "]", where), _slots(rest[1:], where) if rest.startswith(":") else 1)
    name, sep, slots = item.rpartition(":")
    if not sep:
        return Host(_host(item, where), 1)
    return Host(_host(name, where), _slots(slots, where))


def _unique(hosts: list[Host], where: str) -> list[Host]:
    seen: set[str] = set()
    for h in hosts:
        if h.name in seen:
            raise ValueError(f"{where}: host {h.name} is listed twice (give it its slots once)")
        seen.add(h.name)
    return hosts


def parse_hosts(spec: str) -> list[Host]:
    """`-H host1:4,host2:4`."""
    items = [i for i in spec.split(",")]
    if not spec.strip() or any(not i.strip() for i in items):
        raise ValueError(f"-H {spec!r}: expected host:slots[,host:slots...], e.g. -H node1:4,node2:4")
    return _unique([_entry(i, f"-H {spec!r}") for i in items], f"-H {spec!r}")


def parse_hostfile(path: str) -> list[Host]:
    """A hostfile: one host per line, `host slots=N` or `host:N`; `#` comments."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"--hostfile {path}: cannot read it: {e.strerror}") from None
    hosts = []
    for n, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if line:
            hosts.append(_entry(line, f"{path}, line {n}"))
    if not hosts:
        raise ValueError(f"--hostfile {path}: no hosts in it")
    return _unique(hosts, f"--hostfile {path}")


def parse_server_hosts(spec: str) -> list[str]:
    """`--server-hosts h3,h4`: one CPU-only server on each."""
    items = [i.strip() for i in spec.split(",")]
    if any(not i for i in items):
        raise ValueError(f"--server-hosts {spec!r}: expected host[,host...]")
    names = [_host(i, f"--server-hosts {spec!r}") for i in items]
    if len(set(names)) != len(names):
        raise ValueError(f"--server-hosts {spec!r}: a host is listed twice")
    return names


def worker_slots(hosts: list[Host], workers: int | None) -> list[tuple[int, Host, int]]:
    """(rank, host, local rank) of every worker, host by host; `workers`
    (default: every slot) may leave the last slots empty."""
    total = sum(h.slots for h in hosts)
    n = total if workers is None else workers
    if n < 1 or n > total:
        raise ValueError(f"-w {n}: the hosts have {total} slots; ask for 1 to {total} workers")
    out = []
    for h in hosts:
        for local in range(h.slots):
            if len(out) < n:
                out.append((len(out), h, local))
    return out
