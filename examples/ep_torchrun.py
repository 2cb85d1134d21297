"""Expert parallelism over torchrun processes: check against one process, then time it.

    torchrun --standalone --nproc-per-node 2 examples/ep_torchrun.py --a2a all_to_all
    torchrun --standalone --nproc-per-node 4 examples/ep_torchrun.py --a2a allgather

(``python -m torch.distributed.run`` is ``torchrun``.) Every rank builds the
same full model from one seed (the single-process reference) and an
expert-parallel copy that keeps its slice of the experts (``load_state_dict``
of the full weights). Each rank feeds its own tokens (fewer on higher ranks;
none on the last with ``--idle-last-rank``), checks the output and the input
gradient against the reference, eagerly (the ``all_to_all`` a2a) and compiled
with ``--a2a``, and rank 0 prints the largest differences and ms per forward
step. NCCL, one GPU per rank (``LOCAL_RANK``), where CUDA is available; gloo on
the CPU otherwise.

Legend: T tokens of this rank, H hidden size.
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist
from timing import call_ms, summary
from torch import nn

import torch_moe_ops as tmo


class EPModel(nn.Module):
    """``layers`` x (RMSNorm + MoE with residual) on hidden states ``[T, H]``."""

    def __init__(self, cfg: tmo.MoEConfig, layers: int, device, dtype, ep_group=None):
        super().__init__()
        self.norms = nn.ModuleList(nn.RMSNorm(cfg.hidden_size, device=device, dtype=dtype)
                                   for _ in range(layers))
        self.moes = nn.ModuleList(tmo.MoE(cfg, device=device, dtype=dtype, ep_group=ep_group)
                                  for _ in range(layers))

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        for norm, moe in zip(self.norms, self.moes):
            x_TH = x_TH + moe(norm(x_TH))
        return x_TH


def tokens_of(rank: int, world_size: int, args) -> int:
    """This rank's token count: ``--tokens`` on rank 0, fewer on each next rank."""
    if args.idle_last_rank and rank == world_size - 1:
        return 0
    return max(1, args.tokens * (world_size - rank) // world_size)


def output_and_grad(model, x_TH: torch.Tensor, grad_TH: torch.Tensor):
    """The output and the gradient of ``sum(out * grad)`` with respect to ``x_TH``."""
    x_TH = x_TH.detach().clone().requires_grad_()
    out_TH = model(x_TH)
    out_TH.backward(grad_TH)
    return out_TH.detach(), x_TH.grad


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want| / max(1, max |want|)``: 0 for empty tensors."""
    if want.numel() == 0:
        return 0.0
    scale = max(1.0, want.abs().max().item())
    return (got.float() - want.float()).abs().max().item() / scale


def ms_per_step(model, x_TH: torch.Tensor, device: torch.device, repeats: int) -> list[float]:
    """Forward steps run together on all ranks, each timed: the slowest rank's ms per step."""
    dist.barrier()
    with torch.no_grad():
        times_ms = call_ms(lambda: model(x_TH), repeats, device)
    slowest_ms = torch.tensor(times_ms, dtype=torch.float64, device=device)
    dist.all_reduce(slowest_ms, op=dist.ReduceOp.MAX)
    return slowest_ms.tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a2a", choices=("all_to_all", "allgather"), default="all_to_all",
                        help="how tokens travel in the compiled model (eagerly: all_to_all)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: one GPU per rank (NCCL) where CUDA is available, else CPU")
    parser.add_argument("--tokens", type=int, default=64,
                        help="tokens on rank 0 (max_tokens_per_rank); fewer on other ranks")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--idle-last-rank", action="store_true",
                        help="the last rank passes 0 tokens (it still joins every forward)")
    parser.add_argument("--timeout-s", type=float, default=120.0,
                        help="how long a collective (and start-up) waits for the other ranks")
    args = parser.parse_args()

    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=args.timeout_s),
                                device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    try:
        run(args, device)
        # Meet before tearing down: a rank that leaves while a peer still finishes
        # the last collective closes the connection under it.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(args, device: torch.device) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size < 2:
        raise SystemExit("expert parallelism needs at least 2 processes: "
                         "torchrun --nproc-per-node 2 examples/ep_torchrun.py")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    inner = "inductor" if device.type == "cuda" else "aot_eager"
    single_cfg = tmo.MoEConfig(hidden_size=256, intermediate_size=128,
                               num_experts=args.experts, top_k=4, renormalize=True)
    ep_cfg = tmo.MoEConfig(hidden_size=256, intermediate_size=128, num_experts=args.experts,
                           top_k=4, renormalize=True, ep_size=world_size,
                           max_tokens_per_rank=args.tokens)

    torch.manual_seed(0)  # the same full weights on every rank
    reference = EPModel(single_cfg, args.layers, device, dtype)
    model = EPModel(ep_cfg, args.layers, device, dtype, ep_group=dist.group.WORLD)
    model.load_state_dict(reference.state_dict())  # each MoE keeps its slice of the experts
    local = model.moes[0].local_experts

    generator = torch.Generator().manual_seed(1000 + rank)  # each rank's own tokens
    num_tokens = tokens_of(rank, world_size, args)
    x_TH = torch.randn(num_tokens, ep_cfg.hidden_size, generator=generator).to(device, dtype)
    grad_TH = torch.randn(x_TH.shape, generator=generator).to(device, dtype)
    want_out, want_grad = output_and_grad(reference, x_TH, grad_TH)

    compiled = torch.compile(model, backend=tmo.backend(a2a=args.a2a, inner=inner),
                             fullgraph=True)
    errors = []  # eager out, eager grad, compiled out, compiled grad
    for run_model in (model, compiled):
        got_out, got_grad = output_and_grad(run_model, x_TH, grad_TH)
        errors += [relative_error(got_out, want_out), relative_error(got_grad, want_grad)]
    # Every rank learns the largest errors, so that all fail together.
    errors_4 = torch.tensor(errors, dtype=torch.float64, device=device)
    dist.all_reduce(errors_4, op=dist.ReduceOp.MAX)
    bound = 5e-2 if dtype == torch.bfloat16 else 1e-4

    eager_ms = ms_per_step(model, x_TH, device, args.repeats)
    compiled_ms = ms_per_step(compiled, x_TH, device, args.repeats)
    counts = torch.tensor([num_tokens], device=device)
    all_counts = [torch.zeros_like(counts) for _ in range(world_size)]
    dist.all_gather(all_counts, counts)
    if rank == 0:
        print(f"{world_size} ranks ({dist.get_backend()}, {device.type}, "
              f"{str(dtype).removeprefix('torch.')}), {args.layers} MoE layers, "
              f"{args.experts} experts ({len(local)} per rank), top-{ep_cfg.top_k}, tokens per "
              f"rank {[int(c) for c in all_counts]}, compiled a2a {args.a2a} on {inner}")
        eager_out, eager_grad, compiled_out, compiled_grad = errors_4.tolist()
        print(f"largest relative difference from one process: eager output {eager_out:.2e}, "
              f"input grad {eager_grad:.2e}; compiled output {compiled_out:.2e}, input grad "
              f"{compiled_grad:.2e} (bound {bound:.0e})")
        print(f"eager:    {summary(eager_ms, 'ms per forward step')}")
        print(f"compiled: {summary(compiled_ms, 'ms per forward step')}")
    if errors_4.max().item() > bound:
        raise SystemExit(f"rank {rank}: expert-parallel results differ from the "
                         f"single-process reference by more than {bound:.0e}")
    if rank == 0:
        print("matches the single-process reference on every rank")


if __name__ == "__main__":
    main()
