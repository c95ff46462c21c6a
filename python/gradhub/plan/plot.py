"""`gradhub plan --plot FILE.png|svg`: the plan as a picture.

Predicted samples/s against the number of CPU-only machines k, one point
per k (the best layout at that k: colocated or not, host stage on or off,
with the best options simulated there), DDP on the GPU machines alone as a
horizontal line, and the plan's first choice marked and labelled. With
prices, a second panel: cost per million samples against k, DDP's as a
line. Units are the planner's (samples/s; a built-in transformer's sample
is a token, as its batch is).

The points reuse every simulation the search ran (`plan(..., seen=...)`);
the k's the pruned search skipped (past the compute bound, between grid
points) are simulated at the first choice's options, so every k from 0 to
--cpu-available has its point.

matplotlib is imported only here, lazily, on the Agg canvas (no pyplot, no
global backend): the planner works without it, and `--plot` then fails
with one line naming `pip install gradhub[bench]`. SVGs keep their text as
text (searchable, diffable) and carry no date."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from .cluster import Cluster, Options, Prices
from .costs import Costs
from .profile import SimProfile
from .search import Choice
from .sim import Result, simulate_gradhub

NEEDS = "--plot needs matplotlib: pip install gradhub[bench]"
FORMATS = ("png", "svg")
DDP_LABEL = "DDP"
X_LABEL = "CPU-only machines (k)"
Y_LABEL = "predicted samples/s"
COST_LABEL = "cost per million samples"


def in_units(label: str, unit: str = "samples") -> str:
    """A label with the profile's unit for "samples" (images, tokens)."""
    return label.replace("samples", unit)


def check_path(path: str) -> None:
    """ValueError unless `path` ends in a format the plot writes."""
    if Path(path).suffix.lower().lstrip(".") not in FORMATS:
        raise ValueError(f"--plot {path}: expected a .png or .svg file")


def matplotlib_or_error():
    """matplotlib, or ValueError(NEEDS) (one line) where it is not installed."""
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg   # noqa: F401
        from matplotlib.figure import Figure   # noqa: F401
    except ImportError:
        raise ValueError(NEEDS) from None
    return matplotlib


@dataclass
class Point:
    k: int
    cluster: Cluster
    options: Options
    result: Result
    searched: bool          # simulated by the search (else filled in at the first choice's options)

    @property
    def samples_per_s(self) -> float:
        return self.result.samples_per_s


def points(profile: SimProfile, base: Cluster, costs: Costs, max_cpu: int, seen: dict,
           first: Choice | None) -> list[Point]:
    """One point per k in 0..max_cpu: the fastest of every (layout, options)
    the search simulated at that k (`seen`: plan's cache), else the first
    choice's options simulated there, colocated or not."""
    best: dict[int, Point] = {}
    for (c, o), r in seen.items():
        k = c.cpu_servers
        if k <= max_cpu and (k not in best or r.samples_per_s > best[k].samples_per_s):
            best[k] = Point(k, c, o, r, True)
    start = first.options if first is not None else Options()
    for k in range(max_cpu + 1):
        if k in best:
            continue
        for colocated in ((True, False) if k else (True,)):
            c = replace(base, cpu_servers=k, colocated=colocated)
            r = simulate_gradhub(profile, c, start, costs)
            if k not in best or r.samples_per_s > best[k].samples_per_s:
                best[k] = Point(k, c, start, r, False)
    return [best[k] for k in sorted(best)]


def _cost(prices: Prices, c: Cluster, samples_per_s: float) -> float:
    """Price per million samples."""
    return prices.per_hour(c) / 3600 / samples_per_s * 1e6


