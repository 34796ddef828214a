"""BENCHMARKS.md's plots, redrawn from the figures in docs/benchmarks.json (needs matplotlib):

    pip install matplotlib && python scripts/plot_benchmarks.py   # docs/throughput.png, docs/latency.png

throughput.png: output tok/s of upstream nano-vllm and nanovllm by number of requests, per model, with the
floor where one is worked out. latency.png: ms per decode step against concurrent streams, per model, with
the weight-read floor. Each point carries the date and commit of the run that measured it."""

import argparse
import json
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
ENGINES = (("upstream", "upstream nano-vllm", "#9a9a9a"), ("nanovllm", "nanovllm", "#1f6fb4"))


def plot_throughput(data: dict, out: Path) -> None:
    import matplotlib.pyplot as plt

    models = [m for m in data if m != "unit"]
    widths = [len(data[m]["points"]) for m in models]
    fig, axes = plt.subplots(1, len(models), figsize=(9, 4.2), width_ratios=widths)
    for ax, model in zip(axes, models):
        run, points = data[model], data[model]["points"]
        xs = range(len(points))
        for i, (key, name, color) in enumerate(ENGINES):
            bars = ax.bar([x + (i - 0.5) * 0.38 for x in xs], [p[key] for p in points], 0.36, label=name,
                          color=color)
            ax.bar_label(bars, [f"{p[key] / 1000:.1f}k" for p in points], fontsize=8, padding=2)
        for x, p in zip(xs, points):
            if p.get("floor"):
                ax.hlines(p["floor"], x - 0.45, x + 0.45, colors="black", linestyles="dashed", linewidth=1)
                ax.text(x + 0.45, p["floor"], f" floor ~{p['floor'] / 1000:.0f}k", va="center", fontsize=7)
        ratios = [f"{p['label']}\nnanovllm {p['nanovllm'] / p['upstream']:.2f}x" for p in points]
        ax.set_xticks(list(xs), ratios, fontsize=8)
        ax.set_xlim(-0.6, len(points) - 0.4 + (0.35 if any(p.get("floor") for p in points) else 0))
        top = max(max(p["nanovllm"], p["upstream"], p.get("floor") or 0) for p in points)
        ax.set_ylim(0, top * 1.28)
        ax.set_title(f"{model}\n{run['date']}, commit {run['commit']}", fontsize=9)
        ax.yaxis.set_major_formatter(lambda v, _: f"{v / 1000:.0f}k")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel(data["unit"])
    axes[0].legend(loc="upper left", fontsize=8)
    fig.suptitle("Throughput on bench.py's workload (100-1024 tokens in and out), one H200", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_latency(data: dict, out: Path) -> None:
    import matplotlib.pyplot as plt

    models = [m for m in data if m != "unit"]
    fig, axes = plt.subplots(1, len(models), figsize=(9, 4.8))
    for ax, model in zip(axes, models):
        series = data[model]["series"]
        streams = [s["streams"] for s in series]
        for key, name, color in ENGINES:
            ax.plot(streams, [s[key] for s in series], marker="o", color=color, label=name)
            for s in series:
                ax.annotate(f"{s[key]:.3g}", (s["streams"], s[key]), textcoords="offset points",
                            xytext=(0, 6 if key == "upstream" else -12), ha="center", fontsize=7, color=color)
        ax.axhline(data[model]["floor_ms"], color="black", linestyle="dashed", linewidth=1)
        ax.text(streams[0], data[model]["floor_ms"], f"weight-read floor ~{data[model]['floor_ms']} ms",
                va="bottom", fontsize=7)
        runs = {}  # (workload, date, commit) -> stream counts, in the order measured
        for s in series:
            runs.setdefault((s["workload"], s["date"], s["commit"]), []).append(str(s["streams"]))
        sources = "\n".join(f"{'/'.join(n)} stream{'s' if n != ['1'] else ''}: {w} each, {d}, commit {c}"
                            for (w, d, c), n in runs.items())
        ax.set_title(model, fontsize=10)
        ax.set_xscale("log", base=2)
        ax.set_xticks(streams, [str(n) for n in streams])
        ax.set_xlabel(f"concurrent streams\n\n{sources}", fontsize=8)
        ax.set_ylim(0, max(max(s["upstream"], s["nanovllm"]) for s in series) * 1.2)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(data["unit"].split(" (")[0])
    axes[0].legend(loc="center left", fontsize=8)
    fig.suptitle("Time per decode step against concurrent streams, one H200 (lower is better)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--figures", type=Path, default=DOCS / "benchmarks.json")
    parser.add_argument("--out", type=Path, default=DOCS, help="folder for the PNGs")
    args = parser.parse_args()
    figures = json.loads(args.figures.read_text())
    plot_throughput(figures["throughput"], args.out / "throughput.png")
    plot_latency(figures["latency"], args.out / "latency.png")
    print(f"wrote {args.out / 'throughput.png'} and {args.out / 'latency.png'}")


if __name__ == "__main__":
    main()
