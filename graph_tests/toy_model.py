"""A small decoder with MoE feed-forward layers, the model the graph tests compile.

Legend: B batch, S sequence, T = B * S tokens, H hidden size, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import torch_moe_ops as tmo


class Block(nn.Module):
    def __init__(self, cfg: tmo.MoEConfig, num_heads: int, device=None, dtype=None,
                 ep_group=None):
        super().__init__()
        hidden = cfg.hidden_size
        self.num_heads = num_heads
        self.norm1 = nn.RMSNorm(hidden, device=device, dtype=dtype)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False, device=device, dtype=dtype)
        self.proj = nn.Linear(hidden, hidden, bias=False, device=device, dtype=dtype)
        self.norm2 = nn.RMSNorm(hidden, device=device, dtype=dtype)
        self.moe = tmo.MoE(cfg, device=device, dtype=dtype, ep_group=ep_group)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x_BSH.shape
        q, k, v = self.qkv(self.norm1(x_BSH)).view(batch, seq, 3, self.num_heads, -1).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2), is_causal=True)
        x_BSH = x_BSH + self.proj(attn.transpose(1, 2).reshape(batch, seq, hidden))
        return x_BSH + self.moe(self.norm2(x_BSH))


class ToyMoEModel(nn.Module):
    """Embedding, ``num_layers`` attention + MoE blocks, tied LM head:
    ``ids [B, S] -> logits [B, S, V]``. ``ep_group``: the blocks' expert-parallel group."""

    def __init__(self, cfg: tmo.MoEConfig, vocab_size: int = 64, num_layers: int = 2,
                 num_heads: int = 2, device=None, dtype=None, ep_group=None):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        self.blocks = nn.ModuleList(Block(cfg, num_heads, device, dtype, ep_group)
                                    for _ in range(num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, device=device, dtype=dtype)

    def forward(self, ids_BS: torch.Tensor) -> torch.Tensor:
        x_BSH = self.embed(ids_BS)
        for block in self.blocks:
            x_BSH = block(x_BSH)
        return self.norm(x_BSH) @ self.embed.weight.t()


CONFIGS = {
    "mixtral": tmo.MoEConfig(hidden_size=32, intermediate_size=16, num_experts=8, top_k=2,
                             renormalize=True),
    "deepseek": tmo.MoEConfig(hidden_size=32, intermediate_size=16, num_experts=8, top_k=2,
                              scoring="sigmoid", correction_bias=True, num_expert_groups=4,
                              topk_groups=2, renormalize=True, routed_scaling_factor=2.5,
                              shared_expert_intermediate_size=16),
    "gpt_oss": tmo.MoEConfig(hidden_size=32, intermediate_size=16, num_experts=4, top_k=2,
                             scoring="topk_softmax", router_bias=True, activation="swiglu_oai",
                             expert_bias=True),
    "qwen2_moe": tmo.MoEConfig(hidden_size=32, intermediate_size=16, num_experts=8, top_k=4,
                               shared_expert_intermediate_size=24, shared_expert_gate=True),
}


def make_model(name: str, device="cpu", dtype=torch.float32, num_layers: int = 2,
               seed: int = 0) -> ToyMoEModel:
    torch.manual_seed(seed)
    model = ToyMoEModel(CONFIGS[name], num_layers=num_layers, device=device, dtype=dtype)
    for module in model.modules():
        if isinstance(module, tmo.MoE) and module.e_score_correction_bias is not None:
            # A non-zero bias, so that tests see selection differ from weighting.
            module.e_score_correction_bias.uniform_(-0.1, 0.1)
        if isinstance(module, tmo.MoE) and module.b13 is not None:
            nn.init.normal_(module.b13, std=0.1)
            nn.init.normal_(module.b2, std=0.1)
    return model
