"""Compare server configurations across several ``duelq bench`` runs.

    python3 benchmarks/compare_runs.py docs/bench-h200-round14.json [--png out.png]
    python3 benchmarks/compare_runs.py a/bench.json b/bench.json …

Each argument is a bench.json (its configuration named by its folder) or a file of runs,
``{"runs": [{"config": …, "call": …, "bench": {bench.json's content}}, …]}``, as
docs/bench-h200-round14.json.  For each configuration, in order of first appearance: the
runs, TrainStream's float32 ratio to its byte stream, the 16-bit streams' ratio to the
float32 byte stream (issue 5's goals: ≥ 0.90 and ≥ 1.8×), the runs that met each goal (a
run without the cell, or whose cell failed, did not), and the median steps/s, all at
``--batch`` (1024) in the by-batch-size table, on the server's backend.  Prints a
markdown table; ``--png`` also plots every run's ratios.  Exit status 2 when an argument
cannot be read or no run holds such a TrainStream row.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

#: (label, wire, the ratio read, goal)
CELLS = (("float32 ÷ its echo", "float32", "vs_echo", 0.9),
         ("float16 ÷ f32 echo", "float16", "vs_echo_f32", 1.8),
         ("bfloat16 ÷ f32 echo", "bfloat16", "vs_echo_f32", 1.8))


def load(paths: list[str]) -> dict[str, list[dict]]:
    """{configuration: [its runs' rows]}, in order of first appearance."""
    configs: dict[str, list[dict]] = {}
    for path in paths:
        doc = json.loads(Path(path).read_text())
        runs = doc["runs"] if "runs" in doc else [{"config": Path(path).parent.name,
                                                   "bench": doc}]
        for run in runs:
            configs.setdefault(run["config"], []).append(run["bench"]["rows"])
    return configs


def stream(rows: list[dict], wire: str, batch: int) -> dict | None:
    """The run's TrainStream row of ``wire`` at ``batch`` in the by-batch-size table, on the
    learner's own backend (not the bench's null one); None if it has none or it failed."""
    found = next((r for r in rows if r["kind"] == "stream" and r["wire"] == wire
                  and r["batch"] == batch and r.get("section", "main") == "main"
                  and r.get("backend") != "null"), None)
    return None if found is None or "error" in found else found


def summary(configs: dict[str, list[dict]], batch: int) -> list[dict]:
    """Per configuration and cell: the ratios found, how many runs met the goal (a run
    without the cell, or whose cell failed, did not), and the steps/s."""
    out = []
    for config, runs in configs.items():
        entry = {"config": config, "runs": len(runs)}
        for label, wire, key, goal in CELLS:
            found = [r for r in (stream(rows, wire, batch) for rows in runs)
                     if r is not None and r.get(key) is not None]
            ratios = [r[key] for r in found]
            entry[label] = {"ratios": ratios, "met": sum(x >= goal for x in ratios),
                            "of": len(runs), "steps_per_s": [r["steps_per_s"] for r in found]}
        out.append(entry)
    return out


def table(entries: list[dict]) -> str:
    head = "| configuration | runs | " + " | ".join(
        f"{label} (goal {goal:g}): median (min–max), met, steps/s" for label, _, _, goal in CELLS)
    lines = [head + " |", "|---|---|" + "---|" * len(CELLS)]
    for e in entries:
        cells = []
        for label, *_ in CELLS:
            c = e[label]
            if not c["ratios"]:
                cells.append("—")
                continue
            x = c["ratios"]
            cells.append(f"{np.median(x):.2f} ({min(x):.2f}–{max(x):.2f}), {c['met']} of "
                         f"{c['of']}, {np.median(c['steps_per_s']):.0f}")
        lines.append(f"| {e['config']} | {e['runs']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(entries: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 0.5 * len(entries) + 2))
    for k, (label, _, _, goal) in enumerate(CELLS):
        for i, e in enumerate(entries):
            x = e[label]["ratios"]
            ax.scatter(x, [i + 0.2 * (k - 1)] * len(x), s=18, color=f"C{k}",
                       label=label if i == 0 else None)
        ax.axvline(goal, color=f"C{k}", lw=0.8, ls="--")
    ax.set_yticks(range(len(entries)), [e["config"] for e in entries])
    ax.invert_yaxis()
    ax.set_xlabel("ratio (dashed: issue 5's goals, 0.9 and 1.8)")
    ax.set_title("TrainStream at B = 1024 by server configuration (one dot per run)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="bench.json files or files of runs")
    parser.add_argument("--png", type=Path, help="also plot every run's ratios here")
    parser.add_argument("--batch", type=int, default=1024, help="B of the rows compared")
    args = parser.parse_args()
    try:
        entries = summary(load(args.files), args.batch)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"compare_runs: cannot read the runs: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return 2
    if not any(e[label]["ratios"] for e in entries for label, *_ in CELLS):
        print(f"compare_runs: no TrainStream row at B = {args.batch} with ratios in the runs "
              "given", file=sys.stderr)
        return 2
    print(table(entries))
    if args.png:
        plot(entries, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
