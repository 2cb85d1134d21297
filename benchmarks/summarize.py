"""Turn ``experts.json`` files (from bench_experts.py) into the Markdown of a results page,
or into the targets and a short table.

    python benchmarks/summarize.py [--merged PREFIX] run1/experts.json [run2/experts.json ...] \\
        > benchmarks/results/<device>-<date>.md
    python benchmarks/summarize.py --short run1/experts.json [run2/experts.json ...]
    python benchmarks/summarize.py --rows run1/experts.json [run2/experts.json ...]

Several files (say, one run per shape) are merged; ``--merged PREFIX`` also writes
their rows as ``PREFIX.json`` and ``PREFIX.csv`` (``bench_experts.py --plot-only``
draws the plot from the JSON).

Markdown: per shape and weight format, one row per token count: each backend's time
and fraction of the floor, the best of ours against the best peer (transformers'
implementations ``hf-*``, vLLM's Triton kernel ``vllm-triton``, triton_kernels'
``triton-kernels``). ``--short``: the quantized experts' targets, met or missed with
numbers, then one line per shape, format and token count: our best backend (not the
reference), the floor, vLLM's time.
``--rows``: every row. Decode rows (T = 1, 16) also give the fraction of their byte floor
(``%bytes``: the weights' bytes at the HBM read rate, the decode roofline).
Rows of runs from before formats existed count as bf16.
"""

from __future__ import annotations

import argparse
import csv
import json
from collections import defaultdict

PEER_PREFIXES = ("hf-", "vllm-", "triton-kernels")
VLLM = "vllm-triton"
BF16 = "bf16"
# The targets of quantized experts (issue 11), in the same run.
DECODE_TOKENS = (1, 16)
DECODE_MAX_OVER_FLOOR = 1.3
PREFILL_TOKENS = (4096, 16384)
PREFILL_SHAPES = ("mixtral-8x7b", "deepseek-v3")
PREFILL_MIN_SPEEDUP_OVER_BF16 = 1.5


def is_peer(backend: str) -> bool:
    return backend.startswith(PEER_PREFIXES)


def is_ours(backend: str) -> bool:
    """Our backends but the reference, the oracle that is not meant to be fast."""
    return not is_peer(backend) and backend != "reference"


def format_of(row: dict) -> str:
    return row.get("format", BF16)


def _span(values, fmt: str) -> str:
    low, high = min(values), max(values)
    return format(low, fmt) if format(low, fmt) == format(high, fmt) else \
        f"{format(low, fmt)}-{format(high, fmt)}"


def cells_by_key(rows: list[dict]) -> dict[tuple[str, int, str], dict[str, dict]]:
    """``{(shape, tokens, format): {backend: row}}`` in the rows' order."""
    cells: dict[tuple[str, int, str], dict[str, dict]] = defaultdict(dict)
    for r in rows:
        cells[(r["shape"], r["tokens"], format_of(r))][r["backend"]] = r
    return cells


def best_ours(cells: dict[str, dict]) -> dict | None:
    ours = [r for b, r in cells.items() if is_ours(b)]
    return min(ours, key=lambda r: r["us"]) if ours else None


def bytes_floor_cell(row: dict | None, width: int = 7) -> str:
    """The fraction of its byte floor (its weights' bytes at the HBM read rate) a decode row
    reaches (`DECODE_TOKENS`), right-aligned in ``width``; ``-`` for other rows and for rows
    of runs from before the byte floor was kept."""
    if row is None or row["tokens"] not in DECODE_TOKENS or "bytes_floor_us" not in row:
        return f"{'-':>{width}}"
    return f"{100 * row['bytes_floor_us'] / row['us']:>{width - 1}.0f}%"


