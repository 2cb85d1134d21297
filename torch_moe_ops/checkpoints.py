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
A tensor the block's layout needs and the checkpoint lacks is a ValueError naming
the checkpoint, the key, and the layout its other keys told.

This module reads checkpoints in their own terms and knows no model: `MoE.load_quantized`
and `torch_moe_ops.hf.load_into` put what it reads where their modules keep it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from torch_moe_ops import quant
from torch_moe_ops.config import QuantSpec

LAYOUTS = ("deepseek_v3", "gpt_oss")
# Per layout, the key (under a block's prefix) whose presence tells it.
LAYOUT_KEYS = {"deepseek_v3": "experts.0.gate_proj.weight",
               "gpt_oss": "experts.gate_up_proj_blocks"}
# Per layout, what its checkpoints hold (said where one lacks a tensor), and its router's name.
LAYOUT_NAMES = {"deepseek_v3": "DeepSeek-V3's fp8 experts", "gpt_oss": "GPT-OSS's MXFP4 experts"}
ROUTERS = {"deepseek_v3": "gate", "gpt_oss": "router"}
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
                # Where a missing tensor was looked for.
                self._source = f"checkpoint {str(path)!r} (its index {indexes[0].name})"
                return
            files = sorted(path.glob("*.safetensors"))
        else:
            files = []
        if not files:
            raise ValueError(f"path must be a .safetensors file or a folder holding them, "
                             f"got {str(path)!r}")
        self._source = (f"checkpoint file {str(files[0])!r}" if len(files) == 1 else
                        f"checkpoint {str(path)!r} (its {len(files)} .safetensors files)")
        self._file_of = {}
        for file in files:
            with self._safe_open(file, framework="pt") as opened:
                self._file_of.update(dict.fromkeys(opened.keys(), file))

    def __contains__(self, key: str) -> bool:
        return key in self._file_of

    def get(self, key: str, experts: range | None = None, expected: str = "") -> torch.Tensor:
        """The tensor ``key``; with ``experts``, only those rows of its first dimension.
        Where there is none, a ValueError naming the checkpoint and ``key``, and
        ``expected`` (what the checkpoint was taken to be) where given."""
        if key not in self._file_of:
            raise ValueError(f"{self._source} has no tensor {key!r}"
                             + (f": {expected}" if expected else ""))
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


@dataclasses.dataclass(frozen=True)
class Block:
    """One MoE block of ``checkpoint``: the tensors under ``prefix``, stored in ``layout``
    (`layout_of`). A key it lacks is an error that says which layout was expected."""

    checkpoint: Checkpoint
    prefix: str
    layout: str

    @classmethod
    def of(cls, checkpoint: Checkpoint, prefix: str) -> Block:
        return cls(checkpoint, prefix, layout_of(checkpoint, prefix))

    def __contains__(self, key: str) -> bool:
        return key in self.checkpoint

    def get(self, key: str, experts: range | None = None) -> torch.Tensor:
        """`Checkpoint.get` of ``key`` (a whole key, prefix included)."""
        return self.checkpoint.get(
            key, experts, expected=(f"expected {LAYOUT_NAMES[self.layout]} under "
                                    f"{self.prefix!r} (layout {self.layout!r}, as its "
                                    f"{LAYOUT_KEYS[self.layout]!r} says), which hold it"))


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


def _fp8_projection(block: Block, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q fp8 [N, K], scale fp32 [N / bn, K / bk])`` of the projection ``key``."""
    q = block.get(f"{key}.weight")
    _check_dtype(f"{key}.weight", q, (quant.FP8_DTYPE,), "DeepSeek-V3-style fp8 weights")
    scale = block.get(f"{key}.weight_scale_inv")
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


def _read_deepseek_v3(block: Block, experts: range) -> ExpertTensors:
    key = f"{block.prefix}.experts.{experts.start}.gate_proj"
    block_size = _fp8_block_size(key, *_fp8_projection(block, key))
    bn, bk = block_size
    w13_q, w13_s, w2_q, w2_s = [], [], [], []
    for e in experts:
        key = f"{block.prefix}.experts.{e}"
        (gate, gate_s), (up, up_s), (down, down_s) = (
            _fp8_projection(block, f"{key}.{proj}")
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


def _mxfp4_projection(block: Block, key: str, experts: range
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed uint8 [E_l, N, K / 2], scales uint8 [E_l, N, K / 32])`` of ``key``."""
    blocks = block.get(f"{key}_blocks", experts)
    scales = block.get(f"{key}_scales", experts)
    _check_dtype(f"{key}_blocks", blocks, (torch.uint8,), "MXFP4 values, two a byte")
    _check_dtype(f"{key}_scales", scales, (torch.uint8,), "e8m0 scales")
    if blocks.dim() != 4 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"{key}_blocks must have shape [E, N, K / 32, 16] with {key}_scales "
                         f"[E, N, K / 32], got {list(blocks.shape)} and {list(scales.shape)}")
    if blocks.shape[0] != len(experts):
        raise ValueError(f"{key}_blocks must hold experts {experts.start}..{experts.stop - 1}, "
                         f"got {blocks.shape[0]} of them there")
    return blocks.reshape(*blocks.shape[:2], -1), scales


