"""``model.generate`` with a static KV cache under torch.compile: our patch against transformers.

    python benchmarks/bench_generate.py --out DIR            # GPU: the four models below
    python benchmarks/bench_generate.py --out DIR --smoke    # CPU, tiny models: checks the script

Legend: B batch, S prompt length, N new tokens.

Each model is bench_model's shape of a checkpoint (real hidden size, experts,
top-k, attention and vocabulary; ``--layers`` decoder layers, random weights from
seed 0): Qwen3-30B-A3B, OLMoE, Mixtral-8x7B and GPT-OSS-20B. A row is one
(model, B, S, way): greedy ``generate`` of exactly N tokens after a random
``[B, S]`` prompt, with ``cache_implementation="static"`` and compiled the way
transformers documents it for a static cache: ``generate`` compiles the model's
forward with the ``compile_config`` it is given (here ``mode="reduce-overhead"``:
Inductor and CUDA graphs) and runs every decode step on it, while the prefill
runs uncompiled (transformers' static cache gives its tensors static addresses
only when it is filled outside a compiled region; without them decode's CUDA
graphs would be skipped). ``--compiled-prefill`` runs the prefill on the
compiled forward too, through transformers' chunked prefill with one chunk of
the whole prompt (``prefill_chunk_size=S``: ``generate`` then sets the cache up
before the compiled call). Shapes are torch.compile's default: the decode graph
is compiled for the first batch, and a size that changes later (the batch, the
sliding-window cache's position count of GPT-OSS) recompiles it once with that
size dynamic, alike for both ways. The ways:

- ``hf-grouped_mm``: transformers with the experts implementation bench_model
  found best (``grouped_mm``); on a GPU its ``generate`` switches the decode
  steps to ``batched_mm`` by itself (the row records what decode ran);
- ``tmo-patch``: the same model after ``torch_moe_ops.hf.patch``, compiled with
  ``torch_moe_ops.backend(mode=...)``.

The ways of a model run side by side: both models are built, and for each row every
way's warm-up calls run, then the timed calls alternate between the ways. A batch-1
decode step is mostly host work (`profile_generate.py`), and a host's speed drifts by
1.4x over seconds: run one way after the other, the same code measured 0.98x and 1.43x
on one H200 host (2026-11-26); alternated, both ways meet the same drift.

Per row: prefill ms (time to first token: from the call to the moment the first
token's logits exist; uncompiled unless ``--compiled-prefill``), decode tokens/s (``B * (N - 1)``
over the time after that), the seconds of the first (compiling) call, and
whether the new tokens equal ``hf-grouped_mm``'s (else the first position where
a sequence differs), and how the first new token's logits compare
(`first_token_agreement`: with random weights the top logits nearly tie, so bf16
rounding alone can change a greedy token; a change beyond rounding is a real
disagreement).
Per way, the graph breaks Dynamo counted while compiling the forward (the
patched model must have none), the graphs compiled, and Inductor's CUDA-graph
skips. Rows run longest prompt first, so that the static cache, which
``generate`` sizes for the longest call so far, keeps one size. Times are CUDA
events on a GPU and the wall clock on the CPU; the median of ``--repeats`` calls
after ``--warmup`` (the first call compiles and records the decode CUDA graph;
a compiled prefill's graph records on the second call, so it warms up twice).

``--smoke`` runs the same families at tiny widths on the CPU in fp32, the decode
graphs on ``aot_eager`` (no Inductor C++ build), one short prompt of batch 2 and
6 new tokens (each overridable), where the new tokens must be equal.

Writes ``generate.json`` and ``generate.md`` (device, date, versions, table) to
``--out`` and prints the table last. A way that raises is recorded with its error
(``failed``) and dropped; the other ways and models still run. ``--budget-s`` starts no
model past that many seconds (the rest are listed as skipped).
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
import bench_train
import torch
import transformers
from torch._dynamo.utils import counters

from torch_moe_ops.config import QuantSpec

# The script's default: the GPU run.
MODELS = ("qwen3-30b-a3b", "olmoe", "mixtral-8x7b", "gpt-oss-20b")
WAYS = ("hf-grouped_mm", "tmo-patch")
REFERENCE_WAY = "hf-grouped_mm"
# Tiny models of the same families for --smoke; a large initializer_range so
# that greedy picks are far from ties.
SMOKE_COMMON = dict(vocab_size=128, hidden_size=64, num_attention_heads=4,
                    num_key_value_heads=2, initializer_range=0.2)
SMOKE_SHAPES = {
    "qwen3-30b-a3b": bench_model.ModelShape(
        "Qwen3MoeConfig", 2, {**bench_train.SMOKE_SHAPE.kwargs, "initializer_range": 0.2}),
    "olmoe": bench_model.ModelShape("OlmoeConfig", 2, dict(
        SMOKE_COMMON, intermediate_size=32, num_experts=8, num_experts_per_tok=2)),
    "mixtral-8x7b": bench_model.ModelShape("MixtralConfig", 2, dict(
        SMOKE_COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
    "gpt-oss-20b": bench_model.ModelShape("GptOssConfig", 2, dict(
        SMOKE_COMMON, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
        head_dim=16, sliding_window=8)),
}


# A greedy token that changes where the reference's top two logits lie within this
# fraction of the row's largest logit is put down to rounding: the patched model's bf16
# logits differ from transformers' by up to 5.4e-2 of it (H200, 2026-11-26).
ROUNDING_GAP = 6e-2


class Clock:
    """Marks on the GPU's stream (CUDA events) or the wall clock (CPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start, end) -> float:
        if not self.cuda:
            return (end - start) * 1e3
        end.synchronize()
        return start.elapsed_time(end)


