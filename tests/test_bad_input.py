"""Bad input gets a ValueError whose whole message names the argument, what was
got and what was expected.

Legend: T tokens, H hidden size, I expert intermediate size, E experts,
K experts per token, F = 2*I, R rows.
"""

from __future__ import annotations

import re

import pytest
import torch

import torch_moe_ops as tmo
from torch_moe_ops.backends.registry import REGISTRY, ExpertsBackend
from torch_moe_ops.config import BackendSpec
from torch_moe_ops.lowering import lower

T, H, I, E, K = 3, 8, 4, 4, 2
STATIC = ("silu", 1.702, 7.0)
ROUTE_STATIC = (2, "softmax", False, 1, 1, 1.0)  # top_k .. routed_scaling_factor


def exactly(message: str) -> str:
    """A `pytest.raises` pattern that matches ``message`` and nothing more."""
    return f"^{re.escape(message)}$"


def expert_args(**replace) -> tuple:
    """Valid ``moe::experts`` arguments with the named ones replaced."""
    generator = torch.Generator().manual_seed(0)
    args = {
        "hidden": torch.randn((T, H), generator=generator),
        "topk_weights": torch.rand((T, K), generator=generator),
        "topk_ids": torch.tensor([[0, 1], [2, 3], [1, -1]], dtype=torch.int32),
        "w13": torch.randn((E, 2 * I, H), generator=generator),
        "w2": torch.randn((E, H, I), generator=generator),
        "b13": None,
        "b2": None,
    }
    args.update(replace)
    return (*args.values(), *STATIC)


def config(**replace) -> tmo.MoEConfig:
    fields = {"hidden_size": H, "intermediate_size": I, "num_experts": 8, "top_k": 2}
    fields.update(replace)
    return tmo.MoEConfig(**fields)


def logits(num_experts=8):
    return torch.randn((T, num_experts), generator=torch.Generator().manual_seed(0))


# T = 3 tokens, K = 2: each slot's row in 2 rows.
COMBINE_MAP_3x2 = torch.tensor([[0, -1], [1, -1], [-1, -1]], dtype=torch.int32)


class ConcreteOps:
    """``ops.<name>`` is the concrete op that runs ``moe::<name>`` by default on the CPU:
    the reference backend's for routing and experts, the local one's for dispatch/combine."""

    def __getattr__(self, name: str):
        registry_entry = (REGISTRY.a2a["none"] if name in ("dispatch", "combine")
                          else REGISTRY.experts["reference"])
        return getattr(getattr(torch.ops, registry_entry.namespace), name)


OPS = {"generic": torch.ops.moe, "concrete": ConcreteOps()}


def route(*args):
    return lambda ops: ops.route(*args)


def experts(**replace):
    return lambda ops: ops.experts(*expert_args(**replace))


