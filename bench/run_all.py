"""Run every ``bench/bench_*.py`` that defines ``run() -> list[dict]`` and print one table.

    python bench/run_all.py [--only NAME ...] [--device cpu|cuda] [--reps N] [--json PATH]

Each module measures its candidates side by side in one process (interleaved repetitions,
medians; see ``_timing.py``), so the ratios hold even when absolute times drift.
A row is a dict with a ``name``; other keys are timings (``*_ms``) and ratios.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))


def discover() -> list[str]:
    """Module names of bench/bench_*.py, sorted."""
    return sorted(p.stem for p in BENCH_DIR.glob("bench_*.py"))


def _select(names: list[str], only: list[str] | None) -> list[str]:
    if not only:
        return names
    wanted = {w.removeprefix("bench_").removesuffix(".py") for w in only}
    unknown = wanted - {n.removeprefix("bench_") for n in names}
    if unknown:
        raise SystemExit(
            f"--only: unknown benchmark(s) {sorted(unknown)}; available: "
            f"{[n.removeprefix('bench_') for n in names]}"
        )
    return [n for n in names if n.removeprefix("bench_") in wanted]


def _format(value: object) -> str:
    if value is None:  # not measured in this row
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.3f}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def print_table(rows: list[dict], file=sys.stdout) -> None:
    """One table: the union of all rows' columns, ``name`` first, blanks where absent."""
    if not rows:
        print("(no rows)", file=file)
        return
    columns = ["name"]
    for row in rows:
        columns += [key for key in row if key not in columns]
    cells = [[_format(row.get(col, "")) for col in columns] for row in rows]
    widths = [max(len(col), *(len(r[i]) for r in cells)) for i, col in enumerate(columns)]
    line = "  ".join(
        col.ljust(w) if i == 0 else col.rjust(w) for i, (col, w) in enumerate(zip(columns, widths))
    )
    print(line, file=file)
    print("-" * len(line), file=file)
    for r in cells:
        print(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
            ),
            file=file,
        )


def bench_main(run, description: str, threads: bool = False) -> None:
    """The command line of one ``bench_*.py``: ``--quick``, ``--reps N`` (and ``--threads T``
    when ``run`` takes it), ``--json PATH``; prints the rows as one table."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=None)
    if threads:
        parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = run(args.quick, args.reps, args.threads) if threads else run(args.quick, args.reps)
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


def run_benchmarks(names: list[str], device: str | None, reps: int | None) -> list[dict]:
    rows: list[dict] = []
    for name in names:
        module = importlib.import_module(name)
        run = getattr(module, "run", None)
        if not callable(run):
            print(f"skipping {name}: no run() function", file=sys.stderr)
            continue
        params = inspect.signature(run).parameters
        kwargs = {}
        if device is not None and "device" in params:
            kwargs["device"] = device
        if reps is not None and "reps" in params:
            kwargs["reps"] = reps
        print(f"running {name} ...", file=sys.stderr, flush=True)
        rows.extend(run(**kwargs))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", action="append", help="benchmark name (e.g. gather); repeatable")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], help="default: cuda if available, else cpu"
    )
    parser.add_argument(
        "--reps", type=int, help="timed repetitions per candidate (median is reported)"
    )
    parser.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    if args.reps is not None and args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")
    names = _select(discover(), args.only)
    from _timing import keep_freed_memory

    keep_freed_memory()  # measure the kernels, not the kernel's page-fault handler
    rows = run_benchmarks(names, args.device, args.reps)
    print_table(rows)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
