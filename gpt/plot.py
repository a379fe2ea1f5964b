"""The loss curves of several runs over each other, in one PNG: 1 rank against N, or two layouts.

    python gpt/plot.py out_1rank out_4ranks --out loss.png
    python gpt/plot.py --layouts fsdp8.json fsdp4_tp2.json --out layouts.png   # simulate.py --json's figures
    python gpt/plot.py --pipeline 1F1B.json ZBVZeroBubble.json --out pp.png  # train.py --pp's pp_timeline.json

Each OUT_DIR is a run's --out_dir: its metrics.jsonl gives the training loss (a line) and the
validation loss (dots); the floor, where the data has one, is a dotted line. Needs matplotlib
(requirements-plot.txt), which training does not.
"""
import argparse
import json
import os


def read_metrics(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as file:
        return [json.loads(line) for line in file if line.strip()]


def plot(out_dirs: list[str], path: str):
    """Draw every run's curves on one set of axes and save them to `path`; return the figure."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    floors = set()
    for out_dir in out_dirs:
        records = read_metrics(out_dir)
        train = [(r["step"], r["loss"]) for r in records if "loss" in r]
        val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
        floors.update(r["floor"] for r in records if "floor" in r)
        (line,) = axes.plot(*zip(*train, strict=True), label=f"{out_dir} train", linewidth=1)
        if val:
            axes.plot(*zip(*val, strict=True), "o--", color=line.get_color(), label=f"{out_dir} val")
    for floor in sorted(floors):
        axes.axhline(floor, color="black", linestyle=":", label=f"floor {floor:.4f}")
    axes.set_xlabel("step")
    axes.set_ylabel("loss (nats per token)")
    axes.legend()
    figure.savefig(path, dpi=120, bbox_inches="tight")
    return figure


def plot_layouts(files: list[str], path: str):
    """What rank 0 holds and sends per step in each layout, from simulate.py --json files named for it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [os.path.basename(f).removesuffix(".json") for f in files]
    figures = []
    for file in files:
        with open(file) as f:
            figures.append(json.load(f)[0])
    figure, (held, sent) = plt.subplots(1, 2, figsize=(11, 4.5))
    for axes, key, title in ((held, "held", "held by each rank"), (sent, "wire", "sent by each rank per step")):
        parts = list(dict.fromkeys(part for fig in figures for part in fig[key]))
        bottom = [0.0] * len(figures)
        for part in parts:
            values = [fig[key].get(part, 0) / 2**30 for fig in figures]
            axes.bar(names, values, bottom=bottom, label=part)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        axes.set_title(title)
        axes.set_ylabel("GiB")
        axes.tick_params(axis="x", labelrotation=20)
        axes.legend(fontsize="small")
    figure.savefig(path, dpi=120, bbox_inches="tight")
    return figure


KINDS = {"F": ("forward", "tab:blue"), "B": ("backward", "tab:orange"), "I": ("backward, input's gradient", "tab:red"),
         "W": ("backward, weights' gradient", "tab:green")}


def plot_pipeline(files: list[str], path: str):
    """Each file's last step, in the order given, one row per pipeline rank on one time axis: when each rank
    computed what, for which micro-batch (the number on a bar wide enough for it); a rank's second stage
    hatched; the gaps are the waiting, each rank's share of the step in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for file in files:
        with open(file) as f:
            runs.append(json.load(f))
    figure, panels = plt.subplots(len(runs), 1, figsize=(11, 1.2 + 0.6 * sum(r["pp"] for r in runs)), squeeze=False,
                                  sharex=True)
    longest = max(1e3 * end for run in runs for timeline in run["ranks"] for *_, end in timeline)
    seen = set()
    for axes, run in zip(panels[:, 0], runs, strict=True):
        length = max(end for timeline in run["ranks"] for *_, end in timeline)
        waits = []
        for rank, timeline in enumerate(run["ranks"]):
            for stage, kind, micro, start, end in timeline:
                axes.barh(rank, 1e3 * (end - start), left=1e3 * start, color=KINDS[kind][1], edgecolor="white",
                          hatch="//" if stage >= run["pp"] else None,
                          label=KINDS[kind][0] if kind not in seen else None)
                seen.add(kind)
                if 1e3 * (end - start) > longest / 60:
                    axes.text(1e3 * (start + end) / 2, rank, str(micro), ha="center", va="center", fontsize=6,
                              color="white")
            waits.append(1 - sum(end - start for *_, start, end in timeline) / length)
        axes.set_yticks(range(run["pp"]), [f"rank {r}" for r in range(run["pp"])])
        axes.invert_yaxis()
        axes.set_title(f"{run['schedule']}: pp {run['pp']}, {run['micro_batches']} micro-batches; each rank waited "
                       f"{', '.join(f'{w:.0%}' for w in waits)} of this step", fontsize=9)
        axes.set_xlabel("ms into the step", fontsize=8)
    figure.tight_layout()
    figure.legend(loc="upper center", ncol=4, fontsize="small", bbox_to_anchor=(0.5, 0.0),
                  title="each bar: one micro-batch (its number) on one stage; hatched: a rank's second stage",
                  title_fontsize="small")
    figure.savefig(path, dpi=120, bbox_inches="tight")
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dirs", nargs="*", help="runs' --out_dir folders, each with a metrics.jsonl")
    parser.add_argument("--layouts", nargs="+", help="instead: simulate.py --json files, one bar each")
    parser.add_argument("--pipeline", nargs="+", help="instead: train.py --pp's pp_timeline.json files, one panel "
                                                      "each")
    parser.add_argument("--out", default="loss.png", help="the PNG to write")
    args = parser.parse_args()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        parser.error("plot.py needs matplotlib: pip install -r requirements-plot.txt")
    if args.pipeline:
        if args.out_dirs or args.layouts:
            parser.error("give the runs' --out_dir folders, --layouts or --pipeline, one of them")
        for file in args.pipeline:
            try:
                with open(file) as f:
                    json.load(f)["ranks"][0][0][4]
            except (OSError, ValueError, LookupError, TypeError):
                parser.error(f"{file}: not the pp_timeline.json of a train.py --pp run")
        plot_pipeline(args.pipeline, args.out)
        print(f"wrote {args.out}")
        return
    if args.layouts:
        if args.out_dirs:
            parser.error("give the runs' --out_dir folders or --layouts, not both")
        for file in args.layouts:
            try:
                with open(file) as f:
                    json.load(f)[0]["held"]
            except (OSError, ValueError, LookupError, TypeError):
                parser.error(f"{file}: not the --json output of gpt/simulate.py")
        plot_layouts(args.layouts, args.out)
        print(f"wrote {args.out}")
        return
    if not args.out_dirs:
        parser.error("give the runs' --out_dir folders, or --layouts")
    for out_dir in args.out_dirs:
        if not os.path.isfile(os.path.join(out_dir, "metrics.jsonl")):
            parser.error(f"{out_dir}: no metrics.jsonl (give the --out_dir of a run)")
        if not any("loss" in record for record in read_metrics(out_dir)):
            parser.error(f"{out_dir}: its metrics.jsonl holds no log line yet")
    plot(args.out_dirs, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