CONFIG_CASES = {
    "negative_hidden_size": (lambda: config(hidden_size=-1),
                             "hidden_size must be a positive int, got -1"),
    "zero_intermediate_size": (lambda: config(intermediate_size=0),
                               "intermediate_size must be a positive int, got 0"),
    "float_num_experts": (lambda: config(num_experts=8.0),
                          "num_experts must be a positive int, got 8.0"),
    "zero_top_k": (lambda: config(top_k=0), "top_k must be a positive int, got 0"),
    "top_k_above_num_experts": (lambda: config(top_k=9),
                                "top_k must be <= num_experts (8), got 9"),
    "groups_do_not_divide_experts": (
        lambda: config(num_expert_groups=3),
        "num_expert_groups must be a divisor of num_experts (8), got 3"),
    "topk_groups_above_groups": (lambda: config(num_expert_groups=2, topk_groups=3),
                                 "topk_groups must be <= num_expert_groups (2), got 3"),
    "groups_of_one_expert": (
        lambda: config(num_expert_groups=8),
        ("num_expert_groups must be small enough that each group holds at least 2 experts "
         "(num_experts=8), got 8")),
    "top_k_above_kept_group_experts": (
        lambda: config(top_k=5, num_expert_groups=4, topk_groups=2),
        "top_k must be <= topk_groups * experts per group (4), got 5"),
    "unknown_scoring": (lambda: config(scoring="relu"),
                        ("scoring must be one of 'softmax', 'topk_softmax', 'sigmoid', "
                         "got 'relu'")),
    "unknown_activation": (lambda: config(activation="tanh"),
                           ("activation must be one of 'silu', 'gelu', 'swiglu_oai', "
                            "got 'tanh'")),
    "correction_bias_with_softmax": (
        lambda: config(correction_bias=True),
        "correction_bias must be False unless scoring='sigmoid', got True"),
    "negative_scaling_factor": (lambda: config(routed_scaling_factor=-1.0),
                                "routed_scaling_factor must be a positive float, got -1.0"),
    "renormalize_not_bool": (lambda: config(renormalize=1),
                             "renormalize must be a bool, got 1"),
    "shared_gate_without_shared_expert": (
        lambda: config(shared_expert_gate=True),
        ("shared_expert_gate must be False when there is no shared expert "
         "(shared_expert_intermediate_size=0), got True")),
    "ep_size_does_not_divide_experts": (lambda: config(ep_size=3),
                                        "ep_size must be a divisor of num_experts (8), got 3"),
    "module_ep_without_group": (
        lambda: tmo.MoE(config(ep_size=2, max_tokens_per_rank=4)),
        ("ep_group must be the expert-parallel ProcessGroup or 1-D DeviceMesh when ep_size > 1, "
        "got None (ep_size=2)")),
    "ep_without_max_tokens": (
        lambda: config(ep_size=2),
        ("max_tokens_per_rank must be a positive int when ep_size > 1 (got ep_size=2): the "
        "largest token count one rank sends, which sizes the static buffers, got None")),
    "max_tokens_without_ep": (lambda: config(max_tokens_per_rank=4),
                              "max_tokens_per_rank must be None when ep_size == 1, got 4"),
    "ep_capacity_above_worst_case": (
        lambda: config(ep_size=2, max_tokens_per_rank=4, ep_capacity=100),
        ("ep_capacity must be <= the worst case max_tokens_per_rank * top_k (8), or None "
         "for it, got 100")),
    "module_input_H_mismatch": (lambda: tmo.MoE(config())(torch.randn(2, 3, H + 1)),
                                "x.shape[-1] must equal hidden_size (8), got shape (2, 3, 9)"),
    "module_input_dtype_mismatch": (
        lambda: tmo.MoE(config())(torch.randn(2, 3, H, dtype=torch.bfloat16)),
        ("x must have the module's dtype (torch.float32), got torch.bfloat16: cast the module "
         "(moe.to(torch.bfloat16)) or the input (x.to(torch.float32))")),
    # A module cast to an integer dtype could not compute: only the input's cast is offered.
    "module_input_integer_dtype": (
        lambda: tmo.MoE(config())(torch.ones(5, H, dtype=torch.long)),
        ("x must have the module's dtype (torch.float32), got torch.int64: cast the input "
         "(x.to(torch.float32))")),
    # Said at the user's call, naming x and the module (not the op's w13, from deep inside).
    "module_input_on_meta": (
        lambda: tmo.MoE(config())(torch.randn(5, H, device="meta")),
        "x must be on the module's device (cpu), got meta: move the input (x.to('cpu'))"),
    "module_on_meta": (
        lambda: tmo.MoE(config(), device="meta")(torch.randn(5, H)),
        ("x must be on the module's device (meta), got cpu: the module holds no weights (built "
         "on the meta device): give it memory (moe.to_empty(device=...)), then load its "
         "weights")),
}