def row_table(rows: list[dict]) -> str:
    """Every row, as bench_experts.py prints them; ``%bytes``: `bytes_floor_cell`."""
    lines = [(f"{'shape':14} {'T':>6} {'format':11} {'backend':20} {'us':>10} {'floor':>9} "
              f"{'%floor':>7} {'%bytes':>7} {'TB/s':>6} {'TFLOP/s':>8} {'err':>8} "
              f"{'err_bf16':>8}")]
    for r in rows:
        lines.append(f"{r['shape']:14} {r['tokens']:>6} {format_of(r):11} {r['backend']:20} "
                     f"{r['us']:>10.1f} {r['floor_us']:>9.1f} {r['pct_floor']:>6.1f}% "
                     f"{bytes_floor_cell(r)} "
                     f"{r['tb_per_s']:>6.2f} {r['tflop_per_s']:>8.1f} {r['rel_err']:>8.1e} "
                     f"{r.get('err_bf16', float('nan')):>8.1e}" + (" NaN!" if r["nan"] else ""))
    return "\n".join(lines)


def summary_table(rows: list[dict]) -> str:
    """One line per shape, T and format: ours, the floor, the fraction of the byte floor of
    decode rows (`bytes_floor_cell`), vLLM's kernel, speedup."""
    lines = [(f"{'shape':14} {'T':>6} {'format':11} {'ours':10} {'ours us':>9} "
              f"{'floor us':>9} {'%floor':>7} {'%bytes':>7} {'vLLM us':>9} {'speedup':>7}")]
    for (shape, tokens, fmt), cells in cells_by_key(rows).items():
        ours, vllm = best_ours(cells), cells.get(VLLM)
        floor = next(iter(cells.values()))["floor_us"]
        lines.append(
            f"{shape:14} {tokens:>6} {fmt:11} {ours['backend'] if ours else '-':10} "
            + (f"{ours['us']:>9.1f} " if ours else f"{'-':>9} ")
            + f"{floor:>9.1f} "
            + (f"{ours['pct_floor']:>6.0f}% " if ours else f"{'-':>7} ")
            + f"{bytes_floor_cell(ours)} "
            + (f"{vllm['us']:>9.1f} " if vllm else f"{'-':>9} ")
            + (f"{vllm['us'] / ours['us']:>6.2f}x" if ours and vllm else f"{'-':>7}"))
    return "\n".join(lines)


def _verdict(target: str, checked: list[tuple[str, bool]], absent: str) -> str:
    """``target: met/missed`` over ``(description, met)`` pairs."""
    if not checked:
        return f"{target}: not measured ({absent})"
    missed = [text for text, met in checked if not met]
    if not missed:
        return f"{target}: met ({len(checked)} of {len(checked)} rows)"
    return (f"{target}: missed at {len(missed)} of {len(checked)} rows: " + "; ".join(missed))


def target_lines(rows: list[dict]) -> list[str]:
    """The quantized experts' targets (issue 11), each met or missed with numbers."""
    cells = cells_by_key(rows)
    decode, prefill, versus_vllm = [], [], []
    for (shape, tokens, fmt), backends in cells.items():
        ours = best_ours(backends)
        if fmt == BF16 or ours is None:
            continue
        name = f"{shape} {fmt} T={tokens}"
        if tokens in DECODE_TOKENS:
            over = ours["us"] / ours["floor_us"]
            decode.append((f"{name} {over:.2f}x the floor", over <= DECODE_MAX_OVER_FLOOR))
        bf16 = best_ours(cells.get((shape, tokens, BF16), {}))
        if (fmt.startswith("fp8") and tokens in PREFILL_TOKENS and shape in PREFILL_SHAPES
                and bf16 is not None):
            speedup = bf16["us"] / ours["us"]
            text = (f"{name} {speedup:.2f}x bf16 ({ours['us']:.0f} us against "
                    f"{bf16['us']:.0f} us)")
            prefill.append((text, speedup >= PREFILL_MIN_SPEEDUP_OVER_BF16))
        if fmt.startswith("fp8") and VLLM in backends:
            speedup = backends[VLLM]["us"] / ours["us"]
            text = (f"{name} {speedup:.2f}x ({ours['us']:.1f} us against "
                    f"{backends[VLLM]['us']:.1f} us)")
            versus_vllm.append((text, speedup > 1))
    return [
        _verdict(f"decode (T={', '.join(map(str, DECODE_TOKENS))}) within "
                 f"{DECODE_MAX_OVER_FLOOR}x of the format's floor", decode,
                 "no quantized row of ours at those T"),
        _verdict(f"prefill (T={', '.join(map(str, PREFILL_TOKENS))}) fp8 at least "
                 f"{PREFILL_MIN_SPEEDUP_OVER_BF16}x faster than our bf16, "
                 f"{', '.join(PREFILL_SHAPES)}", prefill,
                 "needs fp8 and bf16 rows of ours at those shapes and T"),
        _verdict("faster than vLLM's fp8 Triton kernel where it runs", versus_vllm,
                 "no fp8 row with both ours and vllm-triton"),
    ]


