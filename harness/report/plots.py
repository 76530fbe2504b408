"""The report's PNG plots (matplotlib, optional: without it the report says so and has none)."""

from __future__ import annotations

from pathlib import Path

from harness.bench import SyncRow


def rows_by_path(rows: list[SyncRow]) -> dict[tuple[str, int], list[SyncRow]]:
    """The rows of each (path, receivers), in the order they came."""
    out: dict[tuple[str, int], list[SyncRow]] = {}
    for r in rows:
        out.setdefault((r.path, r.receivers), []).append(r)
    return out


def pyplot():
    """matplotlib's pyplot, drawing to files only (the Agg backend): imported when a plot is made."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> None:
    """Writes `fig` to `path` as every plot of the reports is written (tight layout, 110 dpi) and frees it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_throughput(rows: list[SyncRow], path: Path) -> bool:
    if not rows:
        return False
    plt = pyplot()

    # Left: what each path achieves, its ceiling dashed in the same colour. Right: the ratio, which is
    # what a gate compares (ceilings differ by 10x between paths, so the left panel is log-scaled).
    fig, (bw, ratio) = plt.subplots(1, 2, figsize=(10, 3.8))
    for (name, rx), group in rows_by_path(rows).items():
        xs = [r.size_bytes / 2**20 for r in group]
        (line,) = bw.plot(xs, [r.algbw_gbs for r in group], marker="o", label=f"{name} {rx}rx")
        bw.plot(xs, [r.ceiling_gbs for r in group], linestyle="--", alpha=0.5, color=line.get_color())
        ratio.plot(xs, [r.ratio for r in group], marker="o", color=line.get_color(), label=f"{name} {rx}rx")
    for ax in (bw, ratio):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("payload (MiB)")
        ax.grid(alpha=0.3)
    bw.set_yscale("log")
    bw.set_ylabel("GB/s (dashed: ceiling)")
    bw.set_title("algbw per path")
    ratio.set_ylabel("algbw / ceiling")
    ratio.set_title("ratio to the transport's own ceiling")
    ratio.axhline(1.0, color="grey", linewidth=0.8)
    ratio.legend(fontsize=7)
    save_figure(fig, path)
    return True


def plot_breakdown(rows: list[SyncRow], path: Path) -> bool:
    """One stacked bar per row: the critical path of its median push, part by part (harness.bench.BAR_PARTS),
    with the ceiling's time for the same bytes as a tick."""
    rows = [r for r in rows if r.parts]
    if not rows:
        return False
    plt = pyplot()

    from harness.bench import BAR_PARTS

    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(rows) + 2), 4.2))
    labels = [f"{r.path}\n{r.receivers}rx {r.size_bytes / 2**20:.0f}M" for r in rows]
    bottom = [0.0] * len(rows)
    colours = plt.get_cmap("tab10")
    for k, part in enumerate(BAR_PARTS):
        heights = [r.parts.get(part, 0.0) * 1e3 for r in rows]
        ax.bar(
            labels, heights, bottom=bottom, label=part, color=colours(k) if part != "other" else "lightgrey"
        )
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ceilings = [r.size_bytes / r.ceiling_gbs / 1e6 if r.ceiling_gbs else None for r in rows]
    xs = [i for i, c in enumerate(ceilings) if c]
    ax.scatter(xs, [ceilings[i] for i in xs], marker="_", s=600, color="black", zorder=3, label="ceiling")
    ax.set_ylabel("ms (median push)")
    ax.set_title("where a sync's time goes (critical path)")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=7, ncol=2)
    save_figure(fig, path)
    return True
