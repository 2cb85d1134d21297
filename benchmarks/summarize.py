"""Turn ``experts.json`` files (from bench_experts.py) into the Markdown of a results page.

    python benchmarks/summarize.py [--merged PREFIX] run1/experts.json [run2/experts.json ...] \
        > benchmarks/results/<device>-<date>.md

Several files (say, one run per shape) are merged; ``--merged PREFIX`` also writes
their rows as ``PREFIX.json`` and ``PREFIX.csv`` (``bench_experts.py --plot-only``
draws the plot from the JSON).

Per shape, one row per token count: each backend's time and fraction of the
floor, the best of ours against the best peer (transformers' implementations
``hf-*``, vLLM's Triton kernel ``vllm-triton``).
"""

from __future__ import annotations

import argparse
import csv
import json
from collections import defaultdict

PEER_PREFIXES = ("hf-", "vllm-")


def is_peer(backend: str) -> bool:
    return backend.startswith(PEER_PREFIXES)


def _span(values, fmt: str) -> str:
    low, high = min(values), max(values)
    return format(low, fmt) if format(low, fmt) == format(high, fmt) else \
        f"{format(low, fmt)}-{format(high, fmt)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--merged")
    args = parser.parse_args()
    headers, rows = [], []
    for path in args.runs:
        with open(path) as f:
            data = json.load(f)
        headers.append(data["header"])
        rows += data["rows"]
    if args.merged:
        with open(args.merged + ".json", "w") as f:
            json.dump({"header": headers[0], "rows": rows}, f, indent=1)
        with open(args.merged + ".csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    header = headers[0]
    print(f"# Experts benchmark: {header['device']}, {header['date']}\n")
    print(f"torch {header['torch']}, triton {header['triton']}. Ceilings measured in the same "
          f"run as each row: HBM read "
          f"{_span([h['read_tb_per_s'] for h in headers], '.2f')} TB/s, dense bf16 "
          f"{_span([h['bf16_tflop_per_s'] for h in headers], '.0f')} TFLOP/s. "
          "Times are medians of CUDA-graph replays "
          "(ours and `vllm-triton`) or eager calls (transformers' `hf-*`), each run after a "
          "1 GiB read that evicts L2 and leaves it clean; `%` is the floor over the time.\n")
    if header.get("vllm"):
        print(f"`vllm-triton`: {header['vllm']}, its Triton kernel and tuned configs, "
              "with its CUDA align, activation and sum replaced by equivalents "
              "(benchmarks/peer_vllm.py).\n")
    by_shape = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        by_shape[r["shape"]][r["tokens"]][r["backend"]] = r
    for shape, per_tokens in by_shape.items():
        backends = sorted({b for t in per_tokens.values() for b in t},
                          key=lambda b: (is_peer(b), b))
        print(f"## {shape}\n")
        print("| T | floor us | " + " | ".join(backends) + " | ours vs best peer |")
        print("|---|---|" + "---|" * len(backends) + "---|")
        for tokens in sorted(per_tokens):
            cells = per_tokens[tokens]
            floor = next(iter(cells.values()))["floor_us"]
            line = [str(tokens), f"{floor:.1f}"]
            for b in backends:
                r = cells.get(b)
                line.append("-" if r is None else f"{r['us']:.1f} ({r['pct_floor']:.0f}%)")
            ours = [r["us"] for b, r in cells.items() if not is_peer(b) and b != "reference"]
            peers = [r["us"] for b, r in cells.items() if is_peer(b)]
            line.append(f"{min(peers) / min(ours):.2f}x" if ours and peers else "-")
            print("| " + " | ".join(line) + " |")
        print()


if __name__ == "__main__":
    main()