BACKEND_CASES = {
    "spec_unknown_experts": (lambda: BackendSpec(experts="nope"),
                             ("experts must be one of 'auto', 'reference', 'cpu', 'triton', "
                              "'grouped_mm', 'flashinfer', 'deepgemm', got 'nope'")),
    "backend_unknown_experts": (lambda: tmo.backend(experts="nope"),
                                ("experts must be one of 'auto', 'reference', 'cpu', 'triton', "
                                 "'grouped_mm', 'flashinfer', 'deepgemm', got 'nope'")),
    "backend_unknown_a2a": (lambda: tmo.backend(a2a="nccl"),
                            ("a2a must be one of 'none', 'allgather', 'all_to_all', 'deepep', "
                             "'flashinfer', got 'nccl'")),
    "spec_dispatch_dtype": (lambda: BackendSpec(dispatch_dtype=torch.int8), (
        "dispatch_dtype must be one of None, torch.bfloat16, torch.float16, torch.float32, "
        "torch.float8_e4m3fn, got torch.int8")),
    "unknown_inner_compiler": (lambda: tmo.backend(inner="tvm"),
                               ("inner must be one of 'inductor', 'eager', 'aot_eager', "
                                "got 'tvm'")),
    "mode_with_eager_inner": (lambda: tmo.backend(inner="eager", mode="reduce-overhead"),
                              ("mode and options apply to inner='inductor' only, got "
                               "inner='eager' with mode='reduce-overhead', options=None")),
}

