"""One MoE layer trained: forward + backward of ours against transformers, same weights.

    python benchmarks/bench_train.py --out DIR [--shapes qwen3-30b-a3b,olmoe] [--tokens 8192]
    python benchmarks/bench_train.py --out DIR --smoke     # CPU, tiny: checks the script

Legend: T tokens, H hidden size, I expert intermediate size, E experts, K experts
per token.

A row is one (shape, T, way): the sparse-MoE block of a one-layer transformers
model at the checkpoint's widths (router + routed experts, random bf16 weights
from seed 0), fed ``x [1, T, H]``, then ``out.backward(g)`` with a fixed random
``g``; parameter gradients are dropped between steps. The ways:

- ``hf`` / ``hf-compiled``: transformers' block with ``experts_implementation=
  "grouped_mm"``, eager / ``torch.compile(fullgraph=True)``;
- ``tmo`` / ``tmo-compiled``: the same model patched by ``torch_moe_ops.hf.patch``
  (the same expert tensors), eager / compiled with ``torch_moe_ops.backend()``.

Per row: ms per step (median of CUDA-event-timed back-to-back steps after a
warm-up; compile time excluded and reported), useful TFLOP/s = 3 * 2*T*K*3*H*I /
time (forward 2*T*K*(2I*H + I*H) FLOPs, backward twice that), that rate as a
fraction of a dense bf16 ``torch.mm`` 8192^3 timed in the same run, the peak
memory the step adds above the weights and inputs (``max_memory_allocated``
after a reset, minus what was allocated before the step), and the relative
error of the output and of every gradient against the ``hf`` way.

Targets (at T=8192, same run): faster than ``hf-compiled`` at every shape; at
least 55% of dense for Qwen3-30B-A3B, 60% for OLMoE, 80% for Mixtral-8x7B; peak
memory no higher than ``hf-compiled``'s.

A row that does not fit is recorded as OOM. ``--budget-s`` stops starting rows
past that many seconds (the rest are listed as skipped). Writes ``train.json``
and ``train.md`` to ``--out`` (and ``train.png`` where matplotlib is installed)
and prints a short table last.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import time
import traceback

import bench_model
import torch
import transformers

import torch_moe_ops as tmo
import torch_moe_ops.hf

WAYS = ("hf", "hf-compiled", "tmo", "tmo-compiled")
TARGET_TOKENS = 8192
TARGET_DENSE_FRACTION = {"qwen3-30b-a3b": 0.55, "olmoe": 0.60, "mixtral-8x7b": 0.80}


# A one-layer model of each checkpoint's widths: bench_model's shapes.
SHAPES = bench_model.SHAPES
SMOKE_SHAPE = bench_model.ModelShape("Qwen3MoeConfig", 1, dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16))


def moe_sizes(cfg: transformers.PretrainedConfig) -> dict:
    experts = next(getattr(cfg, n) for n in ("num_experts", "num_local_experts",
                                              "n_routed_experts") if hasattr(cfg, n))
    inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    return {"E": experts, "K": cfg.num_experts_per_tok, "H": cfg.hidden_size, "I": inter}


def useful_flops(sizes: dict, tokens: int) -> float:
    return 3 * 2 * tokens * sizes["K"] * 3 * sizes["H"] * sizes["I"]


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.smoke = args.smoke
        self.device = torch.device("cpu" if args.smoke else "cuda")
        self.dtype = torch.float32 if args.smoke else torch.bfloat16
        self.start = time.monotonic()
        self.skipped: list[str] = []

    def sync(self) -> None:
        if not self.smoke:
            torch.cuda.synchronize()

    def time_s(self, step, iters: int) -> float:
        """Median seconds of ``step`` over ``iters`` back-to-back calls."""
        if self.smoke:
            times = []
            for _ in range(iters):
                begin = time.perf_counter()
                step()
                times.append(time.perf_counter() - begin)
            return statistics.median(times)
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
        self.sync()
        marks[0].record()
        for i in range(iters):
            step()
            marks[i + 1].record()
        self.sync()
        return statistics.median(marks[i].elapsed_time(marks[i + 1]) * 1e-3
                                 for i in range(iters))

    def dense_tflops(self) -> float | None:
        if self.smoke:
            return None
        a = torch.randn(8192, 8192, device=self.device, dtype=self.dtype)
        b = torch.randn(8192, 8192, device=self.device, dtype=self.dtype)
        for _ in range(3):
            a @ b
        seconds = self.time_s(lambda: a @ b, 20)
        return 2 * 8192**3 / seconds / 1e12

    def release(self) -> None:
        gc.collect()
        torch._dynamo.reset()
        if not self.smoke:
            torch.cuda.empty_cache()


def build_block(shape: bench_model.ModelShape, way: str, bench: Bench,
                experts: str = "auto") -> torch.nn.Module:
    """The first layer's MoE block for ``way``; the same weights for every way (seed 0).
    ``experts`` names the experts backend of ``tmo-compiled``."""
    torch.manual_seed(0)
    with bench.device:
        model = transformers.AutoModelForCausalLM.from_config(
            shape.config(1), dtype=bench.dtype, experts_implementation="grouped_mm")
    if way.startswith("tmo"):
        report = tmo.hf.patch(model)
        if not report.blocks:
            raise RuntimeError(f"patch replaced no block: {report}")
    block = model.model.layers[0].mlp
    # Only the block is measured: drop the rest of the model's memory.
    model.model.layers[0].mlp = torch.nn.Identity()
    del model
    block.train()
    if way.endswith("compiled"):
        backend = tmo.backend(experts=experts) if way.startswith("tmo") else "inductor"
        block = torch.compile(block, backend=backend, fullgraph=True, dynamic=False)
    return block


def inputs(sizes: dict, tokens: int, bench: Bench):
    gen = torch.Generator(bench.device).manual_seed(1)
    x = torch.randn(1, tokens, sizes["H"], generator=gen, device=bench.device)
    g = torch.randn(1, tokens, sizes["H"], generator=gen, device=bench.device)
    return x.to(bench.dtype), g.to(bench.dtype)


def training_step(block: torch.nn.Module, x: torch.Tensor, g: torch.Tensor,
                  after_forward=None):
    """``step() -> out``: the block's forward on ``x`` and ``out.backward(g)``, the
    gradients of ``x`` and of the block's parameters dropped first;
    ``after_forward()``, when given, is called between the two."""
    x.requires_grad_(True)
    params = list(block.parameters())

    def step():
        for p in params:
            p.grad = None
        x.grad = None
        out = block(x)
        out = out[0] if isinstance(out, tuple) else out
        if after_forward is not None:
            after_forward()
        out.backward(g)
        return out

    return step


# Elements per slice of `rel_err`.
ERROR_SLICE = 2**26


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` in fp32, a slice at a time: DeepSeek-V3's gradient of w13
    is 15 GB in bf16, and whole fp32 copies of it and of the difference ran out of
    memory where the layer itself fitted."""
    a, b = a.reshape(-1), b.reshape(-1)
    diff = norm = 0.0
    for start in range(0, b.numel(), ERROR_SLICE):
        a_part, b_part = a[start:start + ERROR_SLICE].float(), b[start:start + ERROR_SLICE].float()
        diff += (a_part - b_part).square().sum().item()
        norm += b_part.square().sum().item()
    return diff**0.5 / max(norm**0.5, 1e-12)


