"""Ratios to the ceiling, markdown tables and the PNG plot of a bench result."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from duelq.apps.bench.base import WIRES


def percentile_ms(values: list[float], q: float) -> float | None:
    return float(1e3 * np.percentile(values, q)) if values else None


def add_ratios(rows: list[dict]) -> None:
    """Each row's throughput ÷ its echo ceiling (same B, message size, transport, actors)."""
    def size_class(wire: str) -> str:
        return "32" if wire == "float32" else "16"
    echo = {(r["section"], r["batch"], size_class(r["wire"]), r["transport"], r["actors"],
             r["variant"]): r for r in rows if r["kind"] == "echo" and "error" not in r}
    plain = {k[:5]: r for k, r in echo.items() if k[5] == ""}
    stream = {(r["section"], r["batch"], r["wire"], r["transport"], r["actors"], r["backend"]): r
              for r in rows if r["kind"] == "stream" and not r["variant"] and "error" not in r}
    for r in rows:
        if r["kind"] == "echo" or "error" in r:
            continue
        if r["kind"] == "replay":   # against TrainStream of the same B, wire and actors
            s = stream.get((r["section"], r["batch"], r["wire"], r["transport"], r["actors"],
                            r["backend"]))
            r["vs_echo"] = r["vs_echo_f32"] = None   # no ceiling of an insert's size
            r["vs_stream_steps"] = (r["steps_per_s"] / s["steps_per_s"]
                                    if s and s["steps_per_s"] else None)
            r["vs_stream_bytes_per_step"] = (r["wire_bytes_per_step"] / s["request_bytes"]
                                             if s and r["wire_bytes_per_step"] is not None
                                             else None)
            continue
        key = (r["section"], r["batch"], size_class(r["wire"]), r["transport"], r["actors"])
        same = echo.get(key + (r["variant"],)) or plain.get(key)
        f32 = plain.get(key[:2] + ("32",) + key[3:])
        r["vs_echo"] = r["steps_per_s"] / same["steps_per_s"] if same else None
        r["vs_echo_f32"] = (r["transitions_per_s"] / f32["transitions_per_s"]) if f32 else None


def _f(x, fmt: str = ".0f", unit: str = "") -> str:
    return "—" if x is None else f"{x:{fmt}}{unit}"


def markdown(head: str, lines: list[str]) -> str:
    """A markdown table: ``head`` (a header row), its rule, then ``lines``."""
    return "\n".join([head, "|" + "---|" * (head.count("|") - 1), *lines])


def table(rows: list[dict], section: str) -> str:
    lines = []
    for r in rows:
        if r["section"] != section or r["kind"] == "replay":
            continue
        kind = r["kind"] + (f" ({r['variant']})" if r["variant"] else "")
        if "error" in r:
            lines.append(f"| {kind} | {r['backend']} | {r['transport']} | {r['actors']} "
                         f"| {r['batch']} | {r['wire']} | failed: {r['error'][:80]} |")
            continue
        server = r.get("server_us", {}).get("overhead")
        lines.append(
            f"| {kind} | {r['backend']} | {r['transport']} | {r['actors']} | {r['batch']} "
            f"| {r['wire']} | {r['request_bytes'] / 1024:.0f} | {r['steps_per_s']:.0f} "
            f"| {r['transitions_per_s']:.3g} | {r['mb_per_s']:.0f} | {_f(r['p50_ms'], '.2f')} "
            f"| {_f(r['p99_ms'], '.2f')} | {_f(r.get('vs_echo'), '.2f')} "
            f"| {_f(r.get('vs_echo_f32'), '.2f')} | {_f(server)} "
            f"| {r['client_cpu_us']:.0f} + {_f(r['server_cpu_us'])} |")
    return markdown("| kind | backend | transport | K | B | wire | request KB | steps/s "
                    "| transitions/s | MB/s | p50 ms | p99 ms | ÷ echo | ÷ f32 echo "
                    "| server µs/step | CPU µs/step actor + server |", lines)


