"""Splits the single-GPU tests (``-m gpu``) into shards of whole test files, one per GPU,
so that the suite runs as one pytest process per GPU (scripts/gpu_check.sh, ``SHARDS``).

    python scripts/gpu_shards.py N [PATH ...]    # prints N lines, each the files of a shard

A file's cost is its test count times its weight from ``--durations`` of an earlier run
where one is given (``--durations-log``: pytest's "slowest durations" lines; a file's
weight is its seconds per test there), else its test count. Files are dealt greedily,
the costliest first, to the shard with the least cost so far: a file stays whole, so
its fixtures and compiled kernels serve all its tests.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys

DURATION_LINE = re.compile(r"^\s*([0-9.]+)s (?:call|setup|teardown)\s+(\S+?)::")


def collected(paths: list[str]) -> collections.Counter:
    """Tests per file of ``pytest --collect-only -m gpu``."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu",
                          "-p", "no:cacheprovider", *paths], capture_output=True, text=True,
                         check=False).stdout
    return collections.Counter(line.split("::")[0] for line in out.splitlines() if "::" in line)


def seconds_per_test(log_path: str | None, counts: collections.Counter) -> dict[str, float]:
    """Each file's seconds per test in a ``--durations`` log (files it does not name: 1)."""
    if log_path is None:
        return {}
    total: collections.Counter = collections.Counter()
    with open(log_path) as log:
        for line in log:
            match = DURATION_LINE.match(line)
            if match:
                total[match.group(2)] += float(match.group(1))
    return {path: seconds / counts[path] for path, seconds in total.items() if counts[path]}


def shards(counts: collections.Counter, weights: dict[str, float], num_shards: int
           ) -> list[list[str]]:
    cost = {path: n * weights.get(path, 1.0) for path, n in counts.items()}
    loads, files = [0.0] * num_shards, [[] for _ in range(num_shards)]
    for path in sorted(cost, key=cost.get, reverse=True):
        lightest = loads.index(min(loads))
        loads[lightest] += cost[path]
        files[lightest].append(path)
    return files


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("num_shards", type=int)
    parser.add_argument("paths", nargs="*", default=["tests", "graph_tests"])
    parser.add_argument("--durations-log", default=None,
                        help="a log of an earlier run with pytest --durations")
    args = parser.parse_args(argv)
    if args.num_shards < 1:
        sys.exit(f"num_shards must be >= 1, got {args.num_shards}")
    counts = collected(args.paths)
    for shard in shards(counts, seconds_per_test(args.durations_log, counts), args.num_shards):
        print(" ".join(shard))


if __name__ == "__main__":
    main()
