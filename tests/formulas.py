"""What the ops compute, written from the definitions in fp64 on the CPU: the
expected values of the tests.

Legend: T tokens, H hidden size, I expert intermediate size, E experts,
K experts per token, F = 2*I (gate rows then up rows), G expert groups.

Nothing here calls `torch_moe_ops` or ``torch.nn.functional``, and the experts
run one (token, slot) pair at a time rather than densely or sorted, so a
backend's mistake cannot reach its own expected values. Every formula is
differentiable in its floating-point inputs.
"""

from __future__ import annotations

import math

import torch


def _fp64(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.double().cpu()


def sigmoid_formula(x: torch.Tensor) -> torch.Tensor:
    return 1 / (1 + torch.exp(-x))


def activation_formula(gate_I: torch.Tensor, up_I: torch.Tensor, activation: str,
                       swiglu_alpha: float, swiglu_limit: float) -> torch.Tensor:
    """``act(gate, up)`` of the gated MLP, any shape.

    - ``silu``: ``silu(gate) * up`` with ``silu(g) = g * sigmoid(g)``;
    - ``gelu``: ``gelu(gate) * up`` with the exact ``gelu(g) = g * Phi(g)``
      (``Phi(g) = (1 + erf(g / sqrt(2))) / 2``);
    - ``swiglu_oai`` (GPT-OSS): ``gate = min(gate, limit)``,
      ``up = clamp(up, -limit, limit)``, ``(up + 1) * gate * sigmoid(alpha * gate)``.
    """
    if activation == "silu":
        return gate_I * sigmoid_formula(gate_I) * up_I
    if activation == "gelu":
        return gate_I * 0.5 * (1 + torch.erf(gate_I / math.sqrt(2))) * up_I
    if activation != "swiglu_oai":
        raise ValueError(f"activation must be 'silu', 'gelu' or 'swiglu_oai', got {activation!r}")
    limit = swiglu_limit
    gate_I = torch.where(gate_I > limit, limit, gate_I)  # upper bound only
    up_I = torch.where(up_I > limit, limit, torch.where(up_I < -limit, -limit, up_I))
    return (up_I + 1) * gate_I * sigmoid_formula(swiglu_alpha * gate_I)


def gated_mlp_formula(x_NH: torch.Tensor, w13_FH: torch.Tensor, w2_HI: torch.Tensor,
                      b13_F: torch.Tensor | None, b2_H: torch.Tensor | None,
                      activation: str, swiglu_alpha: float = 1.702,
                      swiglu_limit: float = 7.0) -> torch.Tensor:
    """One expert on ``x [..., H]``: ``act(x @ w13.T + b13) @ w2.T + b2`` in fp64."""
    h_NF = x_NH.double().cpu() @ _fp64(w13_FH).T
    if b13_F is not None:
        h_NF = h_NF + _fp64(b13_F)
    intermediate_size = w2_HI.shape[-1]
    gate_NI, up_NI = h_NF[..., :intermediate_size], h_NF[..., intermediate_size:]
    y_NH = activation_formula(gate_NI, up_NI, activation, swiglu_alpha, swiglu_limit) \
        @ _fp64(w2_HI).T
    return y_NH if b2_H is None else y_NH + _fp64(b2_H)


def experts_formula(hidden_TH: torch.Tensor, topk_weights_TK: torch.Tensor,
                    topk_ids_TK: torch.Tensor, w13_EFH: torch.Tensor, w2_EHI: torch.Tensor,
                    b13_EF: torch.Tensor | None, b2_EH: torch.Tensor | None,
                    activation: str, swiglu_alpha: float, swiglu_limit: float) -> torch.Tensor:
    """``moe::experts`` one slot at a time, fp64 ``[T, H]`` on the CPU::

        for t, k: if (e := topk_ids[t, k]) >= 0:
            out[t] += topk_weights[t, k] * (act(x[t] @ w13[e].T + b13[e]) @ w2[e].T + b2[e])
    """
    # Every input goes to fp64 on the CPU once: a copy per slot would move a whole
    # expert's weights off the device each time (minutes at T=2048).
    hidden_TH, topk_weights_TK = _fp64(hidden_TH), _fp64(topk_weights_TK)
    w13_EFH, w2_EHI, b13_EF, b2_EH = _fp64(w13_EFH), _fp64(w2_EHI), _fp64(b13_EF), _fp64(b2_EH)
    rows = []
    for t, ids in enumerate(topk_ids_TK.tolist()):
        out_H = torch.zeros(hidden_TH.shape[1], dtype=torch.float64)
        for k, e in enumerate(ids):
            if e < 0:
                continue
            y_H = gated_mlp_formula(hidden_TH[t], w13_EFH[e], w2_EHI[e],
                                    None if b13_EF is None else b13_EF[e],
                                    None if b2_EH is None else b2_EH[e],
                                    activation, swiglu_alpha, swiglu_limit)
            out_H = out_H + topk_weights_TK[t, k] * y_H
        rows.append(out_H)
    if not rows:
        return torch.zeros((0, hidden_TH.shape[1]), dtype=torch.float64)
    return torch.stack(rows)


def selection_formula(scores_TE: torch.Tensor, top_k: int, num_expert_groups: int,
                      topk_groups: int) -> torch.Tensor:
    """Chosen ids ``[T, K]`` (int64), one token at a time: group-limited top-k.

    A group's score is the sum of the two best selection scores in it; only the
    ``topk_groups`` best groups stay eligible; then the ``top_k`` best eligible experts.
    """
    num_experts = scores_TE.shape[1]
    group_size = num_experts // num_expert_groups
    chosen = []
    for scores_E in scores_TE.tolist():
        groups = [scores_E[g * group_size:(g + 1) * group_size]
                  for g in range(num_expert_groups)]
        group_scores = [sum(sorted(group)[-2:]) for group in groups]
        kept = sorted(range(num_expert_groups), key=lambda g: -group_scores[g])[:topk_groups]
        eligible = [e for e in range(num_experts) if e // group_size in kept]
        chosen.append(sorted(eligible, key=lambda e: -scores_E[e])[:top_k])
    return torch.tensor(chosen, dtype=torch.long).reshape(-1, top_k)


def route_formula(logits_TE: torch.Tensor, correction_bias_E: torch.Tensor | None,
                  top_k: int, scoring: str, renormalize: bool, num_expert_groups: int,
                  topk_groups: int, routed_scaling_factor: float):
    """``moe::route``'s arguments -> fp64 weights ``[T, K]`` and int64 ids ``[T, K]``.

    - ``softmax``: ``p = softmax(logits)``, the top-k of ``p``, renormalized if asked;
    - ``topk_softmax`` (GPT-OSS): a softmax over the K best logits only;
    - ``sigmoid`` (DeepSeek-V3): ``s = sigmoid(logits)``; experts are chosen on
      ``s + correction_bias``, the weights are the unbiased ``s``, renormalized if asked.

    Every family ends with ``weights *= routed_scaling_factor``. Differentiable in
    ``logits_TE`` with the selection held fixed.
    """
    logits_TE = logits_TE.double().cpu()
    if scoring == "topk_softmax":
        ids_TK = selection_formula(logits_TE.detach(), top_k, num_expert_groups, topk_groups)
        chosen_TK = logits_TE.gather(1, ids_TK)
        weights_TK = chosen_TK.exp() / chosen_TK.exp().sum(-1, keepdim=True)
    else:
        if scoring == "softmax":
            scores_TE = logits_TE.exp() / logits_TE.exp().sum(-1, keepdim=True)
        else:
            scores_TE = sigmoid_formula(logits_TE)
        selection_TE = scores_TE.detach()
        if correction_bias_E is not None:
            selection_TE = selection_TE + _fp64(correction_bias_E)  # steers the choice only
        ids_TK = selection_formula(selection_TE, top_k, num_expert_groups, topk_groups)
        weights_TK = scores_TE.gather(1, ids_TK)
        if renormalize:
            weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
    return weights_TK * routed_scaling_factor, ids_TK


def experts_backward_formula(grad_out_TH: torch.Tensor, hidden_TH: torch.Tensor,
                             topk_weights_TK: torch.Tensor, topk_ids_TK: torch.Tensor,
                             w13_EFH: torch.Tensor, w2_EHI: torch.Tensor,
                             b13_EF: torch.Tensor | None, b2_EH: torch.Tensor | None,
                             activation: str, swiglu_alpha: float, swiglu_limit: float) -> tuple:
    """``moe::experts_backward``'s outputs in fp64 on the CPU: the gradients of
    `experts_formula` (fp64 autograd) against ``grad_out``, in the op's order
    ``(hidden, topk_weights, w13, w2, b13, b2)``; an absent bias gets ``None``."""
    leaves = [None if t is None else _fp64(t).requires_grad_(True)
              for t in (hidden_TH, topk_weights_TK, w13_EFH, w2_EHI, b13_EF, b2_EH)]
    hidden, weights, w13, w2, b13, b2 = leaves
    out_TH = experts_formula(hidden, weights, topk_ids_TK, w13, w2, b13, b2, activation,
                             swiglu_alpha, swiglu_limit)
    if not out_TH.requires_grad:  # no token, or every slot skipped: nothing depends on them
        return tuple(None if t is None else torch.zeros_like(t) for t in leaves)
    present = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(out_TH, present, _fp64(grad_out_TH), allow_unused=True,
                                     materialize_grads=True))
    return tuple(None if t is None else next(grads) for t in leaves)


def _slot_fractions(topk_ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[E]`` fp64: the fraction of the slots ``topk_ids [T, K]`` that chose each expert."""
    ids = topk_ids_TK.reshape(-1).tolist()
    return torch.tensor([ids.count(e) / max(len(ids), 1) for e in range(num_experts)],
                        dtype=torch.float64)


def balance_probs_formula(logits_TE: torch.Tensor, scoring: str) -> torch.Tensor:
    """fp64 ``[T, E]``: the distribution the auxiliary losses balance, ``exp(x) / sum exp(x)``
    (softmax and GPT-OSS's scoring alike), for ``sigmoid`` DeepSeek-V3's
    ``s'_{t,e} = s_{t,e} / sum_j s_{t,j}``."""
    logits_TE = logits_TE.double().cpu()
    scores_TE = sigmoid_formula(logits_TE) if scoring == "sigmoid" else logits_TE.exp()
    return scores_TE / scores_TE.sum(-1, keepdim=True)


def switch_loss_formula(logits_TE: torch.Tensor, topk_ids_TK: torch.Tensor,
                        scoring: str) -> torch.Tensor:
    """The Switch Transformer / GShard load-balancing loss, fp64 (Fedus et al. 2021, eq. 4,
    with top-k routing: ``f_e`` counts slots)::

        loss = E * sum_e f_e * P_e,  f_e = (1 / (T K)) sum_{t,k} [ids[t, k] == e],
                                     P_e = (1 / T) sum_t p[t, e]
    """
    num_experts = logits_TE.shape[1]
    p_TE = balance_probs_formula(logits_TE, scoring)
    return num_experts * (_slot_fractions(topk_ids_TK, num_experts) * p_TE.mean(0)).sum()


def sequence_loss_formula(logits_BSE: torch.Tensor, topk_ids_BSK: torch.Tensor,
                          scoring: str) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss (eqs. 17-20), fp64, averaged
    over the B sequences of S tokens each::

        f_i = E / (K S) * sum_t [i in topk(t)],  P_i = (1 / S) sum_t s'_{i,t},
        loss_b = sum_i f_i P_i
    """
    num_sequences, seq_len, num_experts = logits_BSE.shape
    top_k = topk_ids_BSK.shape[-1]
    losses = []
    for b in range(num_sequences):
        ids = topk_ids_BSK[b].reshape(-1).tolist()
        f_E = torch.tensor([num_experts / (top_k * seq_len) * ids.count(i)
                            for i in range(num_experts)], dtype=torch.float64)
        p_E = balance_probs_formula(logits_BSE[b], scoring).mean(0)
        losses.append((f_E * p_E).sum())
    return torch.stack(losses).mean()


def z_loss_formula(logits_TE: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss (Zoph et al. 2022, eq. 5), fp64:
    ``(1 / T) sum_t (log sum_e exp(x[t, e]))^2``."""
    logits_TE = logits_TE.double().cpu()
    return (logits_TE.exp().sum(-1).log() ** 2).mean()
