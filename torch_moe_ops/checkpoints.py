"""Quantized MoE checkpoints in safetensors, read into the quantized layout of
`torch_moe_ops.quant`: DeepSeek-V3's fp8 experts and GPT-OSS's MXFP4 experts.

Legend: E experts (E_l: the ones read), H hidden size, I expert intermediate
size, F = 2 * I, S shared-expert intermediate size, bn x bk one fp8 scale block.

Layouts, as keys under one block's prefix (e.g. ``model.layers.3.mlp``):

- ``"deepseek_v3"``: a tensor per expert and projection:
  ``experts.{e}.gate_proj.weight`` float8_e4m3fn ``[I, H]`` with
  ``experts.{e}.gate_proj.weight_scale_inv`` fp32 ``[I / bn, H / bk]`` (it
  multiplies: ``w = q * scale_inv``), ``up_proj`` alike, ``down_proj`` ``[H, I]``
  with ``[H / bn, I / bk]``; the router ``gate.weight [E, H]`` and
  ``gate.e_score_correction_bias [E]``; shared experts
  ``shared_experts.{gate,up,down}_proj.weight`` (fp8 with scales, or float).
  Read as ``fp8_block`` with the checkpoint's block (128 x 128 for DeepSeek-V3,
  read off the scales' shapes): ``w13 [E, F, H]`` is each expert's gate rows then
  up rows (as transformers merges them), ``w13_scale [E, F / bn, H / bk]``,
  ``w2 [E, H, I]``, ``w2_scale [E, H / bn, I / bk]``: the checkpoint's bytes, stacked.
- ``"gpt_oss"``: every expert in one tensor: ``experts.gate_up_proj_blocks``
  uint8 ``[E, F, H / 32, 16]`` (two e2m1 values a byte, element ``2j`` in the low
  nibble), ``experts.gate_up_proj_scales`` uint8 ``[E, F, H / 32]`` (e8m0),
  ``experts.gate_up_proj_bias [E, F]``, the F rows interleaved (even rows gate,
  odd rows up); ``experts.down_proj_blocks [E, H, I / 32, 16]``,
  ``down_proj_scales [E, H, I / 32]``, ``down_proj_bias [E, H]``; the router
  ``router.weight [E, H]``, ``router.bias [E]``. Read as ``mxfp4``: the bytes keep
  their packing (``[E, F, H / 32, 16]`` is ``[E, F, H / 2]``), and the rows of
  ``w13``, its scales and ``b13`` are reordered gate then up: exact, nothing is
  requantized.

A checkpoint is a ``.safetensors`` file or a folder of them (with or without the
``*.safetensors.index.json`` transformers writes beside its shards). Only the
tensors asked for are read; with expert parallelism, only this rank's experts.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from torch_moe_ops import quant
from torch_moe_ops.config import QuantSpec

if TYPE_CHECKING:
    from torch_moe_ops.layer import MoE

LAYOUTS = ("deepseek_v3", "gpt_oss")
# Per layout, the key (under a block's prefix) whose presence tells it.
LAYOUT_KEYS = {"deepseek_v3": "experts.0.gate_proj.weight",
               "gpt_oss": "experts.gate_up_proj_blocks"}
FLOAT_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _safe_open():
    try:
        from safetensors import safe_open
    except ImportError as error:
        raise ImportError("reading quantized checkpoints needs safetensors: pip install "
                          "'torch-moe-ops[quant]' (or pip install safetensors)") from error
    return safe_open


class Checkpoint:
    """The tensors of safetensors files, read one at a time by name.

    ``path``: a ``.safetensors`` file, or a folder holding them (its
    ``*.safetensors.index.json`` maps each name to its file where there is one)."""

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        self.path = path
        self._safe_open = _safe_open()
        if path.is_file():
            files = [path]
        elif path.is_dir():
            indexes = sorted(path.glob("*.safetensors.index.json"))
            if indexes:
                weight_map = json.loads(indexes[0].read_text())["weight_map"]
                self._file_of = {key: path / name for key, name in weight_map.items()}
                return
            files = sorted(path.glob("*.safetensors"))
        else:
            files = []
        if not files:
            raise ValueError(f"path must be a .safetensors file or a folder holding them, "
                             f"got {str(path)!r}")
        self._file_of = {}
        for file in files:
            with self._safe_open(file, framework="pt") as opened:
                self._file_of.update(dict.fromkeys(opened.keys(), file))

    def __contains__(self, key: str) -> bool:
        return key in self._file_of

    def get(self, key: str, experts: range | None = None) -> torch.Tensor:
        """The tensor ``key``; with ``experts``, only those rows of its first dimension."""
        if key not in self._file_of:
            raise KeyError(f"{str(self.path)!r} has no tensor {key!r}")
        with self._safe_open(self._file_of[key], framework="pt") as opened:
            if experts is None:
                return opened.get_tensor(key)
            return opened.get_slice(key)[experts.start:experts.stop]


def layout_of(checkpoint: Checkpoint, prefix: str) -> str:
    """The layout (`LAYOUTS`) of the experts under ``prefix``."""
    for layout, key in LAYOUT_KEYS.items():
        if f"{prefix}.{key}" in checkpoint:
            return layout
    looked = ", ".join(repr(f"{prefix}.{key}") for key in LAYOUT_KEYS.values())
    raise ValueError(f"prefix must name an MoE block of a quantized checkpoint (one of "
                     f"{looked} in {str(checkpoint.path)!r}), got {prefix!r}")


@dataclasses.dataclass
class ExpertTensors:
    """One block's experts as read: ``spec`` (its activations the format's
    default), ``w13``, ``w2``, ``w13_scale``, ``w2_scale`` in that format, and
    the float biases ``b13 [E_l, F]``, ``b2 [E_l, H]`` or None."""

    spec: QuantSpec
    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor
    w2_scale: torch.Tensor
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor by our name, the absent biases left out."""
        return {name: tensor for name, tensor in (
            ("w13", self.w13), ("w2", self.w2), ("w13_scale", self.w13_scale),
            ("w2_scale", self.w2_scale), ("b13", self.b13), ("b2", self.b2))
            if tensor is not None}


