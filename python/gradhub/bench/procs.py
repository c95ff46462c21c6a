"""What a benchmark reads of a process from /proc: its resident memory
and its thread count (`gradhub bench core` state and hostile)."""


def rss_mb(pid: int) -> float:
    """Resident memory of process `pid` in MB (from /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def proc_threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return -1
