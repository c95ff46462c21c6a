"""Autotuning for `DistributedOptimizer` (GRADHUB_AUTOTUNE=1, as Horovod's
HOROVOD_AUTOTUNE): during the first steps of the real job, try settings of
the knobs that decide how gradients travel, time the steps, keep the fastest.

Knobs, tried in this order, each at the best value found so far for the
others (coordinate descent: a model's step time depends on them mostly one at
a time, and a dozen trials fit in the first minute of a job):
- `overlap_forward` (P3's forward overlap): off, on (only when allowed, below);
- `fusion_threshold` (bucket bytes; small gradients travel packed): off,
  64 KiB, 256 KiB, 1 MiB;
- `partition_bytes` (the chunk size of the optimizer's tensors): the job's
  partition, 1/2 and 1/4 of it (never more: the job's partition bounds every
  data frame; start the scheduler with a larger --partition-bytes to try
  larger chunks);
- `credit_bytes` (each connection's window; see docs/architecture.md): 1/2,
  1, 2 and 4 times the configured credit.

A knob the user set (an argument of DistributedOptimizer or its environment
variable) stays as set; a knob that does not apply (forward overlap for an
optimizer it does not support, fusion with a compressor, chunk sizes with the
optimizer on the servers) is not tried. Forward overlap is the one knob that
changes what training does (a parameter holds its old value after step()
until its module's next forward; a model that uses a parameter outside every
module's forward() fails), so it is tried only when the user allowed it:
`overlap_forward="auto"` or GRADHUB_OVERLAP_FORWARD=auto (see `tunable`).

A trial: after switching (between steps, with nothing in flight: pending
updates are applied, new tensors declared, tensors of the old layout
released), one step settles, then `steps_per_trial` steps are timed
(wall-clock between step() calls, i.e. whole iterations); its figure is the
median, maxed over the workers (a synchronous job runs at its slowest
worker's pace), so every worker gets the same number and takes the same
decisions. A setting replaces the best so far only if it is at least 2 %
faster, so the defaults stay unless measurably beaten.

The choice is printed (worker 0) with the step time against the defaults';
GRADHUB_AUTOTUNE_LOG writes a CSV line per trial; GRADHUB_AUTOTUNE_FILE saves
the choice and, when the file is there at the next start (for the same
number of workers and the same parameters), loads it instead of tuning.
"""

from __future__ import annotations

import csv
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch

from .. import api as _api

# Faster by at least this share to replace the best so far.
MIN_GAIN = 0.02
KNOBS = ("overlap_forward", "fusion_threshold", "partition_bytes", "credit_bytes")
_FUSION = (0, 64 << 10, 256 << 10, 1 << 20)
_FILE_VERSION = 1
_TIMES = "gradhub.autotune.step_seconds"


@dataclass(frozen=True)
class Settings:
    overlap_forward: bool
    fusion_threshold: int  # bytes; 0: off
    partition_bytes: int   # bytes per chunk of the optimizer's tensors
    credit_bytes: int      # base credit per connection

    def describe(self) -> str:
        return (f"overlap_forward={'on' if self.overlap_forward else 'off'} "
                f"fusion_threshold={_size(self.fusion_threshold)} partition={_size(self.partition_bytes)} "
                f"credit={_size(self.credit_bytes)}")


def _size(n: int) -> str:
    if n == 0:
        return "off"
    if n % (1 << 20) == 0:
        return f"{n >> 20} MiB"
    if n % (1 << 10) == 0:
        return f"{n >> 10} KiB"
    return f"{n} B"