def markdown(headers: list[dict], rows: list[dict]) -> str:
    header = headers[0]
    fp8 = [h["fp8_tflop_per_s"] for h in headers if "fp8_tflop_per_s" in h]
    out = [f"# Experts benchmark: {header['device']}, {header['date']}\n",
           f"torch {header['torch']}, triton {header['triton']}. Ceilings measured in the same "
           f"run as each row: HBM read "
           f"{_span([h['read_tb_per_s'] for h in headers], '.2f')} TB/s, dense bf16 "
           f"{_span([h['bf16_tflop_per_s'] for h in headers], '.0f')} TFLOP/s"
           + (f", dense fp8 {_span(fp8, '.0f')} TFLOP/s" if fp8 else "") + ". "
           "Times are medians of CUDA-graph replays (ours, `vllm-triton` and "
           "`triton-kernels`) or eager calls (transformers' `hf-*`), each run after a "
           "1 GiB read that evicts L2 and leaves it clean; `%` is the floor over the time.\n"]
    if header.get("vllm"):
        out.append(f"`vllm-triton`: {header['vllm']}, its Triton kernel and tuned configs, "
                   "with its CUDA align, activation, fp8 activation quantization and sum "
                   "replaced by equivalents (benchmarks/peer_vllm.py).\n")
    if header.get("triton_kernels"):
        out.append(f"`triton-kernels`: {header['triton_kernels']}, `matmul_ogs` with vLLM's "
                   "routing and weight layout for GPT-OSS on Hopper "
                   "(benchmarks/peer_triton_kernels.py).\n")
    by_section = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        by_section[(r["shape"], format_of(r))][r["tokens"]][r["backend"]] = r
    for (shape, fmt), per_tokens in by_section.items():
        backends = sorted({b for t in per_tokens.values() for b in t},
                          key=lambda b: (is_peer(b), b))
        out.append(f"## {shape}" + ("" if fmt == BF16 else f", {fmt}") + "\n")
        out.append("| T | floor us | " + " | ".join(backends) + " | ours vs best peer |")
        out.append("|---|---|" + "---|" * len(backends) + "---|")
        for tokens in sorted(per_tokens):
            cells = per_tokens[tokens]
            floor = next(iter(cells.values()))["floor_us"]
            line = [str(tokens), f"{floor:.1f}"]
            for b in backends:
                r = cells.get(b)
                line.append("-" if r is None else f"{r['us']:.1f} ({r['pct_floor']:.0f}%)")
            ours = [r["us"] for b, r in cells.items() if is_ours(b)]
            peers = [r["us"] for b, r in cells.items() if is_peer(b)]
            line.append(f"{min(peers) / min(ours):.2f}x" if ours and peers else "-")
            out.append("| " + " | ".join(line) + " |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--merged")
    parser.add_argument("--short", action="store_true",
                        help="print the targets and the short table instead of Markdown")
    parser.add_argument("--rows", action="store_true",
                        help="print every row (each backend's, with the byte-floor fraction of "
                             "decode rows) instead of Markdown")
    args = parser.parse_args()
    headers, rows = [], []
    for path in args.runs:
        with open(path) as f:
            data = json.load(f)
        headers.append(data["header"])
        rows += data["rows"]
    if args.merged and rows:
        with open(args.merged + ".json", "w") as f:
            json.dump({"header": headers[0], "rows": rows}, f, indent=1)
        with open(args.merged + ".csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    if args.short:
        print("\n".join(target_lines(rows)) + "\n\n" + summary_table(rows))
    elif args.rows:
        print(row_table(rows))
    else:
        print(markdown(headers, rows))


if __name__ == "__main__":
    main()
