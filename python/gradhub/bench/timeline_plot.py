"""`gradhub bench timeline-plot`: a window of a merged timeline (`gradhub
timeline merge`) as a picture, one band per worker and server thread:

- each worker: its operations (PUSH_PULL, from the gradient handed over to
  the result applied) above, its chunks' stages below (QUEUED behind higher
  priorities and the credit, SEND until its server has it, RESULT waiting for
  the other workers, the sum and the result in flight);
- each server thread: WAIT_FOR_PUSHERS (first push to last) and FINISH_ROUND.

Many chunks are in flight at once, so each band shows, per millisecond,
how many of its spans are in each stage (stacked, scaled to the band's
busiest moment; the number is on the right).
"""

from __future__ import annotations

import json

COLORS = {"PUSH_PULL": "#4c72b0", "QUEUED": "#999999", "SEND": "#55a868", "RESULT": "#dd8452",
          "WAIT_FOR_PUSHERS": "#8172b3", "FINISH_ROUND": "#c44e52"}


def plot(trace: str, out: str, start_ms: float | None, span_ms: float, title: str = "") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    with open(trace, encoding="utf-8") as f:
        events = [e for e in json.load(f) if e.get("ph") == "X"]
    if not events:
        raise ValueError(f"{trace}: no events")
    t_first = min(e["ts"] for e in events)
    if start_ms is None:  # the middle of the trace
        t_last = max(e["ts"] + e["dur"] for e in events)
        start_ms = ((t_first + t_last) / 2 - t_first) / 1e3 - span_ms / 2
    lo, hi = t_first + start_ms * 1e3, t_first + (start_ms + span_ms) * 1e3
    shown = [e for e in events if e["ts"] < hi and e["ts"] + e["dur"] > lo]
    # Bands: workers (pid < 1e6) then servers, each as its rows.
    rows: dict[tuple, list] = {}
    for e in shown:
        pid = e["pid"]
        if pid >= 1_000_000:
            key = (1, pid - 1_000_000, e["tid"], f"server {pid - 1_000_000} t{e['tid']}")
        elif e["name"] == "PUSH_PULL":
            key = (0, pid, 0, f"worker {pid} ops")
        else:
            key = (0, pid, 1, f"worker {pid} chunks")
        rows.setdefault(key, []).append(e)
    import numpy as np

    keys = sorted(rows)
    bins = max(1, int(span_ms))
    edges = np.linspace(lo, hi, bins + 1)
    fig, ax = plt.subplots(figsize=(12, 0.5 * len(keys) + 1.5))
    for y, k in enumerate(keys):
        stages = [n for n in COLORS if any(e["name"] == n for e in rows[k])]
        counts = []
        for n in stages:
            c = np.zeros(bins)
            for e in rows[k]:
                if e["name"] != n:
                    continue
                # Time of this span in each bin, in bins (so a count of spans in flight).
                a, b = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
                i0, i1 = np.searchsorted(edges, a, "right") - 1, np.searchsorted(edges, b, "left")
                for i in range(max(0, i0), min(bins, i1)):
                    c[i] += (min(b, edges[i + 1]) - max(a, edges[i])) / (edges[i + 1] - edges[i])
            counts.append(c)
        top = max(1e-9, float(np.max(np.sum(counts, axis=0)))) if counts else 1.0
        x = (edges[:-1] - lo) / 1e3
        base = np.full(bins, y + 0.4)
        for n, c in zip(stages, counts):
            h = c / top * 0.8
            ax.fill_between(x, base, base - h, step="post", color=COLORS[n], linewidth=0)
            base = base - h
        ax.text(span_ms * 1.005, y, f"max {top:.0f}", va="center", fontsize=7)
    ax.set_yticks(range(len(keys)))
    ax.set_yticklabels([k[3] for k in keys])
    ax.invert_yaxis()
    ax.set_xlim(0, span_ms)
    ax.set_xlabel(f"ms (from {start_ms:.0f} ms into the trace)")
    ax.legend(handles=[Patch(color=c, label=n) for n, c in COLORS.items()], loc="upper center",
              bbox_to_anchor=(0.5, -0.12 - 0.3 / max(1, len(keys))), ncol=6, fontsize=8)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return f"{len(shown)} events in {len(keys)} rows, {span_ms:g} ms from {start_ms:.0f} ms: {out}"
