"""The Triton fused-MoE kernels against a plain formula.

Legend: T tokens, H hidden size, I expert intermediate size, E experts,
K experts per token, R rows.

Without CUDA the kernels run under the Triton interpreter on CPU tensors
(``TRITON_INTERPRET=1``, set by conftest.py before Triton is imported), with tiny
shapes and fp16/fp32 only: the interpreter mishandles bf16. ``gpu`` tests add
bf16, larger shapes and CUDA-graph capture.
"""

import dataclasses
import json
import math

import pytest
import torch

from formulas import experts_formula
from torch_moe_ops.backends.common import TRITON_INSTALLED
from torch_moe_ops.backends.common.kernels.launch import cdiv, next_power_of_2

if TRITON_INSTALLED:  # otherwise every test here skips (the `triton` marker)
    import triton

    from torch_moe_ops.backends.common.kernels import align
    from torch_moe_ops.backends.triton import configs, fused, tune

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ACTIVATIONS = ("silu", "gelu", "swiglu_oai")
# swiglu_limit=1 makes the clamps bite on O(1) pre-activations.
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 1.0
TOLERANCE = {torch.float32: {"atol": 1e-4, "rtol": 1e-4},
             torch.float16: {"atol": 1e-2, "rtol": 1e-2},
             torch.bfloat16: {"atol": 4e-2, "rtol": 4e-2}}
# A valid tiled-kernel config.
TILES = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4,
         "num_stages": 3}
gpu = pytest.mark.gpu


@pytest.fixture(params=["direct", "tiled"])
def kernel_path(request, monkeypatch):
    """Runs the test on each path's kernels, whatever a call's size would pick."""
    monkeypatch.setattr(fused, "get_config", lambda *key: dataclasses.replace(
        configs.default_config(*key), path=request.param))
    return request.param


def formula(hidden_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI, b13_EF, b2_EH, name):
    """The MoE written out token by token in fp64 on the CPU, at this file's swiglu constants."""
    return experts_formula(hidden_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI, b13_EF,
                           b2_EH, name, SWIGLU_ALPHA, SWIGLU_LIMIT)


def make_experts(E, H, I, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13_EFH = torch.randn(E, 2 * I, H, generator=g) / math.sqrt(H)
    w2_EHI = torch.randn(E, H, I, generator=g) / math.sqrt(I)
    b13_EF = torch.randn(E, 2 * I, generator=g) * 0.5 if bias else None
    b2_EH = torch.randn(E, H, generator=g) * 0.5 if bias else None
    return tuple(None if t is None else t.to(DEVICE, dtype) for t in (w13_EFH, w2_EHI, b13_EF,
                                                                         b2_EH))


def make_routing(T, E, K, id_dtype, seed=0, skip_fraction=0.25):
    """Distinct experts per token, a quarter of the slots skipped (-1), and the
    last token skipped entirely."""
    g = torch.Generator().manual_seed(seed)
    topk_ids_TK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) \
        if T else torch.empty(0, K, dtype=torch.int64)
    topk_ids_TK[torch.rand(T, K, generator=g) < skip_fraction] = -1
    if T > 1:
        topk_ids_TK[-1] = -1
    topk_weights_TK = torch.rand(T, K, generator=g)
    return topk_weights_TK.to(DEVICE), topk_ids_TK.to(DEVICE, id_dtype)