class FirstToken(transformers.LogitsProcessor):
    """Leaves the scores alone; marks when the first token's logits exist (the end of
    prefill), keeps them (``[B, V]`` fp32, on the host) and which experts implementation
    the model's config names then (the one decode runs: ``generate`` switches it before
    the first token)."""

    def __init__(self, clock: Clock, config):
        self.clock, self.config = clock, config
        self.marked = None
        self.decode_experts = None
        self.scores_BV = None

    def __call__(self, input_ids, scores):
        if self.marked is None:
            self.marked = self.clock.mark()
            self.decode_experts = getattr(self.config, "_experts_implementation", None)
            self.scores_BV = scores.float().cpu()
        return scores


def compile_config(way: str, args) -> transformers.CompileConfig:
    """What ``generate`` compiles the decode steps with, for ``way``."""
    config = transformers.CompileConfig(
        fullgraph=False, **bench_model.compile_kwargs(way, args.mode, inner=args.inner))
    # transformers compiles on accelerators only unless told so (its flag for tests).
    config._compile_all_devices = args.device == "cpu"
    return config


def greedy_generate(model, ids_BS: torch.Tensor, new_tokens: int,
                    compiled: transformers.CompileConfig, processors=(),
                    compiled_prefill: bool = False) -> torch.Tensor:
    """Greedy static-cache ``generate`` of exactly ``new_tokens`` tokens: ``[B, S + N]``."""
    return model.generate(
        ids_BS, attention_mask=torch.ones_like(ids_BS), max_new_tokens=new_tokens,
        min_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
        compile_config=compiled, pad_token_id=0,
        prefill_chunk_size=ids_BS.shape[1] if compiled_prefill else None,
        logits_processor=transformers.LogitsProcessorList(list(processors)))