def replay_table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        if r["kind"] != "replay":
            continue
        head = (f"| {r['backend']} | {r['transport']} | {r['actors']} | {r['batch']} "
                f"| {r['wire']} ")
        if "error" in r:
            lines.append(head + f"| failed: {r['error'][:80]} |")
            continue
        lines.append(
            head + f"| {r['replay_ratio']:g} | {r['steps_per_s']:.0f} "
            f"| {r['inserted_rows_per_s']:.3g} | {_f(r['ratio_measured'], '.2f')} "
            f"| {_f(r['wire_bytes_per_step'], '.0f')} | {r['request_bytes'] / 1024:.0f} "
            f"| {_f(r.get('vs_stream_steps'), '.2f')} "
            f"| {_f(r.get('vs_stream_bytes_per_step'), '.3f')} | {_f(r['p50_ms'], '.2f')} |")
    return markdown("| backend | transport | K | B | wire | target ratio | learner steps/s "
                    "| inserted rows/s | ratio measured | wire bytes/step | insert KB "
                    "| ÷ stream steps/s | ÷ stream bytes/step | insert p50 ms |", lines)


def overhead_table(rows: list[dict], costs: dict) -> str:
    lines = []
    for r in rows:
        s = r.get("server_us")
        if r["section"] != "main" or not s:
            continue
        c = costs.get(f"{r['batch']}/{r['wire']}", {})
        offline = " / ".join(_f(c.get(f"server_{k}_us")) for k in
                             ("parse", "decode", "validate", "encode"))
        lines.append(
            f"| {r['backend']} ({r['kind']}) | {r['batch']} | {r['wire']} | {r['actors']} "
            f"| {s['parse_cpu']:.0f} | {s['handler_cpu']:.0f} | {s['backend_cpu']:.0f} "
            f"| {s['serialize_cpu']:.0f} | **{s['overhead']:.0f}** | {s['overhead_wall']:.0f} "
            f"| {s['wait']:.0f} | {offline} |")
    return markdown("| backend | B | wire | K | parse | handler | backend step | serialise "
                    "| **overhead** (CPU) | overhead (wall) | lock wait (wall) "
                    "| off-line: parse / decode / validate / encode |", lines)


def device_table(result: dict) -> str:
    if "rows" not in result:
        return f"device step: {result.get('skipped') or result.get('error')}"
    lines = []
    for r in result["rows"]:
        d, e, g = r.get("duelq_us"), r.get("torch_eager_us"), r.get("torch_graph_us")
        lines.append(f"| {r['B']} | {_f(d, '.1f')} | {_f(e, '.1f')} | {_f(g, '.1f')} "
                     f"| {_f(e / d if d and e else None, '.1f', '×')} "
                     f"| {_f(g / d if d and g else None, '.1f', '×')} "
                     f"| {_f(r.get('propose_us'), '.1f')} |")
    return markdown("| B | duelq device µs | torch eager µs | torch CUDA graph µs "
                    "| eager ÷ duelq | graph ÷ duelq | propose() µs |", lines)


