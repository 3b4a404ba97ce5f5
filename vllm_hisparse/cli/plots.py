"""The CLI's figures (matplotlib, drawn off screen): ``replay --plot`` and ``simulate --plot``."""

from __future__ import annotations

import textwrap

# One style per replay policy; markers differ in shape and size so that coinciding curves
# (the tuned policy and LRU often agree exactly) stay visible on top of each other.
_POLICY_STYLE = {
    "hisparse": dict(marker="o", markersize=9, linewidth=2.5, zorder=3),
    "lru": dict(marker="x", markersize=7, linewidth=1.2, linestyle="--", zorder=4),
    "fifo": dict(marker="s", markersize=5, linewidth=1.2),
    "random": dict(marker="^", markersize=5, linewidth=1.2),
    "belady": dict(marker="v", markersize=5, linewidth=1.2, linestyle=":"),
}
# The run without the connector is a wide pale band under the other: where both runs agree
# the blue line lies inside it, both visible.
_RUN_STYLE = {"without connector": dict(color="tab:gray", linewidth=4, alpha=0.45),
              "with connector": dict(color="tab:blue", linewidth=1.2)}


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ValueError("--plot needs matplotlib (pip install matplotlib)") from exc
    return plt


def replay_plot(path: str, policies, capacities, rate, source: str) -> None:
    """Miss rate (%) against hot-region rows, one curve per policy. ``rate``:
    ``{(policy, capacity): miss fraction}``. The x axis is logarithmic when the capacities
    span a factor of 4 or more (they are usually doublings)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in policies:
        ax.plot(capacities, [100 * rate[(p, c)] for c in capacities], label=p,
                **_POLICY_STYLE.get(p, dict(marker="o")))
    if len(capacities) > 1 and capacities[-1] >= 4 * capacities[0]:
        ax.set_xscale("log", base=2)
        ax.set_xticks(capacities, [str(c) for c in capacities])
        ax.minorticks_off()
    ax.set_xlabel("hot region (rows per request)")
    ax.set_ylabel("miss rate (% of host-backed selections)")
    ax.set_title("\n".join(textwrap.wrap(f"replacement policies: {source}", 70)), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(title="policy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _rolling_rate(num, den, window: int) -> list[float]:
    """Percent ``sum(num) / sum(den)`` over the last ``window`` steps (nan where den is 0)."""
    cum_num, cum_den = [0], [0]
    for n, d in zip(num, den):
        cum_num.append(cum_num[-1] + n)
        cum_den.append(cum_den[-1] + d)
    out = []
    for i in range(1, len(cum_num)):
        lo = max(0, i - window)
        d = cum_den[i] - cum_den[lo]
        out.append(100 * (cum_num[i] - cum_num[lo]) / d if d else float("nan"))
    return out


def simulate_plot(path: str, series: dict, title: str) -> None:
    """Per step, for each run: running requests, free device blocks, and (with the
    connector) the hot hit rate and miss rate over a rolling window of steps.

    ``series``: label -> dict of equal-length lists ``step``, ``running``, ``free_blocks``,
    ``resident``, ``hot_hits``, ``misses`` (the last three: counts of that step)."""
    plt = _pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    longest = max((len(s["step"]) for s in series.values()), default=1)
    window = max(1, longest // 50)
    for label, s in series.items():
        style = _RUN_STYLE.get(label, dict(linewidth=1.2))
        color = style.get("color")
        axes[0].plot(s["step"], s["running"], label=label, **style)
        axes[1].plot(s["step"], s["free_blocks"], label=label, **style)
        if sum(s["hot_hits"]) + sum(s["misses"]):
            host = [h + m for h, m in zip(s["hot_hits"], s["misses"])]
            every = [r + h for r, h in zip(s["resident"], host)]
            axes[2].plot(s["step"], _rolling_rate(s["hot_hits"], host, window), color=color,
                         label=f"{label}: hot hit rate (of host-backed selections)")
            axes[2].plot(s["step"], _rolling_rate(s["misses"], every, window), color=color,
                         linestyle="--", label=f"{label}: miss rate (of all selections)")
    axes[0].set_ylabel("running requests")
    axes[1].set_ylabel("free device blocks")
    axes[2].set_ylabel(f"% (rolling {window} steps)")
    axes[2].set_ylim(-2, 102)
    axes[2].set_xlabel("scheduler step")
    axes[2].set_title("hot hit and miss rates" + (
        " (without the connector every selection is resident: no hits, no misses)"
        if "without connector" in series else ""), fontsize=8, loc="left")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="center right" if ax is axes[2] else "best")
    fig.suptitle("\n".join(textwrap.wrap(title, 90)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
