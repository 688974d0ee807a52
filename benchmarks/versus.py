"""A benchmark in two checkouts, interleaved: does a change make anything slower?

Runs one of this folder's benchmark scripts alternately in a checkout of ``--base`` (a git
worktree made for the run, removed after) and in this checkout, ``--runs`` times each, so that
both sides share the machine's load. Each run prints a Markdown table; rows are matched by their
text columns, and for each row this prints the median of each side and ``head / base`` of a
column: the time (``median ms``/``time ms``) by default, or each ``--column`` (``"x floor"``: a
ratio measured within each run, which a shared machine's changing load does not move).

    python benchmarks/versus.py --base c3f476f --runs 3 engine.py --repeats 5
    python benchmarks/versus.py --base c3f476f --runs 3 --column "x floor" fast_stats.py --rounds 3
    python benchmarks/versus.py --base main --runs 3 --column "÷ vmap" --column "user ms" \
        --head-script grads.py --cases mlp:1024
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TIME_COLUMNS = ("median ms", "time ms", "ms")  # realsize.py's is "ms"


def rows(text: str, columns: tuple[str, ...] = TIME_COLUMNS) -> dict[str, float]:
    """{row label: value} from the first Markdown table with one of ``columns`` (the text
    columns before it label the row)."""
    out: dict[str, float] = {}
    column = None
    label_columns: list[int] = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or set("".join(cells)) <= set("-: "):
            continue
        if column is None:
            found = [i for i, c in enumerate(cells) if c in columns]
            if found:
                column = found[0]
                first = min(i for i, c in enumerate(cells) if c in (*columns, *TIME_COLUMNS))
                label_columns = list(range(first))
            continue
        if len(cells) > column:
            try:
                out[" / ".join(cells[i] for i in label_columns)] = float(cells[column])
            except ValueError:
                continue
    return out


def run(tree: Path, script: Path, args: list[str]) -> str:
    # the server at the root, the client in client/ (each checkout's own, not an installed one)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(tree), str(tree / "client")))}
    done = subprocess.run([sys.executable, str(script), *args], cwd=tree,
                          env=env, capture_output=True, text=True, check=True)
    return done.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the git revision to compare against")
    parser.add_argument("--runs", type=int, default=3, help="runs of the script per side")
    parser.add_argument("--column", action="append",
                        help="a column to compare (default: the time); repeat for several")
    parser.add_argument("--head-script", action="store_true",
                        help="run this checkout's script on both sides (a benchmark the base "
                             "does not have; only the code it imports differs)")
    parser.add_argument("script", help="a script of benchmarks/, e.g. engine.py")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    opts = parser.parse_args()
    head = HERE.parent
    wanted = [(c,) for c in opts.column] if opts.column else [TIME_COLUMNS]
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(head), "worktree", "add", "-q", "--detach", str(base),
                        opts.base], check=True)
        try:
            # per column: side -> row -> one value per run
            values: list[dict[str, dict[str, list[float]]]] = [
                {"base": {}, "head": {}} for _ in wanted]
            for i in range(opts.runs):
                for side, tree in (("base", base), ("head", head)):
                    script = (head if opts.head_script else tree) / "benchmarks" / opts.script
                    text = run(tree, script, opts.args)
                    for columns, times in zip(wanted, values, strict=True):
                        for label, t in rows(text, columns).items():
                            times[side].setdefault(label, []).append(t)
                    print(f"run {i + 1}/{opts.runs} {side} done", file=sys.stderr)
        finally:
            subprocess.run(["git", "-C", str(head), "worktree", "remove", "--force", str(base)],
                           check=False)
    print(f"{opts.script} {' '.join(opts.args)}: base {opts.base} vs this checkout, "
          f"medians of {opts.runs} interleaved runs")
    for columns, times in zip(wanted, values, strict=True):
        what = columns[0] if opts.column else "ms"
        print(f"\n| row | base {what} | head {what} | head / base |\n|---|---:|---:|---:|")
        for label, got in times["head"].items():
            if label in times["base"]:
                b, h = statistics.median(times["base"][label]), statistics.median(got)
                print(f"| {label} | {b:.2f} | {h:.2f} | {h / b:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