def generate_once(model, ids_BS: torch.Tensor, new_tokens: int, clock: Clock,
                  compiled: transformers.CompileConfig, compiled_prefill: bool) -> dict:
    """One greedy static-cache ``generate``: its new tokens ``[B, N]`` and times."""
    first = FirstToken(clock, model.config)
    start = clock.mark()
    out_BT = greedy_generate(model, ids_BS, new_tokens, compiled, [first], compiled_prefill)
    end = clock.mark()
    prefill_ms = clock.ms(start, first.marked)
    return {"tokens": out_BT[:, ids_BS.shape[1]:].cpu(), "prefill_ms": prefill_ms,
            "decode_ms": clock.ms(start, end) - prefill_ms,
            "decode_experts": first.decode_experts, "first_scores": first.scores_BV}


def first_token_agreement(got_BV: torch.Tensor, want_BV: torch.Tensor) -> dict:
    """How the first new token's logits of two ways compare: the largest difference over
    the largest logit, the sequences whose greedy token differs, and of those, the ones
    that rounding does not explain: the reference's best logit lies more than
    `ROUNDING_GAP` of the row's largest logit above its logit of the token chosen (bf16
    rounding of random-weight models, whose top logits nearly tie, explains a change
    within it). Scores that ``generate``'s own processors set to -inf in both (the
    end-of-text token under ``min_new_tokens``) agree; -inf in one of them only is an
    infinite difference."""
    diff_BV = torch.where(got_BV == want_BV, 0.0, (got_BV - want_BV).abs())
    finite_BV = want_BV.isfinite()
    scale_B = torch.where(finite_BV, want_BV.abs(), 0.0).amax(dim=1).clamp(min=1e-12)
    chosen_B = got_BV.argmax(dim=1)
    differs_B = chosen_B != want_BV.argmax(dim=1)
    gap_B = want_BV.amax(dim=1) - want_BV.gather(1, chosen_B[:, None])[:, 0]
    unexplained_B = differs_B & (gap_B > ROUNDING_GAP * scale_B)
    return {"logits_rel_diff": float((diff_BV.amax(dim=1) / scale_B).max()),
            "first_token_differs": int(differs_B.sum()),
            "first_token_differs_beyond_rounding": int(unexplained_B.sum())}


def first_mismatch(got_BN: torch.Tensor, want_BN: torch.Tensor) -> int | None:
    """The first new-token position where any sequence differs (None: all equal)."""
    differs_N = (got_BN != want_BN).any(dim=0)
    return int(differs_N.nonzero()[0]) if differs_N.any() else None


