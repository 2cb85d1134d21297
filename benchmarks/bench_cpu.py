"""Patched transformers models on the CPU against transformers' own experts implementations.

    python benchmarks/bench_cpu.py --families mixtral,gpt_oss --out results/cpu-DATE.md

The models are those of ``examples/hf_generate.py`` (a small random model per
family: 256 hidden, 16 experts, top-4, 2 layers, float32). Per family, the ways:

- ``hf-<impl>``: unpatched transformers with ``set_experts_implementation(impl)``
  for each implementation that runs on the CPU (``eager``, ``grouped_mm``,
  ``batched_mm``), eager and under ``torch.compile(backend=<inner>)``;
- ``tmo``: ``torch_moe_ops.hf.patch`` (experts ``"auto"``: the ``cpu`` backend on
  the CPU), eager and under ``torch.compile(backend=tmo.backend(inner=<inner>),
  fullgraph=True)``.

Compiled means ``model.forward = torch.compile(model.forward, ...)``, as
``examples/hf_generate.py`` does, so that ``generate`` runs the compiled forward.
Per way: greedy ``generate`` tokens/s (batch 2, 16 prompt tokens, 16 new tokens,
best of ``--repeats`` after two warm-up calls that also compile), milliseconds
per forward without KV cache of ``input_ids [2, 1]`` (decode-sized) and
``[2, 16]`` (prefill-sized), best of ``--repeats * 10``, and the share of new
tokens equal to unpatched eager transformers' (random weights: near ties may
flip). Best-of rather than median: on a machine shared with other jobs, the
fastest run is the one least disturbed. ``--threads`` sets torch's intra-op
threads (default 1: OpenMP threads that wait on a core another job holds make
timings meaningless).

Prints a table; ``--out`` also writes it as markdown with the machine, the
versions and, per family and mode, whether ``tmo`` is at least as fast as the
best transformers implementation.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import os
import pathlib
import platform
import sys
import time
from collections.abc import Callable

import torch
import transformers

import torch_moe_ops as tmo
from torch_moe_ops import hf

# Legend: B batch, S sequence.

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
from hf_generate import FAMILY_NAMES, small_config

HF_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")
BATCH, PROMPT_TOKENS, NEW_TOKENS = 2, 16, 16
FORWARD_SHAPES = {"decode": (BATCH, 1), "prefill": (BATCH, PROMPT_TOKENS)}


@dataclasses.dataclass
class Row:
    family: str
    way: str
    mode: str
    tokens_per_s: float
    decode_ms: float
    prefill_ms: float
    same_tokens: float
    compile_s: float


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(model, ids_BS: torch.Tensor, reference_BS: torch.Tensor | None,
            repeats: int) -> tuple[float, float, float, float, float, torch.Tensor]:
    """(tokens/s, decode ms, prefill ms, share of tokens equal to the reference, seconds of
    the warm-up calls, the generated ids)."""
    kwargs = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False}
    inputs = {name: torch.randint(3, model.config.vocab_size, shape,
                                  generator=torch.Generator().manual_seed(1))
              for name, shape in FORWARD_SHAPES.items()}
    start = time.perf_counter()
    # Twice: the second call meets the grown KV cache, where a compiled forward
    # recompiles with dynamic sizes; each forward shape compiles once more.
    out_BS = model.generate(ids_BS, **kwargs)
    model.generate(ids_BS, **kwargs)
    for ids in inputs.values():
        model(ids, use_cache=False)
    warmup_s = time.perf_counter() - start
    tokens_per_s = BATCH * NEW_TOKENS / best_seconds(lambda: model.generate(ids_BS, **kwargs),
                                                     repeats)
    forward_ms = {name: 1e3 * best_seconds(lambda ids=ids: model(ids, use_cache=False),
                                           10 * repeats)
                  for name, ids in inputs.items()}
    new_BS = out_BS[:, ids_BS.shape[1]:]
    same = 1.0 if reference_BS is None else (new_BS == reference_BS).float().mean().item()
    return (tokens_per_s, forward_ms["decode"], forward_ms["prefill"], same, warmup_s, new_BS)


def ways(base, inner: str):
    """(way, mode, model) for every way, each on its own copy of ``base``."""
    for impl in HF_IMPLEMENTATIONS:
        for mode in ("eager", "compiled"):
            model = copy.deepcopy(base)
            model.set_experts_implementation(impl)
            if mode == "compiled":
                # transformers' eager experts loop breaks the graph: no fullgraph for peers.
                model.forward = torch.compile(model.forward, backend=inner)
            yield f"hf-{impl}", mode, model
    for mode in ("eager", "compiled"):
        model = copy.deepcopy(base)
        hf.patch(model)
        if mode == "compiled":
            model.forward = torch.compile(model.forward, backend=tmo.backend(inner=inner),
                                          fullgraph=True)
        yield "tmo", mode, model


def bench_family(family: str, inner: str, repeats: int) -> list[Row]:
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(small_config(family, 2)).eval()
    ids_BS = torch.randint(3, base.config.vocab_size, (BATCH, PROMPT_TOKENS),
                           generator=torch.Generator().manual_seed(0))
    rows, reference_BS = [], None
    with torch.no_grad():
        for way, mode, model in ways(base, inner):
            torch._dynamo.reset()
            try:
                tps, decode_ms, prefill_ms, same, warmup_s, new_BS = measure(
                    model, ids_BS, reference_BS, repeats)
            except Exception as e:  # noqa: BLE001 (one way failing must not end the run)
                print(f"{family} {way} {mode}: failed: {type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}", flush=True)
                continue
            if reference_BS is None:
                reference_BS = new_BS
            rows.append(Row(family, way, mode, tps, decode_ms, prefill_ms, same, warmup_s))
            print(f"{family:12} {way:15} {mode:8} {tps:8.1f} tok/s  decode {decode_ms:7.3f} ms"
                  f"  prefill {prefill_ms:7.3f} ms  same {same:4.0%}  warm-up {warmup_s:5.1f} s",
                  flush=True)
    return rows


def verdicts(rows: list[Row]) -> list[str]:
    """Per family and mode: tmo against the best transformers way on each measure."""
    lines = []
    for family in dict.fromkeys(r.family for r in rows):
        for mode in ("eager", "compiled"):
            ours = [r for r in rows if r.family == family and r.mode == mode and r.way == "tmo"]
            peers = [r for r in rows if r.family == family and r.mode == mode and r.way != "tmo"]
            if not ours or not peers:
                continue
            parts = []
            for label, key, higher in (("generate", "tokens_per_s", True),
                                       ("decode fwd", "decode_ms", False),
                                       ("prefill fwd", "prefill_ms", False)):
                best = (max if higher else min)(peers, key=lambda r: getattr(r, key))
                value, peer = getattr(ours[0], key), getattr(best, key)
                met = value >= peer if higher else value <= peer
                unit = "tok/s" if higher else "ms"
                parts.append(f"{label} {'met' if met else 'missed'} ({value:.3g} vs "
                             f"{best.way} {peer:.3g} {unit}, {value / peer:.2f}x)")
            lines.append(f"- {family}, {mode}: " + "; ".join(parts))
    return lines


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def table(rows: list[Row]) -> list[str]:
    columns = ("family", "way", "mode", "generate tok/s", "decode fwd ms", "prefill fwd ms",
               "same tokens", "warm-up s")
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    lines += [f"| {r.family} | {r.way} | {r.mode} | {r.tokens_per_s:.1f} | {r.decode_ms:.3f} | "
              f"{r.prefill_ms:.3f} | {r.same_tokens:.0%} | {r.compile_s:.1f} |" for r in rows]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILY_NAMES))
    parser.add_argument("--inner", choices=("inductor", "aot_eager", "eager"),
                        default="inductor", help="compiler of every compiled way")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="markdown file to write the results to")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # Each way compiles its own copy: more entries than Dynamo's default cache holds.
    torch._dynamo.config.recompile_limit = 64
    families = args.families.split(",")
    for family in families:
        if family not in FAMILY_NAMES:
            raise ValueError(f"--families must name families of {', '.join(FAMILY_NAMES)}, "
                             f"got {family!r}")
    started = time.perf_counter()
    rows = [row for family in families for row in bench_family(family, args.inner, args.repeats)]
    title = ("# CPU: patched transformers models against transformers' experts "
             f"implementations, {datetime.date.today().isoformat()}")
    machine = (f"{cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch "
               f"thread(s); torch {torch.__version__}, transformers {transformers.__version__}; "
               f"compiled ways use inner compiler `{args.inner}`; families: "
               f"{', '.join(families)}; run took {time.perf_counter() - started:.0f} s.")
    method = ("Models of `examples/hf_generate.py` (256 hidden, 16 experts, top-4, 2 layers, "
              f"float32). generate: batch 2, 16 prompt and 16 new tokens, best of {args.repeats}; "
              "forward: no KV cache, input [2, 1] (decode) and [2, 16] (prefill), best of "
              f"{10 * args.repeats}. `tmo` is `torch_moe_ops.hf.patch` (experts backend `auto`); "
              "its compiled way runs `torch_moe_ops.backend()` with fullgraph=True.")
    lines = [title, "", machine, "", method, "", *table(rows), "",
             "## tmo against the best transformers way", "", *verdicts(rows)]
    print("\n".join(lines))
    if args.out:
        pathlib.Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