def expected_alignment(topk_ids_TK, E, block_m):
    """sorted_row_ids and block_expert from their definition."""
    flat = topk_ids_TK.flatten().tolist()
    sentinel = len(flat)
    rows, blocks = [], []
    for e in range(E):
        group = [s for s, x in enumerate(flat) if x == e]
        padded = -(-len(group) // block_m) * block_m
        rows += group + [sentinel] * (padded - len(group))
        blocks += [e] * (padded // block_m)
    capacity = align.padded_capacity(len(flat), E, block_m)
    return (rows + [sentinel] * (capacity - len(rows)),
            blocks + [-1] * (capacity // block_m - len(blocks)), len(rows))


# T=600 and T=8400 with K=2 span several slot tiles and more than one scan chunk
# of tiles; E=40 and E=70 span several expert chunks; one program sizes its tiles to the
# call, down to one expert and up to 512 in one step.
@pytest.mark.parametrize("T,K,E,block_m", [(0, 2, 4, 16), (1, 2, 4, 16), (5, 2, 4, 16),
                                           (5, 2, 4, 32), (600, 2, 40, 16), (90, 3, 70, 64),
                                           (8400, 2, 4, 16), (3, 1, 1, 16), (2, 8, 512, 16)])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("programs", ["one", "three"])
def test_align_rows(T, K, E, block_m, id_dtype, programs, poisoned_empty, monkeypatch):
    # Whatever the size: all three steps in one program, or three launches.
    monkeypatch.setattr(align, "ONE_PROGRAM_MAX_WORK", 10**9 if programs == "one" else -1)
    _, topk_ids_TK = make_routing(T, E, K, id_dtype, seed=T + E)
    sorted_row_ids_P, block_expert_B, num_padded_rows_1, slot_row_S = align.align_rows(
        topk_ids_TK, E, block_m, slot_rows=True)
    rows, blocks, num_padded = expected_alignment(topk_ids_TK, E, block_m)
    assert sorted_row_ids_P.dtype == block_expert_B.dtype == num_padded_rows_1.dtype \
        == slot_row_S.dtype == torch.int32
    assert sorted_row_ids_P.tolist() == rows
    assert block_expert_B.tolist() == blocks
    assert num_padded_rows_1.tolist() == [num_padded]
    # The inverse: each slot's row, -1 for the slots skipped.
    expected_slot_rows = [-1] * topk_ids_TK.numel()
    for row, slot in enumerate(rows):
        if slot < len(expected_slot_rows):
            expected_slot_rows[slot] = row
    assert slot_row_S.tolist() == expected_slot_rows
    # Without the inverse, the same three outputs.
    assert [t.tolist() for t in align.align_rows(topk_ids_TK, E, block_m)] == [
        rows, blocks, [num_padded]]


@pytest.mark.parametrize("programs", ["one", "three"])
def test_align_rows_skips_ids_outside_the_experts(programs, monkeypatch):
    # E = 6: ids 6 and 7 lie inside the one program's power-of-two width of experts.
    monkeypatch.setattr(align, "ONE_PROGRAM_MAX_WORK", 10**9 if programs == "one" else -1)
    topk_ids_TK = torch.tensor([[0, 6], [7, 5], [-1, 0], [9, 5]], dtype=torch.int32,
                               device=DEVICE)
    sorted_row_ids_P, block_expert_B, num_padded_rows_1, slot_row_S = align.align_rows(
        topk_ids_TK, 6, 16, slot_rows=True)
    assert sorted_row_ids_P[:32].tolist() == [0, 5] + [8] * 14 + [3, 7] + [8] * 14
    assert block_expert_B[:3].tolist() == [0, 5, -1]
    assert num_padded_rows_1.tolist() == [32]
    assert slot_row_S.tolist() == [0, -1, -1, 16, -1, 1, -1, 17]


def test_align_rows_all_skipped():
    topk_ids_TK = torch.full((3, 2), -1, dtype=torch.int32, device=DEVICE)
    sorted_row_ids_P, block_expert_B, num_padded_rows_1 = align.align_rows(topk_ids_TK, 4, 16)
    assert (sorted_row_ids_P == 6).all() and (block_expert_B == -1).all()
    assert num_padded_rows_1.tolist() == [0]


@pytest.mark.parametrize("ids,num_experts,block_m,match", [
    (torch.zeros(4, dtype=torch.int32), 4, 16, "2-D"),
    (torch.zeros(4, 2), 4, 16, "int32 or int64"),
    (torch.zeros(4, 2, dtype=torch.int32), 0, 16, "num_experts"),
    (torch.zeros(4, 2, dtype=torch.int32), 4, 24, "power of two"),
    (torch.zeros(4, 2, dtype=torch.int32), 4, 8, "power of two"),
])
def test_align_rows_rejects_bad_input(ids, num_experts, block_m, match):
    with pytest.raises(ValueError, match=match):
        align.align_rows(ids.to(DEVICE), num_experts, block_m)


def run_and_compare(T, E, K, H, I, dtype, name, bias, id_dtype, seed=0):
    w13_EFH, w2_EHI, b13_EF, b2_EH = make_experts(E, H, I, dtype, bias, seed)
    topk_weights_TK, topk_ids_TK = make_routing(T, E, K, id_dtype, seed)
    hidden_TH = torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)
    out_TH = fused.fused_experts(hidden_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI,
                                 b13_EF, b2_EH, name, SWIGLU_ALPHA, SWIGLU_LIMIT)
    assert out_TH.shape == (T, H) and out_TH.dtype == dtype and out_TH.is_contiguous()
    expected_TH = formula(hidden_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI, b13_EF,
                          b2_EH, name)
    torch.testing.assert_close(out_TH.double().cpu(), expected_TH, **TOLERANCE[dtype])
    if T > 1:
        # The last token's slots are all skipped: exact zeros, not a small number.
        assert (out_TH[-1] == 0).all()


@pytest.mark.parametrize("T", [0, 1, 5])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("name", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_fused_experts(T, bias, name, dtype, poisoned_empty, kernel_path):
    run_and_compare(T, E=4, K=2, H=32, I=16, dtype=dtype, name=name, bias=bias,
                    id_dtype=torch.int32)


@pytest.mark.parametrize("K", [1, 3])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_fused_experts_top_k_and_id_dtype(K, id_dtype, poisoned_empty, kernel_path):
    # H and I off the tile size leave partial tiles in both GEMMs.
    run_and_compare(7, E=4, K=K, H=40, I=24, dtype=torch.float32, name="swiglu_oai", bias=True,
                    id_dtype=id_dtype, seed=K)


@pytest.mark.parametrize("K", [1, 3])
def test_direct_kernels_in_k_parts(K, poisoned_empty, monkeypatch):
    """SPLIT_K cuts both GEMMs' K into parts of whole tiles, the last one shorter (H=40:
    16 + 16 + 8, I=24: 16 + 8): the parts' sums make the same output, each bias added once."""
    config = configs.KernelConfig(BLOCK_M=16, BLOCK_N=8, BLOCK_K=16, GROUP_M=1, num_warps=1,
                                  num_stages=1, path="direct", SPLIT_K=3)
    assert fused._k_parts(40, config) == (16, 3) and fused._k_parts(24, config) == (16, 2)
    monkeypatch.setattr(fused, "get_config", lambda *key: config)
    run_and_compare(7, E=4, K=K, H=40, I=24, dtype=torch.float32, name="swiglu_oai", bias=True,
                    id_dtype=torch.int32, seed=K)


def test_fused_experts_strided_hidden_and_fp16_weights(poisoned_empty, kernel_path):
    w13_EFH, w2_EHI, b13_EF, b2_EH = make_experts(4, 32, 16, torch.float32, bias=True)
    topk_weights_TK, topk_ids_TK = make_routing(5, 4, 2, torch.int64)
    hidden_TH = torch.randn(5, 64, device=DEVICE)[:, ::2]
    out_TH = fused.fused_experts(hidden_TH, topk_weights_TK.half(), topk_ids_TK, w13_EFH,
                                 w2_EHI, b13_EF, b2_EH, "silu", SWIGLU_ALPHA, SWIGLU_LIMIT)
    expected_TH = formula(hidden_TH, topk_weights_TK.half(), topk_ids_TK, w13_EFH, w2_EHI,
                          b13_EF, b2_EH, "silu")
    torch.testing.assert_close(out_TH.double().cpu(), expected_TH, **TOLERANCE[torch.float32])


def test_fused_experts_is_deterministic(kernel_path):
    w13_EFH, w2_EHI, b13_EF, b2_EH = make_experts(4, 32, 16, torch.float16, bias=True)
    topk_weights_TK, topk_ids_TK = make_routing(5, 4, 2, torch.int32)
    hidden_TH = torch.randn(5, 32, device=DEVICE, dtype=torch.float16)
    args = (hidden_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI, b13_EF, b2_EH, "gelu",
            SWIGLU_ALPHA, SWIGLU_LIMIT)
    assert torch.equal(fused.fused_experts(*args), fused.fused_experts(*args))


def test_no_tokens_launches_nothing(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("align_rows ran for 0 tokens")

    monkeypatch.setattr(fused, "align_rows", fail)
    w13_EFH, w2_EHI, _, _ = make_experts(4, 32, 16, torch.float32, bias=False)
    out_TH = fused.fused_experts(torch.empty(0, 32, device=DEVICE),
                                 torch.empty(0, 2, device=DEVICE),
                                 torch.empty(0, 2, dtype=torch.int32, device=DEVICE), w13_EFH,
                                 w2_EHI, None, None, "silu", SWIGLU_ALPHA, SWIGLU_LIMIT)
    assert out_TH.shape == (0, 32)


def test_bad_activation_is_rejected():
    w13_EFH, w2_EHI, _, _ = make_experts(4, 32, 16, torch.float32, bias=False)
    topk_weights_TK, topk_ids_TK = make_routing(2, 4, 2, torch.int32)
    with pytest.raises(ValueError, match="activation"):
        fused.fused_experts(torch.randn(2, 32, device=DEVICE), topk_weights_TK, topk_ids_TK,
                            w13_EFH, w2_EHI, None, None, "relu", SWIGLU_ALPHA, SWIGLU_LIMIT)


def rows_case(counts, num_skipped, dtype, name, bias, H=32, I=16, seed=0):
    """Rows grouped by expert (counts[e] rows of expert e), then skipped rows."""
    E = len(counts)
    w13_EFH, w2_EHI, b13_EF, b2_EH = make_experts(E, H, I, dtype, bias, seed)
    expert_R = torch.tensor([e for e, c in enumerate(counts) for _ in range(c)]
                            + [-1] * num_skipped, dtype=torch.int32, device=DEVICE)
    count_E = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
    x_RH = torch.randn(expert_R.numel(), H, generator=torch.Generator().manual_seed(seed))
    x_RH = x_RH.to(DEVICE, dtype)
    y_RH = fused.fused_experts_rows(x_RH, expert_R, count_E, w13_EFH, w2_EHI, b13_EF, b2_EH,
                                    name, SWIGLU_ALPHA, SWIGLU_LIMIT)
    ones_R1 = torch.ones(expert_R.numel(), 1, device=DEVICE)
    expected_RH = formula(x_RH, ones_R1, expert_R.unsqueeze(1), w13_EFH, w2_EHI, b13_EF, b2_EH,
                          name)
    return y_RH, expected_RH, expert_R


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("name", ["silu", "swiglu_oai"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_fused_experts_rows(bias, name, dtype, poisoned_empty, kernel_path):
    # Expert 1 gets no row; expert 2 gets more than one block.
    y_RH, expected_RH, expert_R = rows_case([3, 0, 18, 1], 6, dtype, name, bias)
    assert y_RH.shape == expected_RH.shape and y_RH.dtype == dtype
    torch.testing.assert_close(y_RH.double().cpu(), expected_RH, **TOLERANCE[dtype])
    assert (y_RH[expert_R < 0] == 0).all()


def test_fused_experts_rows_all_skipped(poisoned_empty, kernel_path):
    y_RH, _, _ = rows_case([0, 0], 5, torch.float32, "silu", bias=True)
    assert (y_RH == 0).all()


def test_config_lookup(tmp_path):
    entries_file = tmp_path / configs.config_file_name(8, 64, 128, torch.bfloat16, "X")
    assert entries_file.name == "E=8,N=64,K=128,dtype=bfloat16,device=X.json"
    entries_file.write_text(json.dumps({"64": dict(TILES, BLOCK_M=64), "1": TILES}))
    entries = configs.load_config_file(entries_file)
    assert [m for m, _ in entries] == [1, 64]
    assert configs.pick_entry(entries, 1).BLOCK_M == 16
    assert configs.pick_entry(entries, 63).BLOCK_M == 16
    assert configs.pick_entry(entries, 1000).BLOCK_M == 64
    assert configs.load_config_file(tmp_path / "missing.json") is None
    entries_file.write_text(json.dumps({"1": dict(TILES, BLOCK_N=48)}))
    with pytest.raises(ValueError, match="BLOCK_N"):
        configs.load_config_file(entries_file)


def test_tuned_entries_leave_defaults_out():
    config = configs.KernelConfig(**TILES, path="direct")
    assert "SPLIT_K" not in tune.file_entry(config)
    split = dataclasses.replace(config, SPLIT_K=4)
    assert tune.file_entry(split)["SPLIT_K"] == 4
    assert configs.KernelConfig(**tune.file_entry(split)) == split


def test_config_defaults_and_shipped_files():
    config = configs.get_config(3, 5, 7, torch.float16, 1, 2, "no-such-device")
    assert config == configs.default_config(3, 5, 7, torch.float16, 1, 2, "no-such-device")
    assert configs.get_config(3, 5, 7, torch.float16, 1, 2, "cpu").BLOCK_M == 16
    shipped = sorted(configs.CONFIG_DIR.glob("*.json"))
    assert shipped, "the package ships no tuned config"
    for path in shipped:
        assert configs.load_config_file(path)


@pytest.mark.parametrize("field,value", [("BLOCK_M", 8), ("BLOCK_K", 48), ("num_warps", 0),
                                         ("path", "fused"), ("BLOCK_N", 8), ("SPLIT_K", 0),
                                         ("SPLIT_K", 2)])
def test_kernel_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        configs.KernelConfig(**dict(TILES, **{field: value}))


def test_direct_config_takes_narrow_tiles():
    # tl.sum, unlike tl.dot, takes any power of two; BLOCK_M stays a tl.dot size.
    config = configs.KernelConfig(BLOCK_M=16, BLOCK_N=4, BLOCK_K=8, GROUP_M=1, num_warps=1,
                                  num_stages=1, path="direct")
    assert config.BLOCK_N == 4
    with pytest.raises(ValueError, match="BLOCK_M"):
        dataclasses.replace(config, BLOCK_M=4)


@pytest.mark.parametrize("E,M,top_k,path", [
    (8, 1, 2, "direct"),        # one token: its slots never share an expert
    (128, 4, 8, "direct"),      # 32 slots over 128 experts
    (128, 5, 8, "tiled"),
    (8, 512, 2, "grouped_mm"),  # 128 slots per expert
    (8, 511, 2, "tiled"),
])
def test_default_path(E, M, top_k, path):
    assert configs.default_path(E, M, top_k) == path


def test_file_entry_without_path_gets_the_default(tmp_path, monkeypatch):
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    configs._tuned_entries.cache_clear()
    configs.get_config.cache_clear()
    (tmp_path / configs.config_file_name(8, 64, 128, torch.float16, "X")).write_text(
        json.dumps({"1": TILES, "64": dict(TILES, path="direct")}))
    try:
        assert configs.get_config(8, 64, 128, torch.float16, 1, 2, "X").path == "direct"
        assert configs.get_config(8, 64, 128, torch.float16, 63, 2, "X").path == "tiled"
        assert configs.get_config(8, 64, 128, torch.float16, 600, 2, "X").path == "direct"
    finally:
        configs._tuned_entries.cache_clear()
        configs.get_config.cache_clear()


def test_grouped_mm_config_falls_back_to_tiled_where_it_cannot_run(monkeypatch):
    # grouped_mm needs bf16 on sm90+: fp32 here takes the tiled kernels, same tiles.
    grouped = dataclasses.replace(configs.default_config(4, 16, 32, torch.float32, 5, 2, "cpu"),
                                  path="grouped_mm")
    monkeypatch.setattr(fused, "get_config", lambda *key: grouped)
    hidden_TH = torch.randn(5, 32, device=DEVICE)
    _, topk_ids_TK = make_routing(5, 4, 2, torch.int32)
    plan = fused._plan(hidden_TH, topk_ids_TK, torch.empty(4, 32, 32, device=DEVICE))
    assert plan == dataclasses.replace(grouped, path="tiled")


@gpu
@pytest.mark.parametrize("T", [1, 7, 333, 2048])
@pytest.mark.parametrize("name", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_experts_gpu(T, name, dtype, kernel_path):
    # H and I off every tile size; E=64, K=8 sends several blocks to some experts.
    run_and_compare(T, E=64, K=8, H=576, I=320, dtype=dtype, name=name, bias=name != "silu",
                    id_dtype=torch.int32 if T % 2 else torch.int64, seed=T)


@gpu
@pytest.mark.parametrize("T", [1, 5])
def test_direct_kernels_in_k_parts_gpu(T, monkeypatch):
    config = configs.KernelConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, GROUP_M=1, num_warps=4,
                                  num_stages=3, path="direct", SPLIT_K=4)
    monkeypatch.setattr(fused, "get_config", lambda *key: config)
    run_and_compare(T, E=64, K=8, H=576, I=320, dtype=torch.bfloat16, name="swiglu_oai",
                    bias=True, id_dtype=torch.int32, seed=T)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_experts_rows_gpu(dtype, kernel_path):
    y_RH, expected_RH, expert_R = rows_case([70, 0, 3, 200, 1], 50, dtype, "swiglu_oai",
                                            bias=True, H=256, I=192)
    torch.testing.assert_close(y_RH.double().cpu(), expected_RH, **TOLERANCE[dtype])
    assert (y_RH[expert_R < 0] == 0).all()


@gpu
def test_fused_experts_cuda_graph(kernel_path):
    w13_EFH, w2_EHI, b13_EF, b2_EH = make_experts(16, 256, 128, torch.bfloat16, bias=True)
    topk_weights_TK, topk_ids_TK = make_routing(64, 16, 4, torch.int32, seed=1)
    hidden_TH = torch.randn(64, 256, device=DEVICE, dtype=torch.bfloat16)
    args = (hidden_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI, b13_EF, b2_EH,
            "swiglu_oai", SWIGLU_ALPHA, SWIGLU_LIMIT)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused.fused_experts(*args)  # compiles the kernels and caches the config
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_TH = fused.fused_experts(*args)
    new_weights_TK, new_ids_TK = make_routing(64, 16, 4, torch.int32, seed=2)
    topk_weights_TK.copy_(new_weights_TK)
    topk_ids_TK.copy_(new_ids_TK)
    hidden_TH.normal_()
    graph.replay()
    torch.testing.assert_close(out_TH, fused.fused_experts(*args), atol=0, rtol=0)
    torch.testing.assert_close(out_TH.double().cpu(),
                               formula(*args[:7], "swiglu_oai"), **TOLERANCE[torch.bfloat16])


def test_tuning_without_cuda_says_it_needs_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("sys.argv", ["tune", "--experts", "8", "--inter", "32", "--hidden",
                                     "64", "--top-k", "2"])
    with pytest.raises(SystemExit) as exit_:
        tune.main()
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "python -m torch_moe_ops.tune: error: needs a CUDA GPU: it times the Triton kernels on "
        "the GPU at hand and writes their configs for it (this torch sees no CUDA device); run "
        "it on the machine that will run the model")


def test_host_sizes_match_tritons():
    """The host's ``cdiv`` and ``next_power_of_2`` (launch grids and tiles without the
    cost of calling Triton's constexpr functions) give Triton's results."""
    for n in (*range(300), 4095, 4096, 4097, 2**20 + 1):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 128):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