def prompts(cfg, batch: int, seq: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(batch * 100_003 + seq)
    return torch.randint(3, cfg.vocab_size, (batch, seq), generator=generator).to(device)


class CompileCounts:
    """What Dynamo and Inductor counted while one way's calls ran: the ways share
    Dynamo's global counters, so each call adds what changed during it to its way's."""

    def __init__(self):
        self.graph_breaks, self.graphs, self.cudagraph_skips = 0, 0, 0
        self.break_reasons: set[str] = set()

    @staticmethod
    def _now() -> tuple[int, int, int]:
        return (sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"],
                counters["inductor"]["cudagraph_skips"])

    def run(self, fn, *args):
        before, reasons_before = self._now(), dict(counters["graph_break"])
        try:
            return fn(*args)
        finally:
            breaks, graphs, skips = (after - b for after, b in zip(self._now(), before))
            self.graph_breaks += breaks
            self.graphs += graphs
            self.cudagraph_skips += skips
            # Only the reasons this call counted: the counter holds every way's.
            self.break_reasons.update(reason for reason, count in counters["graph_break"].items()
                                      if count > reasons_before.get(reason, 0))


def bench_model_ways(name: str, shape: bench_model.ModelShape, ways: list[str], rows, args,
                     failed: list[dict]) -> tuple[list[dict], list[dict]]:
    """Every (B, S) row of one model, its ways interleaved: each way's warm-up calls, then
    the timed calls way after way, so that every way meets the same host (batch-1 steps
    are mostly host work, whose speed drifts over seconds). A way that raises is recorded
    in ``failed`` and dropped. Returns the rows and what compiling each way counted."""
    device = torch.device(args.device)
    clock = Clock(device)
    torch._dynamo.reset()
    counters.clear()
    models = {way: bench_model.build(shape, way, args.layers, device=args.device,
                                     dtype=args.dtype, quant=args.quant_spec) for way in ways}
    compiled = {way: compile_config(way, args) for way in ways}
    counts = {way: CompileCounts() for way in ways}
    results = []
    for batch, seq in rows:
        ids_BS = prompts(models[ways[0]].config, batch, seq, device)
        runs = {way: [] for way in ways}
        seconds = dict.fromkeys(ways, 0.0)
        for _ in range(args.warmup + args.repeats):
            for way in [w for w in ways if w in models]:
                begin = time.perf_counter()
                try:
                    runs[way].append(counts[way].run(
                        generate_once, models[way], ids_BS, args.new_tokens, clock,
                        compiled[way], args.compiled_prefill))
                except Exception as error:  # noqa: BLE001 (a failing way is a result)
                    traceback.print_exc()
                    failed.append({"shape": name, "way": way,
                                   "error": f"{type(error).__name__}: {error}"[:2000]})
                    del models[way]
                seconds[way] += time.perf_counter() - begin
        reference = runs[REFERENCE_WAY][-1] if REFERENCE_WAY in models else None
        for way in [w for w in ways if w in models]:
            results.append(row_of(name, way, batch, seq, runs[way], reference, seconds[way],
                                  args))
    counted = []
    for way in ways:
        count = counts[way]
        counted.append({"shape": name, "way": way, "graph_breaks": count.graph_breaks,
                        "break_reasons": sorted(count.break_reasons), "graphs": count.graphs,
                        "cudagraph_skips": count.cudagraph_skips})
        print(f"{name:14s} {way:14s} forward compiled into {count.graphs} graphs, "
              f"{count.graph_breaks} graph breaks, {count.cudagraph_skips} CUDA-graph skips",
              flush=True)
        if not count.graphs:
            print(f"{name:14s} {way:14s} generate compiled nothing: its rows ran uncompiled "
                  f"(transformers' compile criteria not met)", flush=True)
        for reason in count.break_reasons:
            print(f"    graph break: {reason}", flush=True)
    models.clear()
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results, counted


def row_of(name: str, way: str, batch: int, seq: int, runs: list[dict], reference: dict | None,
           seconds: float, args) -> dict:
    """One way's row from its calls (warm-up ones first) and the reference's last call."""
    timed = runs[args.warmup:]
    tokens_BN, scores_BV = timed[-1]["tokens"], timed[-1]["first_scores"]
    want_BN, want_BV = (None, None) if reference is None else (reference["tokens"],
                                                               reference["first_scores"])
    prefill_ms = statistics.median(r["prefill_ms"] for r in timed)
    decode_ms = statistics.median(r["decode_ms"] for r in timed)
    first_call_s = (runs[0]["prefill_ms"] + runs[0]["decode_ms"]) / 1e3
    row = {"shape": name, "way": way, "batch": batch, "prompt": seq,
           "new_tokens": args.new_tokens, "prefill_ms": prefill_ms,
           "decode_tok_s": batch * (args.new_tokens - 1) / (decode_ms / 1e3),
           "first_call_s": first_call_s, "decode_experts": timed[-1]["decode_experts"],
           "same_tokens_every_call": all(torch.equal(r["tokens"], tokens_BN) for r in runs),
           "tokens_equal_reference": None if want_BN is None
           else bool(torch.equal(tokens_BN, want_BN)),
           "first_mismatch": None if want_BN is None else first_mismatch(tokens_BN, want_BN),
           **({} if want_BV is None else first_token_agreement(scores_BV, want_BV)),
           "row_s": seconds}
    print(f"{name:14s} {way:14s} B={batch:<3d} S={seq:<5d} prefill {prefill_ms:9.2f} ms  "
          f"decode {row['decode_tok_s']:9.1f} tok/s  first call {first_call_s:6.1f} s  "
          f"same as {REFERENCE_WAY}: {row['tokens_equal_reference']}"
          + ("" if row["first_mismatch"] is None
             else f" (first mismatch at new token {row['first_mismatch']})"), flush=True)
    return row


def table(rows: list[dict], compiled: list[dict]) -> str:
    """Markdown: per model, B and S, both ways side by side."""
    lines = [("| model | B | S | prefill ms: HF / patched | speedup | decode tok/s: HF / "
              "patched | speedup | tokens equal HF's | HF decode experts |"),
             "|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["shape"], r["batch"], r["prompt"]) for r in rows},
                  key=lambda k: (MODELS.index(k[0]) if k[0] in MODELS else 0, k[1], k[2]))
    for shape, batch, seq in keys:
        by_way = {r["way"]: r for r in rows
                  if (r["shape"], r["batch"], r["prompt"]) == (shape, batch, seq)}
        hf, ours = by_way.get(REFERENCE_WAY), by_way.get("tmo-patch")
        if hf is None or ours is None:
            continue
        equal = ("yes" if ours["tokens_equal_reference"]
                 else f"no, from token {ours['first_mismatch']}")
        equal += (f"; first token: logits {ours['logits_rel_diff']:.1e} apart, "
                  f"{ours['first_token_differs']} of {batch} differ, "
                  f"{ours['first_token_differs_beyond_rounding']} beyond rounding")
        lines.append(
            f"| {shape} | {batch} | {seq} | {hf['prefill_ms']:.2f} / {ours['prefill_ms']:.2f} | "
            f"{hf['prefill_ms'] / ours['prefill_ms']:.2f}x | {hf['decode_tok_s']:.1f} / "
            f"{ours['decode_tok_s']:.1f} | {ours['decode_tok_s'] / hf['decode_tok_s']:.2f}x | "
            f"{equal} | {hf['decode_experts']} |")
    lines += ["", "| model | way | graphs | graph breaks | CUDA-graph skips |",
              "|---|---|---|---|---|"]
    lines += [f"| {c['shape']} | {c['way']} | {c['graphs']} | {c['graph_breaks']} | "
              f"{c['cudagraph_skips']} |" for c in compiled]
    return "\n".join(lines)


def meta(args) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    device = (torch.cuda.get_device_name() if args.device == "cuda"
              else f"CPU ({platform.processor() or platform.machine()})")
    return {"device": device, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"),
            "torch": torch.__version__, "triton": triton_version,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "dtype": str(args.dtype).removeprefix("torch."), "layers": args.layers,
            "new_tokens": args.new_tokens, "mode": args.mode, "inner": args.inner,
            "compiled_prefill": args.compiled_prefill, "warmup": args.warmup,
            "repeats": args.repeats, "smoke": args.smoke, "quant": args.quant}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(MODELS),
                        help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of every model")
    parser.add_argument("--prompts", default="2048,512", help="prompt lengths S")
    parser.add_argument("--batches", default="1,16", help="batch sizes B")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--compiled-prefill", action="store_true",
                        help="run the prefill on the compiled forward too")
    parser.add_argument("--warmup", type=int, default=None,
                        help="calls before the timed ones (default 1; 2 with --compiled-prefill)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="start no model past this many seconds")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, fp32, tiny models of the same families, aot_eager graphs, "
                             "short prompts: checks the script in seconds")
    parser.add_argument("--quant", choices=("mxfp4",),
                        help="the experts stored in this format (GPT-OSS's checkpoints: "
                             "mxfp4): tmo-patch runs them so, transformers the same values in "
                             "bf16, as it runs that checkpoint without its hub kernels")
    parser.add_argument("--out", default="results")
    args = parser.parse_args(argv)
    args.quant_spec = None if args.quant is None else QuantSpec(args.quant)
    shapes = SMOKE_SHAPES if args.smoke else bench_model.SHAPES
    names = args.shapes.split(",")
    unknown = [name for name in names if name not in MODELS]
    if unknown:
        parser.error(f"--shapes must be comma-separated names from {', '.join(MODELS)}, "
                     f"got {args.shapes!r}")
    args.models = {name: shapes[name] for name in names}
    ways = args.ways.split(",")
    if any(way not in WAYS for way in ways) or REFERENCE_WAY not in ways:
        parser.error(f"--ways must be comma-separated names from {', '.join(WAYS)}, "
                     f"{REFERENCE_WAY} among them (the tokens are checked against it), "
                     f"got {args.ways!r}")
    # The reference runs first: the other ways' tokens are compared with its.
    args.way_list = sorted(ways, key=WAYS.index)
    if args.warmup is None:
        args.warmup = 2 if args.compiled_prefill else 1
    if args.smoke:
        args.device, args.dtype, args.inner, args.mode = "cpu", torch.float32, "aot_eager", None
        if args.prompts == parser.get_default("prompts"):
            args.prompts = "12"
        if args.batches == parser.get_default("batches"):
            args.batches = "2"
        if args.new_tokens == parser.get_default("new_tokens"):
            args.new_tokens = 6
        args.warmup, args.repeats = min(args.warmup, 1), min(args.repeats, 2)
    else:
        args.device, args.dtype, args.inner, args.mode = ("cuda", torch.bfloat16, "inductor",
                                                          "reduce-overhead")
    # Longest prompt first: the static cache keeps the size of the first call.
    prompt_lengths = sorted((int(s) for s in args.prompts.split(",")), reverse=True)
    args.rows = [(b, s) for b in (int(b) for b in args.batches.split(",")) for s in prompt_lengths]
    if args.new_tokens < 2:
        parser.error(f"--new-tokens must be at least 2 (decode is timed after the first "
                     f"token), got {args.new_tokens}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    # A decode graph per row and way at most, and one more per way for GPT-OSS's cache:
    # the ways' models share their forward's code.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                               (len(args.rows) + 1) * len(args.way_list))
    start = time.monotonic()
    rows, compiled, skipped, failed = [], [], [], []
    for name, shape in args.models.items():
        if time.monotonic() - start > args.budget_s:
            skipped.append(f"{name}: past --budget-s {args.budget_s:.0f}")
            continue
        try:
            model_rows, model_compiled = bench_model_ways(name, shape, args.way_list,
                                                          args.rows, args, failed)
        except Exception as error:  # noqa: BLE001 (building or compiling a model failed)
            traceback.print_exc()
            failed.append({"shape": name, "way": ",".join(args.way_list),
                           "error": f"{type(error).__name__}: {error}"[:2000]})
            torch._dynamo.reset()
            continue
        rows += model_rows
        compiled += model_compiled
        with open(os.path.join(args.out, "generate.json"), "w") as f:
            json.dump({"meta": meta(args), "rows": rows, "compiled": compiled,
                       "skipped": skipped, "failed": failed}, f, indent=1)
    info = meta(args)
    info["total_s"] = round(time.monotonic() - start, 1)
    with open(os.path.join(args.out, "generate.json"), "w") as f:
        json.dump({"meta": info, "rows": rows, "compiled": compiled, "skipped": skipped,
                   "failed": failed}, f, indent=1)
    layers = f"{args.layers} layers" if not args.smoke else "smoke models"
    text = (f"{info['device']}, {info['date']}, torch {info['torch']}, triton {info['triton']}, "
            f"transformers {info['transformers']}, {info['dtype']}, {layers}, "
            f"{args.new_tokens} new tokens, mode={args.mode}, prefill "
            f"{'compiled' if args.compiled_prefill else 'uncompiled'}, {info['total_s']} s\n\n"
            + table(rows, compiled))
    if skipped:
        text += "\n\nskipped: " + "; ".join(skipped)
    for failure in failed:
        text += f"\n\nfailed: {failure['shape']} {failure['way']}: {failure['error']}"
    with open(os.path.join(args.out, "generate.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