def _read_gpt_oss(block: Block, experts: range) -> ExpertTensors:
    key = f"{block.prefix}.experts"
    w13, w13_scale = _mxfp4_projection(block, f"{key}.gate_up_proj", experts)
    w2, w2_scale = _mxfp4_projection(block, f"{key}.down_proj", experts)
    b13 = block.get(f"{key}.gate_up_proj_bias", experts)
    b2 = block.get(f"{key}.down_proj_bias", experts)
    return ExpertTensors(QuantSpec("mxfp4"), _gate_then_up(w13), w2, _gate_then_up(w13_scale),
                         w2_scale, _gate_then_up(b13), b2)


def read_experts(checkpoint: Checkpoint, prefix: str, experts: range) -> ExpertTensors:
    """The experts ``experts`` (global ids) of the block under ``prefix``, in our
    quantized layout (see the module's docstring)."""
    block = Block.of(checkpoint, prefix)
    if block.layout == "deepseek_v3":
        return _read_deepseek_v3(block, experts)
    return _read_gpt_oss(block, experts)


def _dense(block: Block, key: str, block_size: tuple[int, int]) -> torch.Tensor:
    """A dense projection's weight ``[N, K]`` in fp32, dequantized if stored in fp8."""
    q = block.get(f"{key}.weight")
    if q.dtype != quant.FP8_DTYPE:
        return q.float()
    q, scale = _fp8_projection(block, key)
    spec = QuantSpec("fp8_block", block_size=block_size)
    _check_block(key, scale, quant.scale_shape(spec, 1, *q.shape)[1:], block_size)
    return quant.dequantize_weights(q[None], scale[None], spec)[0]


@dataclasses.dataclass
class DenseTensors:
    """One block's tensors besides its experts, as read: the router's ``router_weight
    [E, H]`` and optional ``router_bias [E]`` and ``correction_bias [E]`` (DeepSeek-V3's
    ``e_score_correction_bias``), and the shared experts' ``shared_gate``, ``shared_up``
    ``[S, H]`` and ``shared_down [H, S]`` in fp32 (dequantized where stored in fp8), None
    where the block has none."""

    router_weight: torch.Tensor
    router_bias: torch.Tensor | None = None
    correction_bias: torch.Tensor | None = None
    shared_gate: torch.Tensor | None = None
    shared_up: torch.Tensor | None = None
    shared_down: torch.Tensor | None = None


def read_dense(checkpoint: Checkpoint, prefix: str,
               block_size: tuple[int, int] | None) -> DenseTensors:
    """The router and shared experts of the block under ``prefix``; fp8 shared experts are
    dequantized with ``block_size`` (the experts', `read_experts`' ``spec.block_size``)."""
    block = Block.of(checkpoint, prefix)
    router = f"{prefix}.{ROUTERS[block.layout]}"
    dense = DenseTensors(block.get(f"{router}.weight"))
    for field, key in (("router_bias", f"{router}.bias"),
                       ("correction_bias", f"{router}.e_score_correction_bias")):
        if key in block:
            setattr(dense, field, block.get(key))
    shared = f"{prefix}.shared_experts"
    if f"{shared}.gate_proj.weight" in block:
        dense.shared_gate, dense.shared_up, dense.shared_down = (
            _dense(block, f"{shared}.{proj}", block_size)
            for proj in ("gate_proj", "up_proj", "down_proj"))
    return dense