def run_row(bench: Bench, shape_name: str, shape: bench_model.ModelShape, tokens: int, way: str,
            reference: dict | None) -> dict:
    """One (shape, T, way): time, FLOP rate, peak memory and errors against ``reference``
    (the ``hf`` way's output and gradients), which the ``hf`` row fills in."""
    sizes = moe_sizes(shape.config(1))
    row = {"shape": shape_name, "tokens": tokens, "way": way, **sizes}
    block = build_block(shape, way, bench)
    x, g = inputs(sizes, tokens, bench)
    step = training_step(block, x, g)
    # Named as in the uncompiled block, so every way's gradients meet the reference's.
    params = dict(getattr(block, "_orig_mod", block).named_parameters())

    begin = time.monotonic()
    out = step()
    bench.sync()
    row["first_step_s"] = time.monotonic() - begin
    grads = {"x": x.grad.detach(),
             **{n: p.grad.detach() for n, p in params.items() if p.grad is not None}}
    if reference is None:
        # Kept across the ways: a copy, since the next steps replace the gradients.
        reference = {"out": out.detach().clone(), **{n: t.clone() for n, t in grads.items()}}
        row["errors"] = {}
    else:
        row["errors"] = {"out": rel_err(out, reference["out"]),
                         **{n: rel_err(t, reference[n]) for n, t in grads.items()
                            if n in reference}}
    del out, grads
    for _ in range(2):
        step()
    bench.sync()
    if not bench.smoke:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    seconds = bench.time_s(step, bench.args.iters)
    flops = useful_flops(sizes, tokens)
    row.update(ms=seconds * 1e3, tflops=flops / seconds / 1e12)
    if not bench.smoke:
        row["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
        row["step_peak_mib"] = (torch.cuda.max_memory_allocated() - before) / 2**20
    return row, reference


def run(bench: Bench, shapes: dict, tokens_list: list[int], ways: list[str]) -> list[dict]:
    rows = []
    dense = bench.dense_tflops()
    bench.dense = dense
    for tokens in tokens_list:
        for shape_name, shape in shapes.items():
            reference = None
            for way in ways:
                what = f"{shape_name} T={tokens} {way}"
                if time.monotonic() - bench.start > bench.args.budget_s:
                    bench.skipped.append(what)
                    continue
                try:
                    row, reference = run_row(bench, shape_name, shape, tokens, way, reference)
                except torch.OutOfMemoryError as error:
                    print(f"{what}: {str(error).splitlines()[0]}")
                    row = {"shape": shape_name, "tokens": tokens, "way": way, "error": "OOM"}
                except RuntimeError as error:
                    # A way that refuses the shape or fails: kept, not fatal. The row
                    # keeps the first line; the log gets the whole traceback, since
                    # an Inductor error says what went wrong only further down.
                    traceback.print_exc()
                    row = {"shape": shape_name, "tokens": tokens, "way": way,
                           "error": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"}
                bench.release()
                if dense and "tflops" in row:
                    row["dense_fraction"] = row["tflops"] / dense
                rows.append(row)
                print(line(row), flush=True)
                save(bench, rows)
    return rows


def line(row: dict) -> str:
    case = f"{row['shape']} T={row['tokens']} {row['way']}"
    if "error" in row:
        return f"{case:40} {row['error']}"
    errs = row.get("errors") or {}
    worst = max(errs.values()) if errs else None
    frac = row.get("dense_fraction")
    return (f"{case:40} {row['ms']:9.2f} ms {row['tflops']:7.1f} TFLOP/s "
            f"{'' if frac is None else f'{100 * frac:5.1f}% dense'} "
            f"peak +{row.get('step_peak_mib', 0):8.0f} MiB "
            f"{'' if worst is None else f'max rel err {worst:.1e}'}")


def verdicts(rows: list[dict]) -> list[str]:
    """Each target at T=8192: met or missed, with the numbers."""
    out = []
    by = {(r["shape"], r["tokens"], r["way"]): r for r in rows if "ms" in r}
    for shape in sorted({r["shape"] for r in rows}):
        ours = by.get((shape, TARGET_TOKENS, "tmo-compiled"))
        peer = by.get((shape, TARGET_TOKENS, "hf-compiled"))
        if ours and peer:
            speed = peer["ms"] / ours["ms"]
            out.append(f"{shape}: {speed:.2f}x compiled transformers' speed "
                       f"({ours['ms']:.2f} against {peer['ms']:.2f} ms): "
                       f"{'met' if speed > 1 else 'MISSED'}")
            if "step_peak_mib" in ours:
                lower = round(ours["step_peak_mib"]) <= round(peer["step_peak_mib"])
                out.append(f"{shape}: step peak +{ours['step_peak_mib']:.0f} MiB against "
                           f"+{peer['step_peak_mib']:.0f} MiB: {'met' if lower else 'MISSED'}")
        target = TARGET_DENSE_FRACTION.get(shape)
        if ours and target and "dense_fraction" in ours:
            out.append(f"{shape}: {100 * ours['dense_fraction']:.1f}% of dense (target "
                       f"{100 * target:.0f}%): "
                       f"{'met' if ours['dense_fraction'] >= target else 'MISSED'}")
    return out


def meta(bench: Bench) -> dict:
    info = {"date": str(datetime.date.today()), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "dtype": str(bench.dtype).removeprefix("torch."), "smoke": bench.smoke,
            "dense_tflops": getattr(bench, "dense", None)}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    info["device"] = ("CPU " + (platform.processor() or platform.machine()) if bench.smoke
                      else torch.cuda.get_device_name())
    return info


def table(rows: list[dict]) -> str:
    lines = [("| shape | T | way | ms/step | TFLOP/s | % dense | step peak MiB | peak MiB | "
              "first step s | max rel err vs hf |"), "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['tokens']} | {r['way']} | {r['error']} "
                         "| | | | | | |")
            continue
        errs = r.get("errors") or {}
        frac = r.get("dense_fraction")
        lines.append(
            f"| {r['shape']} | {r['tokens']} | {r['way']} | {r['ms']:.2f} | {r['tflops']:.1f} | "
            f"{'-' if frac is None else f'{100 * frac:.1f}'} | "
            f"{r.get('step_peak_mib', float('nan')):.0f} | {r.get('peak_mib', float('nan')):.0f} | "
            f"{r['first_step_s']:.1f} | {max(errs.values()) if errs else 0:.1e} |")
    return "\n".join(lines)


def save(bench: Bench, rows: list[dict]) -> None:
    os.makedirs(bench.args.out, exist_ok=True)
    info = meta(bench)
    with open(os.path.join(bench.args.out, "train.json"), "w") as f:
        json.dump({"meta": info, "rows": rows, "skipped": bench.skipped}, f, indent=1)
    header = (f"{info['device']}, {info['date']}, torch {info['torch']}, triton "
              f"{info['triton']}, transformers {info['transformers']}, {info['dtype']}; dense "
              f"bf16 mm: {info['dense_tflops'] and round(info['dense_tflops'], 1)} TFLOP/s")
    text = "\n\n".join(["# One MoE layer, forward + backward", header, table(rows),
                        "\n".join(f"- {v}" for v in verdicts(rows)),
                        *(["Skipped: " + "; ".join(bench.skipped)] if bench.skipped else [])])
    with open(os.path.join(bench.args.out, "train.md"), "w") as f:
        f.write(text + "\n")


def plot(bench: Bench, rows: list[dict]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no train.png")
        return
    done = [r for r in rows if "ms" in r]
    shapes = sorted({(r["shape"], r["tokens"]) for r in done})
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(shapes)), 4))
    width = 0.8 / len(WAYS)
    for i, way in enumerate(WAYS):
        values = [next((r["tflops"] for r in done if (r["shape"], r["tokens"]) == s
                        and r["way"] == way), 0) for s in shapes]
        ax.bar([j + i * width for j in range(len(shapes))], values, width, label=way)
    if getattr(bench, "dense", None):
        ax.axhline(bench.dense, color="k", linestyle="--", label="dense bf16 mm")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
    ax.set_xticklabels([f"{s}\nT={t}" for s, t in shapes], fontsize=7)
    ax.set_ylabel("useful TFLOP/s (forward + backward)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(bench.args.out, "train.png"), dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny shape on the CPU, fp32")
    parser.add_argument("--shapes", default="qwen3-30b-a3b,olmoe,mixtral-8x7b,gpt-oss-20b,"
                        "deepseek-v3")
    parser.add_argument("--tokens", default="8192,4096,16384,32768",
                        help="comma-separated T, run in this order")
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=400)
    args = parser.parse_args(argv)
    bench = Bench(args)
    if args.smoke:
        shapes, tokens = {"smoke": SMOKE_SHAPE}, [64]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_train.py needs a CUDA GPU; --smoke runs tiny sizes on CPU")
        shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
        tokens = [int(t) for t in args.tokens.split(",")]
    rows = run(bench, shapes, tokens, args.ways.split(","))
    plot(bench, rows)
    print("\n" + table(rows) + "\n" + "\n".join(verdicts(rows)))


if __name__ == "__main__":
    main()
