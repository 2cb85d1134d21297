"""One expert-parallel MoE layer trained on 2 GPUs: forward + backward of ours against
torchtitan's MoE layer with its expert-parallel token dispatcher, in the same run.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/bench_ep_train.py --out DIR
    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/bench_ep_train.py --out DIR --smoke   # CPU, gloo, tiny: checks the script

Legend: P ranks, T tokens per rank, H hidden size, I expert intermediate size, E experts
(E / P on each rank), K experts per token.

A row is one (shape, T, way): a layer at the shape's widths, E=64, K=8, softmax routing
renormalised over the top K (Qwen3's, for both shapes; no shared experts), bf16, its
router drawn from seed 0 (each side its own router: near-uniform routing of random
tokens); each rank feeds its own random ``x`` and backpropagates a fixed random ``g``
(parameter and input gradients dropped between steps). The ways:

- ``tmo allgather`` / ``tmo all_to_all`` / ``tmo flashinfer``: ``tmo.MoE`` with
  ``ep_size=P``, ``max_tokens_per_rank=T`` (worst-case capacity), compiled with
  ``torch.compile(moe, backend=tmo.backend(a2a=A), fullgraph=True)`` (the tokens format,
  with its gradients; flashinfer's trainable tokens ops, which copy the receive buffers out
  of its workspace), each where its backend runs (the rest listed as skipped, with the
  reason);
- ``torchtitan eager`` / ``torchtitan compiled``: torchtitan's ``MoE`` with
  ``AllToAllTokenDispatcher``, expert parallelism applied as torchtitan applies it, run
  eagerly / compiled as torchtitan compiles it (benchmarks/peer_torchtitan.py says how).
  Ours is judged against the faster of the two that ran.

Per row: ms per step (median of back-to-back steps timed with CUDA events after a
warm-up, the slower rank's), useful TFLOP/s per rank = 3 * 2*T*K*3*H*I / time, the peak
memory the step adds above what was allocated before it and the absolute peak (the
larger rank's), the first (compiling) step's seconds, and the relative error of the
compiled forward against the same layer run eagerly (where eager runs: torchtitan's
eager dispatch needs an uneven ``all_to_all``, which gloo lacks). A way that fails keeps
its error in its row.

Where the flashinfer backend runs, each case also times its trainable transport alone
against FlashInfer's own round trip, ``MoeAlltoAll`` dispatch + combine
(benchmarks/flashinfer_train_transport.py: the forward pair and the backward pair, each
captured; target: each within 1.3x of it), in a table of its own.

Every collective is bounded by ``--timeout-s``; a row starts only while the run is
within ``--budget-s`` (the rest are listed as skipped). torchtitan's compiled rows run
last: on torch 2.11 (H200) its compiled layer passed its first step and then, in 3 cases
of 4, read wrong token splits on a later one (a rank fails its runtime assert
``Eq(u0 + u1, T*K)``, or sends a wrong size: 229376 rows where 32768 were routed); the
ranks' collectives can then part, and the run ends at the timeout with every other row
kept. Rank 0 writes
``ep_train.json``, ``ep_train.md`` and ``summary.txt`` (the short table it prints
last, then the transport table) to ``--out`` after every row.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import time
import warnings

import bench_ep
import flashinfer_train_transport
import peer_torchtitan
import torch
import torch.distributed as dist
from bench_train import training_step

import torch_moe_ops as tmo
from torch_moe_ops.backends.registry import Problem

TMO_A2A = ("allgather", "all_to_all", "flashinfer")
PEER = "torchtitan"
PEER_EAGER, PEER_COMPILED = f"{PEER} eager", f"{PEER} compiled"
TRANSPORT_TITLE = ("flashinfer's trainable transport (forward pair, backward pair) against "
                   "MoeAlltoAll's round trip, each captured, the slower rank's median")
# The order of the rows within a case in the tables.
WAYS = tuple(f"tmo {a2a}" for a2a in TMO_A2A) + (PEER_EAGER, PEER_COMPILED)


@dataclasses.dataclass(frozen=True)
class Sizes:
    shapes: dict[str, tuple[int, int]]  # name: (H, I)
    experts: int
    top_k: int
    tokens: tuple[int, ...]
    replays: int


FULL = Sizes(shapes={"qwen3-30b-a3b": (2048, 768), "deepseek-v3": (7168, 2048)}, experts=64,
             top_k=8, tokens=(4096, 8192), replays=20)
SMOKE = Sizes(shapes={"smoke": (64, 32)}, experts=8, top_k=2, tokens=(16,), replays=3)


@dataclasses.dataclass(frozen=True)
class Case:
    shape: str
    hidden: int
    inter: int
    tokens: int

    def row(self, way: str) -> dict:
        return {"shape": self.shape, "tokens": self.tokens, "way": way, "H": self.hidden,
                "I": self.inter}


def useful_flops(sizes: Sizes, case: Case) -> float:
    """One rank's forward (2*T*K*(2I*H + I*H)) and backward (twice that) FLOPs."""
    return 3 * 2 * case.tokens * sizes.top_k * 3 * case.hidden * case.inter


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm()
            / expected.float().norm().clamp(min=1e-12)).item()