def figure(title: str, pts: list[Point], ddp: Result, base: Cluster, first: Choice | None,
           prices: Prices | None = None, verdict: str = "", bound: float = 0.0, unit: str = "samples"):
    """The matplotlib Figure (on an Agg canvas): samples/s against k, DDP's
    line, the first choice marked; with prices a second panel of cost per
    million samples. `bound`: samples/s with every GPU busy (drawn if > 0)."""
    matplotlib_or_error()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    with_cost = prices is not None and prices.per_hour(base) > 0
    fig = Figure(figsize=(7, 6.5 if with_cost else 4.2))
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 1, sharex=True) if with_cost else [fig.subplots()]
    ks = [p.k for p in pts]
    gpu_only = replace(base, cpu_servers=0)

    ax = axes[0]
    ax.plot(ks, [p.samples_per_s for p in pts], marker="o", markersize=4, color="C0",
            label="gradhub, best layout at k")
    ax.axhline(ddp.samples_per_s, color="C3", linestyle="--", label=f"{DDP_LABEL} ({ddp.samples_per_s:.0f})")
    if bound:
        ax.axhline(bound, color="0.5", linestyle=":", linewidth=1, label="every GPU busy (compute bound)")
    ax.set_ylabel(in_units(Y_LABEL, unit))
    ax.set_ylim(bottom=0, top=max([p.samples_per_s for p in pts] + [ddp.samples_per_s, bound]) * 1.12)
    if first is not None:
        k = first.cluster.cpu_servers
        where = "" if k == 0 or first.cluster.colocated else ", not colocated"
        text = (f"plan: k={k}{where}\n{first.result.samples_per_s:.0f} {unit}/s, "
                f"{first.result.samples_per_s / ddp.samples_per_s:.2f}x DDP")
        ax.plot([k], [first.result.samples_per_s], marker="*", markersize=16, color="C2", linestyle="none",
                label="plan's choice", zorder=5)
        ax.annotate(text, (k, first.result.samples_per_s), xytext=(0, -34), textcoords="offset points",
                    ha="center" if 0 < k < max(ks) else ("left" if k == 0 else "right"), fontsize=8)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, alpha=0.3)
    ax.set_title(title + (f"\nverdict: use {verdict}" if verdict else ""), fontsize=9)

    if with_cost:
        cx = axes[1]
        cx.plot(ks, [_cost(prices, p.cluster, p.samples_per_s) for p in pts], marker="o", markersize=4,
                color="C0", label="gradhub, best layout at k")
        ddp_cost = _cost(prices, gpu_only, ddp.samples_per_s)
        cx.axhline(ddp_cost, color="C3", linestyle="--", label=f"{DDP_LABEL} ({ddp_cost:.3f})")
        if first is not None:
            cx.plot([first.cluster.cpu_servers], [_cost(prices, first.cluster, first.result.samples_per_s)],
                    marker="*", markersize=16, color="C2", linestyle="none", label="plan's choice", zorder=5)
        cx.set_ylabel(in_units(COST_LABEL, unit))
        cx.legend(fontsize=8, loc="upper right")
        cx.grid(True, alpha=0.3)
    axes[-1].set_xlabel(X_LABEL)
    if len(ks) <= 16:
        axes[-1].set_xticks(ks)
    fig.tight_layout()
    return fig


def save(fig, path: str) -> None:
    """PNG (dpi 100) or SVG (text kept as text, no date, stable ids)."""
    import matplotlib

    fmt = Path(path).suffix.lower().lstrip(".")
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "gradhub-plan"}):
        fig.savefig(path, format=fmt, dpi=100, metadata={"Date": None} if fmt == "svg" else None)


def draw(path: str, profile: SimProfile, base: Cluster, costs: Costs, max_cpu: int, seen: dict,
         choices: list[Choice], ddp: Result, prices: Prices | None = None, verdict: str = "", title: str = ""):
    """The plan's figure, written to `path` (.png or .svg); returns the Figure."""
    check_path(path)
    first = choices[0] if choices else None
    pts = points(profile, base, costs, max_cpu, seen, first)
    fig = figure(title or f"{profile.name} on {base.hosts} GPU machines x {base.workers_per_host} GPUs",
                 pts, ddp, base, first, prices, verdict,
                 base.workers * profile.batch / profile.compute_s if profile.compute_s > 0 else 0.0, profile.unit)
    save(fig, path)
    return fig