def tunable(fixed: set, *, overlap_auto: bool, elementwise: bool, on_server: bool, plain: bool,
            declared_ahead: bool) -> set:
    """The knobs autotuning may change for an optimizer: not those the user
    set (`fixed`), and only those that apply. `overlap_auto`: the user
    allowed forward overlap to be tried (overlap_forward="auto"), which
    needs an `elementwise` optimizer (overlap.py) on the workers; `plain`: no
    compressor (fusion packs the wire dtype); `declared_ahead`: every
    tensor is declared at construction (a user's compressor's are not:
    they are declared on first use, in the job's chunks). The servers'
    optimizer state is kept per tensor: no fusion, no other chunks."""
    knobs = set(KNOBS) - set(fixed)
    if not (overlap_auto and elementwise) or on_server:
        knobs.discard("overlap_forward")
    if on_server or not plain:
        knobs.discard("fusion_threshold")
    if on_server or not declared_ahead:
        knobs.discard("partition_bytes")
    return knobs


def candidates(start: Settings, tunable: set, job_partition: int) -> dict:
    """The values each tunable knob is tried at (the start's first)."""
    values = {
        "overlap_forward": [False, True],
        "fusion_threshold": list(_FUSION),
        "partition_bytes": [p for p in (job_partition, job_partition // 2, job_partition // 4) if p >= 64],
        "credit_bytes": [c for c in (start.credit_bytes // 2, start.credit_bytes, 2 * start.credit_bytes,
                                     4 * start.credit_bytes) if c > 0],
    }
    out = {}
    for k in KNOBS:
        if k in tunable:
            v = getattr(start, k)
            out[k] = [v] + [x for x in values[k] if x != v]
    return out


def fingerprint_of(optimizer, process_set) -> dict:
    """What a saved choice must match: the workers and the parameters."""
    ps = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    return {"workers": process_set.size(), "tensors": len(ps),
            "bytes": sum(p.numel() * p.element_size() for p in ps)}


def load(path: str, want: dict, job_partition: int) -> Settings | None:
    """The settings saved at `path` for a job like this one, or None (with
    the reason printed) when there is none or it was tuned for another."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            saved = json.load(f)
        if saved.get("version") != _FILE_VERSION:
            raise ValueError(f"version {saved.get('version')!r}, this gradhub writes {_FILE_VERSION}")
        st = saved["settings"]
        s = Settings(overlap_forward=bool(st["overlap_forward"]), fusion_threshold=int(st["fusion_threshold"]),
                     partition_bytes=int(st["partition_bytes"]), credit_bytes=int(st["credit_bytes"]))
        if not (0 < s.partition_bytes <= job_partition) or s.credit_bytes <= 0 or s.fusion_threshold < 0:
            raise ValueError(f"settings out of range for this job (partition at most {job_partition} bytes)")
    except (OSError, ValueError, KeyError, TypeError) as e:
        say(f"autotune: cannot use {path} ({e}); tuning again")
        return None
    if saved.get("job") != want:
        say(f"autotune: {path} was tuned for {saved.get('job')}, this job is {want}; tuning again")
        return None
    return s


def say(msg: str) -> None:
    print(f"[gradhub worker] {msg}", file=sys.stderr, flush=True)


class Autotuner:
    """Drives the trials from `after_step()`, which the optimizer calls at the
    end of every step()."""

    def __init__(self, opt, start: Settings, tunable: set, job_partition: int, *, warmup: int, steps: int,
                 log: str | None, file: str | None):
        self.opt = opt
        self.values = candidates(start, tunable, job_partition)
        self.queue = [(k, v) for k in self.values for v in self.values[k][1:]]
        self.start = self.current = self.best = start
        self.best_time: float | None = None
        self.start_time: float | None = None
        self.steps, self.skip = steps, warmup
        self.samples: list[float] = []
        self.last: float | None = None
        self.trials: list[dict] = []
        self.done = not self.queue
        self.file = file
        self.lead = opt._gh_ps.rank() == 0
        self.log = open(log, "w", newline="") if (log and self.lead) else None
        if self.log is not None:
            self._csv = csv.writer(self.log)
            self._csv.writerow(["trial", *KNOBS, "step_seconds", "best"])
        if self.lead:
            fixed = [k for k in KNOBS if k not in self.values]
            say(f"autotune: {len(self.queue) + 1} trials of {steps} steps after {warmup} warm-up steps, "
                 f"from {start.describe()}" + (f"; fixed: {', '.join(fixed)}" if fixed else ""))

    def after_step(self) -> None:
        if self.done:
            return
        now = time.perf_counter()
        last, self.last = self.last, now
        if self.skip > 0 or last is None:
            self.skip = max(0, self.skip - 1)
            return
        self.samples.append(now - last)
        if len(self.samples) < self.steps:
            return
        t = self._slowest(statistics.median(self.samples))
        self.samples = []
        if self.start_time is None:
            self.start_time = t
        better = self.best_time is None or t < self.best_time * (1 - MIN_GAIN)
        if better:
            self.best, self.best_time = self.current, t
        self._record(t, better)
        nxt = None
        while self.queue and nxt is None:
            k, v = self.queue.pop(0)
            cand = replace(self.best, **{k: v})
            nxt = cand if cand != self.current and cand not in [tr["settings"] for tr in self.trials] else None
        if nxt is None:
            self._finish()
            return
        self._apply(nxt)
        self.current, self.skip = nxt, 1
        self.last = time.perf_counter()

    def _slowest(self, t: float) -> float:
        """The slowest worker's figure, on every worker (one sum of a vector
        holding each worker's in its slot)."""
        from .compression import Compression
        from .ops import Sum, _reduce_async

        ps = self.opt._gh_ps
        v = torch.zeros(ps.size(), dtype=torch.float64)
        v[ps.rank()] = t
        # Without the public allreduce's shape check: the same shape everywhere, by construction.
        return float(_reduce_async(v, _TIMES, Sum, 0, Compression.none, None, 1.0, 1.0, ps).wait().max())

    def _record(self, t: float, better: bool) -> None:
        n = len(self.trials) + 1
        self.trials.append({"settings": self.current, "step_seconds": t})
        if self.lead:
            say(f"autotune: trial {n}: {self.current.describe()}: {t * 1e3:.1f} ms/step"
                 f"{' (best so far)' if better else ''}")
        if self.log is not None:
            self._csv.writerow([n, *(getattr(self.current, k) for k in KNOBS), f"{t:.6f}", int(better)])
            self.log.flush()

    def _apply(self, s: Settings) -> None:
        apply(self.opt, s)

    def _finish(self) -> None:
        self.done = True
        if self.best != self.current:
            self._apply(self.best)
            self.current = self.best
        _api.release(_TIMES)  # collective, like every decision here
        if self.lead:
            gain = self.start_time / self.best_time if self.best_time else 1.0
            say(f"autotune: chose {self.best.describe()}: {self.best_time * 1e3:.1f} ms/step against "
                 f"{self.start_time * 1e3:.1f} with the starting settings ({gain:.2f}x), after {len(self.trials)} "
                 f"trials")
            if self.file:
                save(self.file, fingerprint_of(self.opt, self.opt._gh_ps), self.best, self.best_time, self.start_time)
                say(f"autotune: saved to {self.file}")
        if self.log is not None:
            self.log.close()
            self.log = None


def save(path: str, job: dict, s: Settings, step_seconds: float, start_seconds: float) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"version": _FILE_VERSION, "job": job, "settings": asdict(s), "step_seconds": step_seconds,
                   "starting_step_seconds": start_seconds}, f, indent=1)
    os.replace(tmp, path)


def apply(opt, s: Settings) -> None:
    """Switch `opt` to settings `s` between steps: pending updates applied
    first, then the new layout declared (collective) and the old released."""
    opt.finish()
    opt._gh_mode.switch_overlap(s.overlap_forward)
    partition = 0 if s.partition_bytes == _api.partition_bytes() else s.partition_bytes  # 0: the job's
    if (s.fusion_threshold, partition) != (opt._gh_fusion_threshold, opt._gh_partition):
        opt._gh_relayout(s.fusion_threshold, partition)
    if _api.credit_bytes() != s.credit_bytes:
        _api.set_credit(s.credit_bytes)