def inputs(run: bench_ep.Run, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, H]`` and ``g [T, H]``, different on each rank, the same for every way."""
    gen = torch.Generator(run.device).manual_seed(1000 + run.rank)
    x_TH = torch.randn(case.tokens, case.hidden, generator=gen, device=run.device)
    g_TH = torch.randn(case.tokens, case.hidden, generator=gen, device=run.device)
    return x_TH.to(run.dtype), g_TH.to(run.dtype)


def measure(run: bench_ep.Run, sizes: Sizes, case: Case, step, expected: torch.Tensor | None,
            row: dict) -> None:
    """Times ``step`` (a forward + backward returning the forward's output) into ``row``:
    the first call's seconds and its error against ``expected``, then the median step and
    the peak memory."""
    begin = time.monotonic()
    out = step()
    if not run.smoke:
        torch.cuda.synchronize()
    row["first_step_s"] = time.monotonic() - begin
    if expected is not None:
        row["rel_err_vs_eager"] = run.slowest([relative_error(out.reshape(expected.shape),
                                                              expected)])[0]
    del out
    before = 0
    if not run.smoke:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    (seconds,) = run.time([step])
    row.update(ms=seconds * 1e3, tflops=useful_flops(sizes, case) / seconds / 1e12)
    if not run.smoke:
        peak = torch.cuda.max_memory_allocated()
        row["step_peak_mib"], row["peak_mib"] = run.slowest([(peak - before) / 2**20,
                                                              peak / 2**20])


def problem(run: bench_ep.Run, sizes: Sizes, case: Case) -> Problem:
    return Problem(run.dtype, num_experts=sizes.experts, hidden_size=case.hidden,
                   intermediate_size=case.inter, top_k=sizes.top_k, ep_size=run.world,
                   max_tokens_per_rank=case.tokens, training=True)


def a2a_reason(run: bench_ep.Run, sizes: Sizes, case: Case, a2a: str) -> str | None:
    """Why a2a backend ``a2a`` cannot run the case's layer here (listed once as skipped)."""
    reason = tmo.backends.REGISTRY.a2a[a2a].supports(tmo.BackendSpec(a2a=a2a),
                                                    problem(run, sizes, case), run.device)
    note = f"tmo {a2a}: {reason}"
    if reason is not None and note not in run.skipped:
        run.skipped.append(note)
    return reason


def tmo_rows(run: bench_ep.Run, sizes: Sizes, case: Case) -> list[dict]:
    cfg = tmo.MoEConfig(hidden_size=case.hidden, intermediate_size=case.inter,
                        num_experts=sizes.experts, top_k=sizes.top_k, scoring="softmax",
                        renormalize=True, ep_size=run.world, max_tokens_per_rank=case.tokens)
    torch.manual_seed(0)
    moe = tmo.MoE(cfg, device=run.device, dtype=run.dtype, ep_group=run.group)
    x_TH, g_TH = inputs(run, case)
    with torch.no_grad():
        expected_TH = moe(x_TH)
    rows = []
    for a2a in TMO_A2A:
        row = case.row(f"tmo {a2a}")
        if a2a_reason(run, sizes, case, a2a) is not None or not run.within_budget(
                f"{case.shape} T={case.tokens} {row['way']}"):
            continue
        torch._dynamo.reset()
        # Inductor on the CPU compiles for minutes: the smoke run checks the graph only.
        backend = tmo.backend(a2a=a2a, inner="aot_eager" if run.smoke else "inductor")
        compiled = torch.compile(moe, backend=backend, fullgraph=True, dynamic=False)
        row["how"] = f"torch.compile(backend=tmo.backend(a2a={a2a!r}), fullgraph=True)"
        step = training_step(compiled, x_TH, g_TH)
        attempt(run, row, lambda step=step, row=row: measure(run, sizes, case, step,
                                                             expected_TH, row))
        rows.append(row)
        del compiled, step
        # The layer's transport state (FlashInfer's workspace), freed on every rank.
        bench_ep.release_communicators(a2a)
        run.release()
    del moe
    torch._dynamo.reset()
    return rows


def peer_row(run: bench_ep.Run, sizes: Sizes, case: Case, compiled: bool) -> dict | None:
    """torchtitan's layer run eagerly, or compiled as torchtitan compiles it (checked
    against its eager forward)."""
    row = case.row(PEER_COMPILED if compiled else PEER_EAGER)
    if not run.within_budget(f"{case.shape} T={case.tokens} {row['way']}"):
        return None
    layer = peer_torchtitan.build(hidden=case.hidden, inter=case.inter,
                                  experts=sizes.experts, top_k=sizes.top_k, world=run.world,
                                  device=run.device, dtype=run.dtype, seed=0)
    row["torch_shims"] = peer_torchtitan.torch_shims()
    x_TH, g_TH = inputs(run, case)
    x_BLH, g_BLH = x_TH[None].clone(), g_TH[None].clone()

    def in_context(fn):
        def run_in_context():
            with layer.context():
                return fn()
        return run_in_context

    step = in_context(training_step(layer.module, x_BLH, g_BLH))
    if not compiled:
        row["how"] = "eager"
        if run.smoke:
            row["error"] = "not run: its eager all-to-all has uneven splits, which gloo lacks"
        else:
            attempt(run, row, lambda: measure(run, sizes, case, step, None, row))
        return row
    expected = None
    if not run.smoke:
        with torch.no_grad():
            expected = in_context(lambda: layer.module(x_BLH))()
    settings, lacking = peer_torchtitan.compile_settings()
    if lacking:
        row["compile_note"] = f"this torch lacks dynamo settings {lacking}"
    backend = "aot_eager" if run.smoke else "inductor"
    row["how"] = f"module.compile(backend={backend!r}, fullgraph=True)"
    torch._dynamo.reset()
    with settings:
        layer.module.compile(backend=backend, fullgraph=True)
        attempt(run, row, lambda: measure(run, sizes, case, step, expected, row))
    torch._dynamo.reset()
    run.release()
    return row


def transport_row(run: bench_ep.Run, sizes: Sizes, case: Case) -> dict | None:
    """The flashinfer trainable transport against MoeAlltoAll's round trip at the case's
    sizes (`flashinfer_train_transport`), where the backend runs."""
    name = flashinfer_train_transport.NAME
    if a2a_reason(run, sizes, case, name) is not None or not run.within_budget(
            f"{case.shape} T={case.tokens} {name} transport"):
        return None
    row = {"shape": case.shape, "tokens": case.tokens, "way": f"{name} transport"}
    attempt(run, row, lambda: row.update(
        flashinfer_train_transport.measure(run, case.hidden, case.inter, sizes.top_k,
                                           sizes.experts, case.tokens)))
    run.release()
    return row


def attempt(run: bench_ep.Run, row: dict, fn) -> bool:
    """``fn()`` on every rank, failing on all where it fails on one (`bench_ep.EveryRank`); a
    failure is kept in ``row`` (first line, the log the whole of it). True where it failed."""
    try:
        run.every_rank.run(f"{row['shape']} T={row['tokens']} {row['way']}", fn)
    except torch.OutOfMemoryError as error:
        row["error"] = f"OOM: {str(error).splitlines()[0][:160]}"
    except Exception as error:  # noqa: BLE001 (a way that fails is a result, not the end)
        import traceback

        traceback.print_exc()
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    else:
        return False
    run.log(f"{row['shape']} T={row['tokens']} {row['way']}: {row['error']}")
    return True


def cases(sizes: Sizes) -> list[Case]:
    return [Case(shape, hidden, inter, tokens) for tokens in sizes.tokens
            for shape, (hidden, inter) in sizes.shapes.items()]


def _fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def speedups(rows: list[dict]) -> None:
    """Each of our rows' speed against torchtitan's faster way (of those that ran) at the
    same shape and T."""
    peer: dict[tuple, float] = {}
    for r in rows:
        if r["way"].startswith(PEER) and "ms" in r:
            key = (r["shape"], r["tokens"])
            peer[key] = min(peer.get(key, r["ms"]), r["ms"])
    for r in rows:
        base = peer.get((r["shape"], r["tokens"]))
        if not r["way"].startswith(PEER) and base and "ms" in r:
            r["vs_torchtitan"] = base / r["ms"]


def table(rows: list[dict]) -> str:
    lines = [("| shape | T/rank | way | how | ms/step | TFLOP/s per rank | speed vs "
              "torchtitan's faster way | step peak MiB | peak MiB | first step s | "
              "rel err vs eager | error |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        error = r.get("error", "")
        lines.append(
            f"| {r['shape']} | {r['tokens']} | {r['way']} | {r.get('how', '-')} | "
            f"{_fmt(r.get('ms'))} | {_fmt(r.get('tflops'), '.1f')} | "
            f"{_fmt(r.get('vs_torchtitan'))} | {_fmt(r.get('step_peak_mib'), '.0f')} | "
            f"{_fmt(r.get('peak_mib'), '.0f')} | {_fmt(r.get('first_step_s'), '.1f')} | "
            f"{_fmt(r.get('rel_err_vs_eager'), '.1e')} | {error} |")
    return "\n".join(lines)


def short_table(rows: list[dict]) -> str:
    lines = [f"{'case':40} {'ms/step':>9} {'TFLOP/s':>8} {'peak MiB':>9} {'vs titan':>9}"]
    for r in rows:
        case = f"{r['shape']} T={r['tokens']} {r['way']}"
        if "ms" not in r:
            lines.append(f"{case:40} {r.get('error', 'failed')}")
            continue
        lines.append(f"{case:40} {r['ms']:9.2f} {r['tflops']:8.1f} "
                     f"{_fmt(r.get('peak_mib'), '.0f'):>9} "
                     f"{_fmt(r.get('vs_torchtitan')):>9}")
    lines.append("vs titan: torchtitan's ms (its faster way that ran) / ours at the same "
                 "shape and T (> 1: ours faster); the slower rank's median step, the larger "
                 "rank's peak")
    return "\n".join(lines)


def meta(run: bench_ep.Run, sizes: Sizes) -> dict:
    info = {"date": str(datetime.date.today()), "torch": torch.__version__,
            "torchtitan": peer_torchtitan.version(), "python": platform.python_version(),
            "ranks": run.world, "dtype": str(run.dtype).removeprefix("torch."),
            "sizes": dataclasses.asdict(sizes), "smoke": run.smoke}
    if run.smoke:
        info["device"] = f"CPU ({platform.processor() or platform.machine()}), gloo"
    else:
        info["device"] = torch.cuda.get_device_name(run.device)
        version = torch.cuda.nccl.version()
        info["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return info


def save(run: bench_ep.Run, sizes: Sizes, rows: list[dict], transport: list[dict]) -> str:
    """Writes ``ep_train.json``, ``ep_train.md`` and ``summary.txt`` (rank 0), with the
    ``transport`` rows (`transport_row`) where there are any; returns the summary."""
    if run.rank != 0:
        return ""
    shapes = list(sizes.shapes)
    rows = sorted(rows, key=lambda r: (r["tokens"], shapes.index(r["shape"]),
                                       WAYS.index(r["way"])))
    speedups(rows)
    info = meta(run, sizes)
    os.makedirs(run.args.out, exist_ok=True)
    with open(os.path.join(run.args.out, "ep_train.json"), "w") as f:
        json.dump({"meta": info, "rows": rows, "flashinfer_transport": transport,
                   "skipped": run.skipped}, f, indent=1)
    header = (f"{info['device']}, {info['date']}, torch {info['torch']}, torchtitan "
              f"{info['torchtitan'] or '-'}, NCCL {info.get('nccl', '-')}, {run.world} ranks, "
              f"{info['dtype']}, E={sizes.experts} ({sizes.experts // run.world} per rank), "
              f"K={sizes.top_k}, softmax routing from each side's router (seed 0)")
    timing = ("median of eager-timed steps (smoke: tiny sizes on the CPU, not a measurement)"
              if run.smoke else "median of back-to-back steps timed with CUDA events")
    shims = sorted({name for r in rows for name in r.get("torch_shims", [])})
    text = "\n\n".join([
        f"# Expert-parallel layer training step: ours against torchtitan\n\n{header}",
        (f"Forward + backward of one layer; {timing}, the slower rank's; peak memory the "
         "larger rank's. TFLOP/s per rank = 3 * 2*T*K*3*H*I / time."),
        table(rows),
        *([TRANSPORT_TITLE, flashinfer_train_transport.table(transport)] if transport else []),
        *([f"Added to torch for torchtitan: {'; '.join(shims)}"] if shims else []),
        *([("Skipped: " + "; ".join(run.skipped))] if run.skipped else []),
    ])
    with open(os.path.join(run.args.out, "ep_train.md"), "w") as f:
        f.write(text + "\n")
    summary = f"{header}\n{short_table(rows)}"
    if transport:
        summary += f"\n{TRANSPORT_TITLE}\n{flashinfer_train_transport.table(transport)}"
    with open(os.path.join(run.args.out, "summary.txt"), "w") as f:
        f.write(summary + "\n")
    return summary


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for ep_train.json and ep_train.md")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes on the CPU over gloo: checks the script")
    parser.add_argument("--replays", type=int, default=0, help="timed steps (0: default)")
    parser.add_argument("--timeout-s", type=float, default=120,
                        help="process-group timeout: the longest any collective waits")
    parser.add_argument("--budget-s", type=float, default=360,
                        help="no row starts after this many seconds")
    args = parser.parse_args(argv)
    if args.replays < 0:
        parser.error(f"--replays must be >= 0, got {args.replays}")
    return args


def check_launch(args: argparse.Namespace) -> None:
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        sys.exit("bench_ep_train.py runs one process per rank: launch it with "
                 "`python -m torch.distributed.run --standalone --nproc-per-node 2 "
                 "benchmarks/bench_ep_train.py --out DIR` (add --smoke for the CPU)")
    world = int(os.environ["WORLD_SIZE"])
    if world < 2:
        sys.exit(f"expert parallelism needs >= 2 ranks, got WORLD_SIZE={world}")
    if not args.smoke:
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if found < world:
            sys.exit(f"bench_ep_train.py needs {world} CUDA GPUs (one per rank), found "
                     f"{found}; --smoke runs tiny sizes on the CPU over gloo")


def main(argv=None) -> None:
    # torch 2.13 renames all_gather_into_tensor / reduce_scatter_tensor (*_single).
    warnings.filterwarnings("ignore", message=".*is deprecated. Please use `torch.distributed",
                            category=FutureWarning)
    # torchtitan's router asks autocast for fp32, which CPU autocast refuses with a warning.
    warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype")
    args = parse_args(argv)
    check_launch(args)
    sizes = SMOKE if args.smoke else FULL
    # bench_ep.Run times args.replays steps.
    args.replays = args.replays or sizes.replays
    run = bench_ep.Run(args)
    try:
        reason = peer_torchtitan.missing_reason()
        if reason is not None:
            run.skipped.append(f"{PEER}: {reason}")
        run.log(f"torchtitan {peer_torchtitan.version() or '-'}: "
                f"{'runs' if reason is None else reason}")
        rows: list[dict] = []
        transport: list[dict] = []

        def kept(row: dict | None) -> None:
            if row is not None:
                if run.every_rank.aborted is not None and "error" not in row:
                    row["error"] = f"not run: the group was aborted ({run.every_rank.aborted})"
                rows.append(row)
                run.log(line(row))
                save(run, sizes, rows, transport)

        for case in cases(sizes):
            if run.every_rank.aborted is not None:
                break
            for row in tmo_rows(run, sizes, case):
                kept(row)
            measured = transport_row(run, sizes, case)
            if measured is not None:
                transport.append(measured)
                run.log(f"{case.shape} T={case.tokens} flashinfer transport: {measured}")
                save(run, sizes, rows, transport)
            if reason is None:
                kept(peer_row(run, sizes, case, compiled=False))
        # torchtitan compiled last: where its compiled dispatch reads wrong splits on one
        # rank (torch 2.11: `Eq(u0 + u1, 32768)`), the row fails on every rank and the group
        # is aborted (`bench_ep.EveryRank`): the later rows are listed as not run.
        for case in cases(sizes) if reason is None else []:
            if run.every_rank.aborted is not None:
                run.skipped.append(f"{case.shape} T={case.tokens} {PEER} compiled: the group "
                                   f"was aborted ({run.every_rank.aborted})")
                continue
            kept(peer_row(run, sizes, case, compiled=True))
        summary = save(run, sizes, rows, transport)
        if run.rank == 0:
            print("\n" + summary, flush=True)
    finally:
        if run.every_rank.aborted is None:
            dist.destroy_process_group()


def line(row: dict) -> str:
    case = f"{row['shape']} T={row['tokens']} {row['way']}"
    if "ms" not in row:
        return f"{case}: {row.get('error', 'failed')}"
    return (f"{case} ({row['how']}): {row['ms']:.2f} ms, {row['tflops']:.1f} TFLOP/s, "
            f"peak +{_fmt(row.get('step_peak_mib'), '.0f')} MiB, first step "
            f"{row['first_step_s']:.1f} s, rel err vs eager "
            f"{_fmt(row.get('rel_err_vs_eager'), '.1e')}")


if __name__ == "__main__":
    main()