def _measured(meta: dict) -> str:
    """What was measured: the backend, its device and, unless in-process, the server."""
    server = meta.get("server", "in-process")
    return (f"backend {meta['backend']} on {meta['device']}"
            + ("" if server == "in-process" else f" ({server})"))


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows = [r for r in result["rows"] if "error" not in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    colour = {"float32": "tab:blue", "float16": "tab:orange", "bfloat16": "tab:green"}
    series: dict[tuple[str, str, str], list[tuple[int, float]]] = {}
    for r in rows:
        if r["section"] == "main" and r["kind"] != "replay":
            series.setdefault((r["kind"], r["backend"], r["wire"]), []).append(
                (r["batch"], r["transitions_per_s"]))
    order = {"echo": 0, "stream": 1, "unary": 2}
    for (kind, backend, wire), points in sorted(series.items(), key=lambda kv: (
            order[kv[0][0]], kv[0][1] != "null", WIRES.index(kv[0][2]))):
        xs, ys = zip(*sorted(points))
        if kind == "echo":
            label = f"byte stream (ceiling), {'float32' if wire == 'float32' else '16-bit'} size"
            style = dict(color="black" if wire == "float32" else "grey", ls="--", marker="s")
        else:
            label = f"{kind} {backend} {wire}"
            style = dict(color=colour[wire], marker="o",
                         ls="-" if backend == "null" else ":" if kind == "unary" else "-.")
        left.plot(xs, ys, label=label, **style)
    sizes = result["meta"]["batch_sizes"]
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xticks(sizes, [str(b) for b in sizes])
    left.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    left.set(xlabel="batch size B (transitions per request)", ylabel="transitions / s",
             title=f"throughput vs B ({result['meta']['actors']} actor processes)")
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=7)
    scaling: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r["section"] == "scaling":
            name = f"{'echo' if r['kind'] == 'echo' else 'stream ' + r['backend']} {r['transport']}"
            scaling.setdefault(name, []).append((r["actors"], r["transitions_per_s"]))
    for name, points in sorted(scaling.items()):
        xs, ys = zip(*sorted(points))
        kind = name.rsplit(" ", 1)[0]
        right.plot(xs, ys, ("--" if name.endswith("uds") else "-") + ("s" if kind == "echo"
                                                                      else "o"),
                   color={"echo": "black", "stream null": "tab:blue"}.get(kind, "tab:red"),
                   label=name.replace("echo", "byte stream"))
    if scaling:
        actors = sorted({r["actors"] for r in rows if r["section"] == "scaling"})
        right.set_xticks(actors, [str(k) for k in actors])
    right.set(xlabel="actor processes", ylabel="transitions / s", ylim=(0, None),
              title=f"scaling, B={result['meta']['scaling_batch']} float32")
    right.grid(True, alpha=0.3)
    if scaling:   # no scaling cells (--scaling-actors ""): an empty panel, no legend
        right.legend(fontsize=7)
    meta = result["meta"]
    fig.suptitle(f"duelq bench: {_measured(meta)}; {meta['cpus']} CPUs; "
                 f"H={meta['hidden_dim']} N={meta['n_actions']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(result: dict) -> str:
    m = result["meta"]
    parts = [f"## duelq bench — {_measured(m)}, {m['cpus']} CPUs "
             f"({m['cpu']}), H={m['hidden_dim']} N={m['n_actions']}, window {m['window']}, "
             f"{m['duration_s']:g} s per cell"
             + (f", byte stream on {m['echo_processes']} processes"
                if m.get("echo_processes", 1) > 1 else ""),
             "", "### Throughput by batch size", "", table(result["rows"], "main")]
    if any(r["section"] == "scaling" for r in result["rows"]):
        parts += ["", f"### Scaling with actors, B={m['scaling_batch']} float32", "",
                  table(result["rows"], "scaling")]
    if any(r["section"] == "experiment" for r in result["rows"]):
        parts += ["", "### Experiments (aio: echo on grpc.aio; tuned: larger HTTP/2 windows, "
                      "frames and reads)", "", table(result["rows"], "experiment")]
    if any(r["kind"] == "replay" for r in result["rows"]) or result.get("notes"):
        parts += ["", "### Server-side replay (actors insert B rows per request; the server "
                      "trains from its buffer to hold the target ratio; ratios against "
                      "TrainStream of the same B, wire and actors)", ""]
        if any(r["kind"] == "replay" for r in result["rows"]):
            parts.append(replay_table(result["rows"]))
        parts += [f"note: {n}" for n in result.get("notes", [])]
    over = overhead_table(result["rows"], result["codec_us"])
    if over.count("\n") > 1:
        parts += ["", "### Server-side µs per step, in-line (CPU time of the handler thread; "
                      "overhead = parse + handler − backend step + serialise; the wall figure "
                      "also subtracts the lock wait)", "", over]
    parts += ["", "### Device step (against PyTorch on the same GPU)", "",
              device_table(result["device_step"])]
    return "\n".join(parts)