def _check_dtype(key: str, tensor: torch.Tensor, dtypes, what: str) -> None:
    if tensor.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{key} must have dtype in ({names}) ({what}), got "
                         f"{str(tensor.dtype).removeprefix('torch.')}")


def _fp8_projection(checkpoint: Checkpoint, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q fp8 [N, K], scale fp32 [N / bn, K / bk])`` of the projection ``key``."""
    q = checkpoint.get(f"{key}.weight")
    _check_dtype(f"{key}.weight", q, (quant.FP8_DTYPE,), "DeepSeek-V3-style fp8 weights")
    scale = checkpoint.get(f"{key}.weight_scale_inv")
    _check_dtype(f"{key}.weight_scale_inv", scale, FLOAT_SCALE_DTYPES, "block scales")
    return q, scale.float()


def _fp8_block_size(key: str, q: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    """The block that scales ``q [N, K]`` with ``scale [N / bn, K / bk]``."""
    (rows, cols), (scale_rows, scale_cols) = q.shape, scale.shape
    if rows % scale_rows or cols % scale_cols:
        raise ValueError(f"{key}.weight_scale_inv must have a shape that divides its weight's "
                         f"{list(q.shape)} (whole scale blocks: fp8_block needs sizes that are "
                         f"multiples of the block), got {list(scale.shape)}")
    return rows // scale_rows, cols // scale_cols


def _check_block(key: str, scale: torch.Tensor, expected: tuple[int, ...],
                 block: tuple[int, int]) -> None:
    if tuple(scale.shape) != expected:
        raise ValueError(f"{key}.weight_scale_inv must have shape {list(expected)} (block "
                         f"{block[0]} x {block[1]}), got {list(scale.shape)}")


def _read_deepseek_v3(checkpoint: Checkpoint, prefix: str, experts: range) -> ExpertTensors:
    key = f"{prefix}.experts.{experts.start}.gate_proj"
    block_size = _fp8_block_size(key, *_fp8_projection(checkpoint, key))
    bn, bk = block_size
    w13_q, w13_s, w2_q, w2_s = [], [], [], []
    for e in experts:
        key = f"{prefix}.experts.{e}"
        (gate, gate_s), (up, up_s), (down, down_s) = (
            _fp8_projection(checkpoint, f"{key}.{proj}")
            for proj in ("gate_proj", "up_proj", "down_proj"))
        inter, hidden = gate.shape
        for proj, q, scale, (rows, cols) in (("gate_proj", gate, gate_s, (inter, hidden)),
                                             ("up_proj", up, up_s, (inter, hidden)),
                                             ("down_proj", down, down_s, (hidden, inter))):
            if tuple(q.shape) != (rows, cols):
                raise ValueError(f"{key}.{proj}.weight must have shape {[rows, cols]} "
                                 f"(gate_proj's [I, H]), got {list(q.shape)}")
            if rows % bn or cols % bk:
                raise ValueError(f"{key}.{proj}.weight must have a shape that is a multiple of "
                                 f"the block {bn} x {bk} (fp8_block), got {list(q.shape)}")
            _check_block(f"{key}.{proj}", scale, (rows // bn, cols // bk), block_size)
        w13_q.append(torch.cat([gate, up]))
        w13_s.append(torch.cat([gate_s, up_s]))
        w2_q.append(down)
        w2_s.append(down_s)
    spec = QuantSpec("fp8_block", block_size=tuple(block_size))
    return ExpertTensors(spec, torch.stack(w13_q), torch.stack(w2_q), torch.stack(w13_s),
                         torch.stack(w2_s))


def _gate_then_up(interleaved: torch.Tensor) -> torch.Tensor:
    """``[E, F, ...]`` with gate and up rows interleaved (GPT-OSS) -> gate rows, then up rows."""
    return torch.cat([interleaved[:, 0::2], interleaved[:, 1::2]], dim=1)


def _mxfp4_projection(checkpoint: Checkpoint, key: str, experts: range
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed uint8 [E_l, N, K / 2], scales uint8 [E_l, N, K / 32])`` of ``key``."""
    blocks = checkpoint.get(f"{key}_blocks", experts)
    scales = checkpoint.get(f"{key}_scales", experts)
    _check_dtype(f"{key}_blocks", blocks, (torch.uint8,), "MXFP4 values, two a byte")
    _check_dtype(f"{key}_scales", scales, (torch.uint8,), "e8m0 scales")
    if blocks.dim() != 4 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"{key}_blocks must have shape [E, N, K / 32, 16] with {key}_scales "
                         f"[E, N, K / 32], got {list(blocks.shape)} and {list(scales.shape)}")
    if blocks.shape[0] != len(experts):
        raise ValueError(f"{key}_blocks must hold experts {experts.start}..{experts.stop - 1}, "
                         f"got {blocks.shape[0]} of them there")
    return blocks.reshape(*blocks.shape[:2], -1), scales


