"""Whether the ``deepep`` a2a backend runs a layer here (the registry's ``supports``), in
which formats (``format_reason``), and in which of DeepEP's modes (``mode_of``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from torch_moe_ops.backends.deepep import configs
from torch_moe_ops.backends.deepep.buffer import import_deep_ep
from torch_moe_ops.backends.deepep.modes import (
    DTYPE,
    LOW_LATENCY,
    LOW_LATENCY_MAX_TOKENS,
    NAMESPACE,
    NORMAL,
    ROWS_NAMESPACES,
    choose_mode,
    chosen_mode,
    fp8_transport_reason,
    low_latency_mode_reason,
    mode_reason,
    normal_mode_reason,
)
from torch_moe_ops.backends.registry import FORMATS, MASKED, TOKENS, Format, TransportMode
from torch_moe_ops.ops.dispatch_quant import FP8_ACTIVATION_FORMATS


def supports(spec, problem, device) -> str | None:
    """None where DeepEP runs ``problem`` on ``device`` in a format it could take, else why
    not (`shape_reason`)."""
    # The device first: where DeepEP cannot run at all, installing it would not help.
    if device.type != "cuda":
        return f"needs CUDA GPUs (DeepEP's NVLink/RDMA kernels), got device {device}"
    if not torch.cuda.is_available():
        return "needs CUDA GPUs (DeepEP's NVLink/RDMA kernels): this torch sees none"
    if not dist.is_available():
        return "this torch has no torch.distributed"
    deep_ep, reason = import_deep_ep()
    if reason is not None:
        return reason
    if problem.ep_size is not None and problem.ep_size < 2:
        return "needs expert parallelism (ep_size > 1); a2a 'none' runs one device"
    if problem.dtype != DTYPE:
        return (f"DeepEP moves bfloat16 activations (bf16, or fp8 quantized from bf16), got "
                f"{problem.dtype}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if deep_ep.Buffer.is_sm90_compiled() and torch.cuda.get_device_capability(index) < (9, 0):
        return (f"this DeepEP build targets sm90 and GPU {index} is "
                f"sm{''.join(map(str, torch.cuda.get_device_capability(index)))}")
    return shape_reason(problem)


def format_reason(fmt: Format, problem) -> str | None:
    """Why DeepEP cannot move ``problem``'s layer in format ``fmt`` (None: it can): masked
    blocks run low-latency mode where `choose_mode` gives it (decode sizes), tokens normal
    mode whatever the token count, rows the mode `choose_mode` gives."""
    num_local = problem.num_local_experts
    if num_local is None and problem.num_experts is not None and problem.ep_size:
        num_local = problem.num_experts // problem.ep_size
    shape = (problem.ep_size, problem.hidden_size, problem.top_k)
    if fmt is MASKED:
        if (problem.max_tokens_per_rank or 0) > LOW_LATENCY_MAX_TOKENS:
            reason = (f"DeepEP's low-latency mode serves decode batches, max_tokens_per_rank "
                      f"<= {LOW_LATENCY_MAX_TOKENS}, got {problem.max_tokens_per_rank}")
        else:
            reason = low_latency_mode_reason(*shape, problem.max_tokens_per_rank)
        quant = problem.quant
        if (reason is None and quant is not None and problem.hidden_size is not None
                and quant.activations in FP8_ACTIVATION_FORMATS):
            why = fp8_transport_reason(LOW_LATENCY, quant, problem.hidden_size)
            if why is not None:
                return f"its fp8 blocks travel through DeepEP's low-latency cast only: {why}"
        return None if reason is None else f"the masked format runs low-latency mode: {reason}"
    if fmt is TOKENS:
        reason = normal_mode_reason(*shape, num_local)
        return None if reason is None else f"the tokens format runs normal mode: {reason}"
    if problem.max_tokens_per_rank is None:
        normal = normal_mode_reason(*shape, num_local)
        low_latency = low_latency_mode_reason(*shape, None)
        if normal is not None and low_latency is not None:
            return f"{normal}; {low_latency}"
        return None
    mode = choose_mode(*shape, problem.max_tokens_per_rank)
    return mode_reason(mode, *shape, num_local, problem.max_tokens_per_rank)


def shape_reason(problem) -> str | None:
    """Why DeepEP's kernels cannot run the problem's shape in any format it could take
    (None: they can). A layer without gradients (and not quantized) takes the tokens
    format where normal mode runs it, else rows; others take rows (masked blocks, in
    low-latency mode, serve decode layers without gradients where tokens would too)."""
    if problem.training is False and problem.quant is None:
        reasons = [format_reason(fmt, problem) for fmt in FORMATS]
        return None if None in reasons else "; ".join(reasons)
    return format_reason("rows", problem)


def mode_of(fmt: Format, problem) -> TransportMode:
    """The mode DeepEP moves ``problem``'s layer in, in ``fmt``, and the namespace of the ops
    that run it: masked blocks are low-latency mode's own layout, tokens travel on normal
    mode (its static worst-case receive serves every token count), rows on the mode
    `chosen_mode` gives their shape."""
    if fmt is MASKED:
        return TransportMode(LOW_LATENCY, NAMESPACE, "the masked format is its own layout")
    if fmt is TOKENS:
        mode, namespace, why = NORMAL, NAMESPACE, "the tokens format runs normal mode"
    else:
        mode, why = chosen_mode(problem.ep_size, problem.hidden_size, problem.top_k,
                                problem.max_tokens_per_rank)
        namespace = ROWS_NAMESPACES[mode]
    if mode == NORMAL:
        why += f"; its kernels on {configs.NUM_SMS} SMs (deepep.set_num_sms)"
    return TransportMode(mode, namespace, why)