OP_CASES = {
    "hidden_3d": (experts(hidden=torch.randn(1, T, H)),
                  "hidden must be 2-D, got shape (1, 3, 8)"),
    "w13_2d": (experts(w13=torch.randn(2 * I, H)), "w13 must be 3-D, got shape (8, 8)"),
    # 1-D tensors: the generic op reads sizes to choose a backend before the
    # concrete op's checks run; the op's own error must come first.
    "hidden_1d": (experts(hidden=torch.randn(H)), "hidden must be 2-D, got shape (8,)"),
    "ids_1d": (experts(topk_ids=torch.zeros(T, dtype=torch.int32)),
               "topk_ids must be 2-D, got shape (3,)"),
    "w13_1d": (experts(w13=torch.randn(H)), "w13 must be 3-D, got shape (8,)"),
    "hidden_int": (experts(hidden=torch.zeros(T, H, dtype=torch.int32)),
                   "hidden must have dtype in (float32, float16, bfloat16, float64), got int32"),
    "float_ids": (experts(topk_ids=torch.zeros(T, K)),
                  "topk_ids must have dtype in (int32, int64), got float32"),
    "weights_dtype_mismatch": (experts(w13=torch.randn(E, 2 * I, H, dtype=torch.bfloat16)),
                               "w13 must have hidden's dtype (float32), got bfloat16"),
    "weights_on_meta": (experts(w13=torch.empty(E, 2 * I, H, device="meta"),
                                w2=torch.empty(E, H, I, device="meta")),
                        "w13 must be on hidden's device (cpu), got meta"),
    "routing_on_meta": (experts(hidden=torch.empty(T, H, device="meta")),
                        "topk_weights must be on hidden's device (meta), got cpu"),
    "H_mismatch_w13": (experts(w13=torch.randn(E, 2 * I, H + 1)),
                       "w13.shape[2] must equal hidden.shape[1] (H) (8), got shape (4, 8, 9)"),
    "H_mismatch_w2": (experts(w2=torch.randn(E, H + 1, I)),
                      "w2.shape[1] must equal hidden.shape[1] (H) (8), got shape (4, 9, 4)"),
    "I_mismatch_w2": (experts(w2=torch.randn(E, H, I + 1)),
                      "w2.shape[2] must equal w13.shape[1] // 2 (I) (4), got shape (4, 8, 5)"),
    "E_mismatch_w2": (experts(w2=torch.randn(E + 1, H, I)),
                      "w2.shape[0] must equal w13.shape[0] (E) (4), got shape (5, 8, 4)"),
    "odd_w13_rows": (experts(w13=torch.randn(E, 2 * I + 1, H)),
                     ("w13.shape[1] must be even (gate rows then up rows, 2*I), got shape "
                      "(4, 9, 8)")),
    "b13_shape": (experts(b13=torch.randn(E, I)),
                  "b13.shape[1] must equal w13.shape[1] (2*I) (8), got shape (4, 4)"),
    "weights_ids_shape_mismatch": (
        experts(topk_weights=torch.rand(T, K + 1)),
        "topk_weights and topk_ids must have the same shape [T, K], got (3, 3) and (3, 2)"),
    "ids_T_mismatch": (experts(topk_weights=torch.rand(T + 1, K),
                               topk_ids=torch.zeros(T + 1, K, dtype=torch.int32)),
                       "topk_ids.shape[0] must equal hidden.shape[0] (T) (3), got shape (4, 2)"),
    "ids_at_num_experts": (experts(topk_ids=torch.tensor([[0, 1], [2, 4], [1, -1]])),
                           "topk_ids must hold -1 (skip) or expert ids in [0, 4), got 4"),
    "ids_below_minus_one": (experts(topk_ids=torch.tensor([[0, 1], [2, -2], [1, -1]])),
                            "topk_ids must hold -1 (skip) or expert ids in [0, 4), got -2"),
    "unknown_activation": (
        lambda ops: ops.experts(*expert_args()[:7], "relu", 1.702, 7.0),
        "activation must be one of 'silu', 'gelu', 'swiglu_oai', got 'relu'"),
    "zero_swiglu_limit": (
        lambda ops: ops.experts(*expert_args()[:7], "swiglu_oai", 1.702, 0.0),
        "swiglu_limit must be > 0, got 0.0"),
    "route_top_k_above_num_experts": (
        route(logits(), None, 9, "softmax", False, 1, 1, 1.0),
        "top_k must be in [1, num_experts (8)], got 9"),
    "route_top_k_zero": (route(logits(), None, 0, "softmax", False, 1, 1, 1.0),
                         "top_k must be in [1, num_experts (8)], got 0"),
    "route_logits_1d": (route(torch.randn(8), None, *ROUTE_STATIC),
                        "router_logits must be 2-D, got shape (8,)"),
    "route_int_logits": (route(torch.zeros(T, 8, dtype=torch.int64), None, *ROUTE_STATIC),
                         ("router_logits must have dtype in (float32, float16, bfloat16, float64), "
                          "got int64")),
    "route_unknown_scoring": (route(logits(), None, 2, "relu", False, 1, 1, 1.0),
                              ("scoring must be one of 'softmax', 'topk_softmax', 'sigmoid', "
                               "got 'relu'")),
    "route_correction_bias_with_softmax": (
        route(logits(), torch.zeros(8), *ROUTE_STATIC),
        ("correction_bias must be None unless scoring='sigmoid', got a tensor with "
         "scoring='softmax'")),
    "route_correction_bias_bf16": (
        route(logits(), torch.zeros(8, dtype=torch.bfloat16), 2, "sigmoid", False, 1, 1, 1.0),
        "correction_bias must have dtype in (float32), got bfloat16"),
    "route_correction_bias_size": (
        route(logits(), torch.zeros(7), 2, "sigmoid", False, 1, 1, 1.0),
        "correction_bias.shape[0] must equal router_logits.shape[1] (8), got shape (7,)"),
    "route_correction_bias_on_meta": (
        route(logits(), torch.zeros(8, device="meta"), 2, "sigmoid", False, 1, 1, 1.0),
        "correction_bias must be on router_logits's device (cpu), got meta"),
    "route_groups_do_not_divide": (
        route(logits(), None, 2, "softmax", False, 3, 1, 1.0),
        "num_expert_groups must be a positive divisor of num_experts (8), got 3"),
    "route_topk_groups_above_groups": (
        route(logits(), None, 2, "softmax", False, 2, 3, 1.0),
        "topk_groups must be in [1, num_expert_groups (2)], got 3"),
    "route_groups_of_one_expert": (
        route(logits(), None, 2, "softmax", False, 8, 2, 1.0),
        "num_expert_groups must leave at least 2 experts per group (num_experts=8), got 8"),
    "route_zero_scaling_factor": (route(logits(), None, 2, "softmax", False, 1, 1, 0.0),
                                  "routed_scaling_factor must be > 0, got 0.0"),
    "dispatch_ids_at_num_experts": (
        lambda ops: ops.dispatch(*expert_args()[:3], 3),
        "topk_ids must hold -1 (skip) or expert ids in [0, 3), got 3"),
    "dispatch_zero_experts": (lambda ops: ops.dispatch(*expert_args()[:3], 0),
                              "num_experts must be > 0, got 0"),
    "dispatch_hidden_1d": (lambda ops: ops.dispatch(*expert_args(hidden=torch.randn(H))[:3], 4),
                           "hidden must be 2-D, got shape (8,)"),
    "dispatch_ids_1d": (
        lambda ops: ops.dispatch(*expert_args(topk_ids=torch.zeros(T, dtype=torch.int32))[:3],
                                 4),
        "topk_ids must be 2-D, got shape (3,)"),
    "experts_rows_x_1d": (
        lambda ops: ops.experts_rows(
            torch.randn(H), torch.tensor([0, 1], dtype=torch.int32),
            torch.zeros(E, dtype=torch.int32), *expert_args()[3:]),
        "x_rows must be 2-D, got shape (8,)"),
    "combine_map_1d": (
        lambda ops: ops.combine(torch.randn(2, H), torch.ones(2),
                                torch.tensor([0, 1], dtype=torch.int32),
                                torch.tensor([0, 1, -1], dtype=torch.int32)),
        "combine_map must be 2-D, got shape (3,)"),
    "experts_rows_expert_at_num_experts": (
        lambda ops: ops.experts_rows(
            torch.randn(2, H), torch.tensor([0, 4], dtype=torch.int32),
            torch.zeros(E, dtype=torch.int32), *expert_args()[3:]),
        "expert_rows must hold -1 (skip) or expert ids in [0, 4), got 4"),
    "experts_rows_int64_experts": (
        lambda ops: ops.experts_rows(
            torch.randn(2, H), torch.tensor([0, 1]), torch.zeros(E, dtype=torch.int32),
            *expert_args()[3:]),
        "expert_rows must have dtype in (int32), got int64"),
    "experts_rows_count_size": (
        lambda ops: ops.experts_rows(
            torch.randn(2, H), torch.tensor([0, 1], dtype=torch.int32),
            torch.zeros(E + 1, dtype=torch.int32), *expert_args()[3:]),
        "count_experts.shape[0] must equal w13.shape[0] (E) (4), got shape (5,)"),
    "combine_src_past_slots": (
        lambda ops: ops.combine(torch.randn(2, H), torch.ones(2),
                                torch.tensor([0, 6], dtype=torch.int32), COMBINE_MAP_3x2),
        "src_rows must hold -1 (skip) or slot indices in [0, 6), got 6"),
    "combine_map_past_rows": (
        lambda ops: ops.combine(torch.randn(2, H), torch.ones(2),
                                torch.tensor([0, 1], dtype=torch.int32),
                                torch.tensor([[0, 1], [2, -1], [-1, -1]], dtype=torch.int32)),
        "combine_map must hold -1 (skip) or row indices in [0, 2), got 2"),
    "combine_bf16_weights": (
        lambda ops: ops.combine(torch.randn(2, H), torch.ones(2, dtype=torch.bfloat16),
                                torch.tensor([0, 1], dtype=torch.int32), COMBINE_MAP_3x2),
        "weight_rows must have dtype in (float32), got bfloat16"),
    "backward_grad_out_shape": (
        lambda ops: ops.experts_backward(torch.randn(T + 1, H), *expert_args()),
        "grad_out must have hidden's shape (3, 8), got (4, 8)"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_bad_config(case):
    build, message = CONFIG_CASES[case]
    with pytest.raises(ValueError, match=exactly(message)):
        build()


@pytest.mark.parametrize("case", sorted(BACKEND_CASES))
def test_bad_backend_spec(case):
    build, message = BACKEND_CASES[case]
    with pytest.raises(ValueError, match=exactly(message)):
        build()


@pytest.mark.parametrize("ops", sorted(OPS))
@pytest.mark.parametrize("case", sorted(OP_CASES))
def test_bad_op_input(case, ops):
    # The backends' concrete ops keep the generic op's checks.
    call, message = OP_CASES[case]
    with pytest.raises(ValueError, match=exactly(message)):
        call(OPS[ops])


def _dispatch(namespace: str, *ep_args):
    return lambda: getattr(torch.ops, namespace).dispatch(*expert_args()[:3], 4, *ep_args)


# Expert-parallel arguments, through the generic op and each expert-parallel
# backend's own (one process: no group exists).
EP_NAMESPACES = ("moe", "moe_all_to_all", "moe_allgather")
EP_OP_CASES = {  # name: (ep_size, group_name, max_tokens_per_rank, capacity), message
    "without_group": ((2, "", 8, 4), ("group_name must name the expert-parallel process "
                                     "group when ep_size > 1, got '' with ep_size=2")),
    "tokens_above_max": ((2, "ep", 2, 4), (
        "hidden.shape[0] (tokens on this rank) must be <= max_tokens_per_rank (2), got 3: "
        "build the layer with a larger max_tokens_per_rank or split the batch")),
    "capacity_above_worst": ((2, "ep", 4, 9), (
        "capacity must be in [1, 8] (rows one rank sends another; 8 is the worst case) "
        "when ep_size > 1, got 9")),
    "ep_size_not_dividing_experts": ((3, "ep", 4, 4),
                                     "num_experts must be divisible by ep_size (3), got 4"),
    "without_process_group": ((2, "ep", 4, 4), (
        "group_name must name a live process group, got 'ep' (torch.distributed is not "
        "initialised: call dist.init_process_group first)")),
}


@pytest.mark.parametrize("namespace", EP_NAMESPACES)
@pytest.mark.parametrize("case", sorted(EP_OP_CASES))
def test_bad_expert_parallel_arguments(case, namespace):
    ep_args, message = EP_OP_CASES[case]
    with pytest.raises(ValueError, match=exactly(message)):
        _dispatch(namespace, *ep_args)()


def test_bad_input_is_rejected_by_fake_kernels_too():
    # Under FakeTensorMode (what torch.compile traces with) the shape checks still run.
    with torch._subclasses.FakeTensorMode():
        args = expert_args(w2=torch.randn(E, H, I + 1))
        with pytest.raises(ValueError, match=exactly(
                "w2.shape[2] must equal w13.shape[1] // 2 (I) (4), got shape (4, 8, 5)")):
            torch.ops.moe.experts(*args)


def test_route_top_k_above_kept_group_experts():
    # 4 groups of 2 experts, 2 groups kept: only 4 experts are eligible for top_k=5.
    with pytest.raises(ValueError, match=exactly(
            "top_k must be <= topk_groups * experts per group (4), got 5")):
        torch.ops.moe.route(logits(), None, 5, "softmax", False, 4, 2, 1.0)


# Backends chosen at compile time.


def tiny_moe() -> tmo.MoE:
    torch.manual_seed(0)
    return tmo.MoE(config(num_experts=E))


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def dynamo_graph(fresh_dynamo) -> torch.fx.GraphModule:
    """The FX graph Dynamo captures of a tiny MoE (before any lowering)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(tiny_moe(), backend=capture, fullgraph=True)(torch.randn(T, H))
    assert len(graphs) == 1
    return graphs[0]


UNAVAILABLE_REASON = "needs the test's imaginary accelerator"


@pytest.fixture
def unavailable_experts_backend(monkeypatch) -> str:
    """A registered experts backend whose `supports` always gives a reason; only it
    and the reference backend are registered while the test runs."""
    stub = ExpertsBackend(name="flashinfer", namespace=REGISTRY.experts["reference"].namespace,
                          supports=lambda *args: UNAVAILABLE_REASON,
                          priority=100, description="a stub that never runs")
    monkeypatch.setattr(REGISTRY, "experts",
                        {"reference": REGISTRY.experts["reference"], stub.name: stub})
    return stub.name


UNAVAILABLE_MESSAGE = (f"experts backend 'flashinfer' is not available: {UNAVAILABLE_REASON}; "
                       "available experts backends on cpu with torch.float32: reference")


def test_lower_rejects_unavailable_backend(dynamo_graph, unavailable_experts_backend):
    with pytest.raises(ValueError, match=exactly(UNAVAILABLE_MESSAGE)):
        lower(dynamo_graph, BackendSpec(experts=unavailable_experts_backend))


def test_compile_rejects_unavailable_backend(fresh_dynamo, unavailable_experts_backend):
    compiled = torch.compile(tiny_moe(), fullgraph=True, backend=tmo.backend(
        experts=unavailable_experts_backend, inner="eager"))
    with pytest.raises(ValueError) as failure:
        compiled(torch.randn(T, H))
    # The user's error as itself, not inside Dynamo's BackendCompilerFailed (whose first
    # line names the backend object and whose last asks for a bug report to PyTorch), its
    # traceback from the user's call to the lowering's frame that raised it.
    assert not isinstance(failure.value, torch._dynamo.exc.BackendCompilerFailed)
    assert str(failure.value).splitlines()[0] == UNAVAILABLE_MESSAGE
    frames = [str(entry.path) for entry in failure.traceback]
    assert frames[-1].endswith("compile.py") and len(frames) <= 6, frames


def test_auto_skips_unavailable_backend(dynamo_graph, unavailable_experts_backend):
    lowered = lower(dynamo_graph, BackendSpec(experts="auto"))
    assert "moe_reference.experts" in lowered.code


def test_lower_rejects_unregistered_backend(dynamo_graph, monkeypatch):
    monkeypatch.setattr(REGISTRY, "experts", {"reference": REGISTRY.experts["reference"]})
    with pytest.raises(ValueError, match=exactly(
            "experts backend 'triton' is not registered; registered: reference")):
        lower(dynamo_graph, BackendSpec(experts="triton"))


def test_auto_with_nothing_available(dynamo_graph, unavailable_experts_backend, monkeypatch):
    stub = REGISTRY.experts[unavailable_experts_backend]
    monkeypatch.setattr(REGISTRY, "experts", {stub.name: stub})
    with pytest.raises(ValueError, match=exactly(
            f"no experts backend runs on cpu with torch.float32: flashinfer: "
            f"{UNAVAILABLE_REASON}")):
        lower(dynamo_graph, BackendSpec(experts="auto"))


# Settings that do nothing for the model compiled: a warning, once, naming the setting.


def unused_settings(warned) -> list[str]:
    return [str(w.message) for w in warned if "does nothing here" in str(w.message)]


def test_cuda_graphs_on_the_cpu_warn_once(fresh_dynamo, monkeypatch, recwarn):
    backend = tmo.backend(mode="reduce-overhead")
    # What Inductor would make of the graph does not matter here: only what reaches it.
    monkeypatch.setattr(backend, "_compile", lambda gm, example_inputs: gm.forward)
    compiled = torch.compile(tiny_moe(), backend=backend)
    compiled(torch.randn(T, H))
    compiled(torch.randn(T + 2, H))  # a second graph: no second warning
    assert unused_settings(recwarn) == [
        ("mode='reduce-overhead' does nothing here: it captures CUDA graphs, and this model "
         "runs on no CUDA device")]


def test_a2a_on_one_device_warns_once(fresh_dynamo, recwarn):
    compiled = torch.compile(tiny_moe(), backend=tmo.backend(a2a="allgather", inner="eager"))
    compiled(torch.randn(T, H))
    compiled(torch.randn(T + 2, H))
    assert unused_settings(recwarn) == [
        ("a2a='allgather' does nothing here: it moves tokens between the ranks of MoE layers "
         "built with ep_size > 1, and this model's MoE layers have ep_size=1")]


def test_settings_that_apply_do_not_warn(fresh_dynamo, recwarn):
    torch.compile(tiny_moe(), backend=tmo.backend(inner="eager"))(torch.randn(T, H))
    assert unused_settings(recwarn) == []