def _read_gpt_oss(checkpoint: Checkpoint, prefix: str, experts: range) -> ExpertTensors:
    key = f"{prefix}.experts"
    w13, w13_scale = _mxfp4_projection(checkpoint, f"{key}.gate_up_proj", experts)
    w2, w2_scale = _mxfp4_projection(checkpoint, f"{key}.down_proj", experts)
    b13 = checkpoint.get(f"{key}.gate_up_proj_bias", experts)
    b2 = checkpoint.get(f"{key}.down_proj_bias", experts)
    return ExpertTensors(QuantSpec("mxfp4"), _gate_then_up(w13), w2, _gate_then_up(w13_scale),
                         w2_scale, _gate_then_up(b13), b2)


def read_experts(checkpoint: Checkpoint, prefix: str, experts: range) -> ExpertTensors:
    """The experts ``experts`` (global ids) of the block under ``prefix``, in our
    quantized layout (see the module's docstring)."""
    layout = layout_of(checkpoint, prefix)
    if layout == "deepseek_v3":
        return _read_deepseek_v3(checkpoint, prefix, experts)
    return _read_gpt_oss(checkpoint, prefix, experts)


def _dense(checkpoint: Checkpoint, key: str, block_size: tuple[int, int]) -> torch.Tensor:
    """A dense projection's weight ``[N, K]`` in fp32, dequantized if stored in fp8."""
    q = checkpoint.get(f"{key}.weight")
    if q.dtype != quant.FP8_DTYPE:
        return q.float()
    q, scale = _fp8_projection(checkpoint, key)
    spec = QuantSpec("fp8_block", block_size=block_size)
    _check_block(key, scale, quant.scale_shape(spec, 1, *q.shape)[1:], block_size)
    return quant.dequantize_weights(q[None], scale[None], spec)[0]


def _router_and_shared(checkpoint: Checkpoint, prefix: str, layout: str,
                       spec: QuantSpec) -> dict[str, torch.Tensor]:
    """The block's other tensors by `MoE` name: router, and shared experts (fp32)."""
    router = f"{prefix}.gate" if layout == "deepseek_v3" else f"{prefix}.router"
    state = {"gate.weight": checkpoint.get(f"{router}.weight")}
    for ours, theirs in (("gate.bias", f"{router}.bias"),
                         ("e_score_correction_bias", f"{router}.e_score_correction_bias")):
        if theirs in checkpoint:
            state[ours] = checkpoint.get(theirs)
    shared = f"{prefix}.shared_experts"
    if f"{shared}.gate_proj.weight" in checkpoint:
        gate, up, down = (_dense(checkpoint, f"{shared}.{proj}", spec.block_size)
                          for proj in ("gate_proj", "up_proj", "down_proj"))
        state["shared_experts.w13"] = torch.cat([gate, up])
        state["shared_experts.w2"] = down
    return state


def load_moe(moe: MoE, path: str | os.PathLike, prefix: str) -> None:
    """Fill ``moe`` (built with ``cfg.quant``) from the block under ``prefix`` in
    the checkpoint at ``path``: its experts as stored (this rank's only, with
    expert parallelism), the router, and the shared experts (dequantized to the
    block's float dtype). `MoE.load_quantized` calls it; see there."""
    cfg = moe.cfg
    if cfg.quant is None:
        raise ValueError("moe.cfg.quant must be a QuantSpec to load a quantized checkpoint "
                         "(QuantSpec('fp8_block') for DeepSeek-V3's, QuantSpec('mxfp4') for "
                         "GPT-OSS's), got None")
    checkpoint = Checkpoint(path)
    layout = layout_of(checkpoint, prefix)
    read = read_experts(checkpoint, prefix, moe.local_experts)
    if (read.spec.weights, read.spec.block_size) != (cfg.quant.weights, cfg.quant.block_size):
        raise ValueError(f"moe.cfg.quant must have weights={read.spec.weights!r}"
                         + ("" if read.spec.block_size is None
                            else f" and block_size={read.spec.block_size}")
                         + f" for the {layout} checkpoint {str(checkpoint.path)!r} (activations "
                         f"as you choose), got {cfg.quant}")
    state = {**read.tensors(), **_router_and_shared(checkpoint, prefix, layout, read.spec)}
    moe.load_state_dict(state)
