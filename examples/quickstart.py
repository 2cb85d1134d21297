"""Build a small MoE model, run it eagerly and compiled, compare and time both.

    python examples/quickstart.py [--device cuda] [--tokens 256]
"""

from __future__ import annotations

import argparse

import torch
from timing import call_ms, summary
from torch import nn

import torch_moe_ops as tmo


class TinyMoEModel(nn.Module):
    """Embedding, ``layers`` x (RMSNorm + MoE with residual), LM head."""

    def __init__(self, cfg: tmo.MoEConfig, vocab: int, layers: int, device, dtype):
        super().__init__()
        self.embed = nn.Embedding(vocab, cfg.hidden_size, device=device, dtype=dtype)
        self.norms = nn.ModuleList(nn.RMSNorm(cfg.hidden_size, device=device, dtype=dtype)
                                   for _ in range(layers))
        self.moes = nn.ModuleList(tmo.MoE(cfg, device=device, dtype=dtype)
                                  for _ in range(layers))
        self.head = nn.Linear(cfg.hidden_size, vocab, bias=False, device=device, dtype=dtype)

    def forward(self, ids_BS: torch.Tensor) -> torch.Tensor:
        x_BSH = self.embed(ids_BS)
        for norm, moe in zip(self.norms, self.moes):
            x_BSH = x_BSH + moe(norm(x_BSH))
        return self.head(x_BSH)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    print(tmo.available_backends(device))
    cfg = tmo.MoEConfig(hidden_size=256, intermediate_size=128, num_experts=16, top_k=4,
                        scoring="softmax", renormalize=True)
    torch.manual_seed(0)
    model = TinyMoEModel(cfg, vocab=512, layers=args.layers, device=device, dtype=dtype).eval()
    ids = torch.randint(0, 512, (1, args.tokens), device=device)

    compiled = torch.compile(model, backend=tmo.backend(), fullgraph=True)
    with torch.no_grad():
        eager_out, compiled_out = model(ids), compiled(ids)
        diff = (eager_out.float() - compiled_out.float()).abs().max().item()
        eager_ms = call_ms(lambda: model(ids), args.repeats, device)
        compiled_ms = call_ms(lambda: compiled(ids), args.repeats, device)
    print(f"\n{args.layers} MoE layers, {cfg.num_experts} experts, top-{cfg.top_k}, "
          f"{args.tokens} tokens on {device} ({str(dtype).removeprefix('torch.')})")
    print(f"largest |eager - compiled|: {diff:.3g}")
    print(f"eager:    {summary(eager_ms, 'ms')}")
    print(f"compiled: {summary(compiled_ms, 'ms')}")


if __name__ == "__main__":
    main()
