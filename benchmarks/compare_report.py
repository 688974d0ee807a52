"""The Markdown table and the PNG chart of ``benchmarks/compare.py``'s results."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

OUTPUTS = ("grads", "norms", "clipped_mean")
LABELS = {
    "loop": "per-sample loop",
    "vmap": "torch.func vmap(grad), tutorial code",
    "opacus": "Opacus GradSampleModule (hooks)",
    "opacus-ghost": "Opacus ghost clipping",
    "backpack": "BackPACK BatchGrad",
    "backpack-l2": "BackPACK BatchL2Grad",
    "psgrad-engine": "psgrad engine, in process",
    "psgrad-http": "psgrad over HTTP, embedded broker",
    "psgrad-redis": "psgrad over HTTP, Redis + 1 worker",
}
COLORS = {
    "loop": "#7f7f7f",
    "vmap": "#1f77b4",
    "opacus": "#2ca02c",
    "opacus-ghost": "#98df8a",
    "backpack": "#9467bd",
    "backpack-l2": "#c5b0d5",
    "psgrad-engine": "#d62728",
    "psgrad-http": "#ff7f0e",
    "psgrad-redis": "#ffbb78",
}
HOW = """\
How: each method runs in its own fresh subprocess per case. One call measures the peak memory
(resident-set high-water mark minus the resident set just before, after `malloc_trim`; over HTTP
the sum of the client's, the api's and the worker's peaks, for a server started fresh for the
case), its result is compared with the loop's. Then warm calls are timed in rounds that
interleave the methods, so they share the machine's load alike (median of as many calls as fit
in the cell's time, at least 3, or 2 for calls over a second; at most 10); after each call a
method's process hands freed memory back (`malloc_trim`, untimed), so every call pays its own
page faults, for every method alike. The servers run with `PSGRAD_MAX_RESULT_BYTES=16 GiB` and,
for Redis, `PSGRAD_REDIS_TIMEOUT_S=120` (the 2 s default fails storing answers of a few hundred
MB here); answers move through Redis in pieces, so no size is refused. TD(0): every
method gets the same pseudo-loss (target - V(s))^2 with the target r + 0.99 (1 - done) V(s')
from a forward under `no_grad` (the stopped gradient), so the libraries' hooks see an ordinary
per-sample loss. `clipped_mean` uses clip_norm = the median of the loop's norms and no noise, so
it can be compared. Ghost clipping and BatchL2Grad form no per-sample gradients: their
`clipped_mean` is a second backward of the clip-factor-weighted losses. The library and loop
methods derive `norms` and `clipped_mean` from their per-sample gradients, as their users do;
psgrad takes its fast statistics for those outputs (`meta.method`)."""


def _cell(results: dict[str, Any], case: str, method: str, output: str) -> dict[str, Any]:
    per = results.get(case, {}).get(method)
    if per is None:
        return {"na": "not run"}
    if "error" in per:
        return {"na": "failed: " + per["error"]}
    cell: dict[str, Any] = per.get(output, {"na": "not run"})
    if "times" in cell:
        cell = {**cell, "median": statistics.median(cell["times"])}
    return cell


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 1 else f"{ms:.2f}"


def _ratio(a: float, b: float | None) -> str:
    if not b:
        return ""
    r = a / b
    return f"{r:.2f}" if r < 10 else f"{r:.0f}"


def markdown(doc: dict[str, Any]) -> str:
    info, res = doc["machine"], doc["results"]
    cases, methods = doc["cases"], doc["methods"]
    v = info["versions"]
    lines = [
        "# psgrad side by side with torch.func, Opacus and BackPACK",
        "",
        f"Machine: {info['cpu']}, {info['cores']} cores ({info['torch_threads']} torch threads),"
        f" device {info['device']}, THP_MEM_ALLOC_ENABLE={info['thp']}. Versions: "
        + ", ".join(f"{k} {val}" for k, val in v.items())
        + ".",
        "",
        f"Command: `{info['command']}` ({info['date']}, {info['minutes']} min).",
        "",
        HOW,
        "",
        "Times are medians in ms; ÷ loop and ÷ engine are that time divided by the per-sample "
        "loop's and by psgrad's engine's (below 1: faster). † marks a result that differs from "
        "the loop's beyond `allclose(atol=3e-3, rtol=1e-5)`; n/a says why a method does not "
        "apply.",
        "",
    ]
    for output in OUTPUTS:
        lines += [
            f"## {output}: median ms (÷ loop)",
            "",
            "| method | " + " | ".join(cases) + " |",
            "|---|" + "---:|" * len(cases),
        ]
        for m in methods:
            row = []
            for case in cases:
                c = _cell(res, case, m, output)
                loop = _cell(res, case, "loop", output).get("median")
                if "median" not in c:
                    row.append("n/a")
                    continue
                mark = "" if c["ok"] else " †"
                ratio = f" ({_ratio(c['median'], loop)})" if m != "loop" else ""
                row.append(f"{_ms(c['median'])}{ratio}{mark}")
            lines.append(f"| {LABELS.get(m, m)} | " + " | ".join(row) + " |")
        lines.append("")
    lines += [
        "## Every cell",
        "",
        "| case | output | method | median ms (runs) | ÷ loop | ÷ engine | peak MiB | "
        "max abs diff from loop | agrees |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for case in cases:
        for output in OUTPUTS:
            loop = _cell(res, case, "loop", output).get("median")
            eng = _cell(res, case, "psgrad-engine", output).get("median")
            for m in methods:
                c = _cell(res, case, m, output)
                head = f"| {case} | {output} | {LABELS.get(m, m)} |"
                if "median" not in c:
                    lines.append(f"{head} n/a: {c['na']} | | | | | |")
                    continue
                lines.append(
                    f"{head} {_ms(c['median'])} ({len(c['times'])}) | {_ratio(c['median'], loop)}"
                    f" | {_ratio(c['median'], eng)} | {c['mem'] / 2**20:.0f} | {c['diff']:.1e} | "
                    f"{'yes' if c['ok'] else '**NO** †'} |"
                )
    return "\n".join(lines) + "\n"


def chart(doc: dict[str, Any], path: Path) -> None:
    """Grouped bars per output: median time per case and method, log scale."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed: no chart")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    cases, methods, res = doc["cases"], doc["methods"], doc["results"]
    fig, axes = plt.subplots(len(OUTPUTS), 1, figsize=(13, 4.2 * len(OUTPUTS)))
    width = 0.8 / len(methods)
    for ax, output in zip(axes, OUTPUTS, strict=True):
        for j, m in enumerate(methods):
            for i, case in enumerate(cases):
                c = _cell(res, case, m, output)
                x = i + (j - (len(methods) - 1) / 2) * width
                if "median" not in c:
                    ax.text(
                        x,
                        0.02,
                        "n/a",
                        transform=ax.get_xaxis_transform(),
                        rotation=90,
                        ha="center",
                        va="bottom",
                        fontsize=6,
                        color="#999999",
                    )
                    continue
                ax.bar(
                    x,
                    c["median"] * 1e3,
                    width,
                    color=COLORS.get(m, "#333333"),
                    edgecolor="black" if c["ok"] else "red",
                    linewidth=0.3 if c["ok"] else 2,
                    hatch=None if c["ok"] else "xx",
                )
        ax.set_yscale("log")
        ax.set_ylabel("median time, ms (log)")
        ax.set_title(f"{output}", loc="left", fontweight="bold")
        ax.set_xticks(range(len(cases)), cases)
        ax.grid(axis="y", which="both", alpha=0.3)
    handles = [
        Patch(
            facecolor=COLORS.get(m, "#333333"),
            edgecolor="black",
            linewidth=0.3,
            label=LABELS.get(m, m),
        )
        for m in methods
    ]
    info = doc["machine"]
    fig.legend(handles=handles, loc="upper center", ncol=3, fontsize=9, frameon=False)
    fig.text(
        0.5,
        0.005,
        f"{info['cpu']}, {info['cores']} cores, device {info['device']}, "
        f"torch {info['versions']['torch']}; red hatched: differs from the loop; "
        "n/a: method does not apply",
        ha="center",
        fontsize=8,
        color="#555555",
    )
    fig.tight_layout(rect=(0, 0.015, 1, 0.94))
    fig.savefig(path, dpi=110)
    plt.close(fig)
