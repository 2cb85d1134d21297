"""Each private torch API of `torch_moe_ops.torch_compat`: it exists, and it does
what the library relies on. Run on every torch in ``torch_compat.TESTED_ON``
(scripts/torch_version_check.sh); the module's docstring names each entry's test."""

from __future__ import annotations

import ast
import gc
import inspect
import re
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import fx
from torch._dynamo.testing import CompileCounter

import torch_moe_ops  # noqa: F401  (defines the moe ops)
from torch_moe_ops import torch_compat

TEST_NAMESPACE = "moe_compat_test"
ROOT = Path(__file__).resolve().parent.parent
VERSION_CHECK = ROOT / "scripts" / "torch_version_check.sh"


def test_op_overload_and_packet_classes():
    assert isinstance(torch.ops.moe.experts.default, torch_compat.OpOverload)
    assert isinstance(torch.ops.moe.experts, torch_compat.OpOverloadPacket)
    assert not isinstance(torch.ops.moe.experts, torch_compat.OpOverload)
    # The lowering reads an overload's qualified name off name().
    assert torch.ops.moe.experts.default.name() == "moe::experts"


def test_schema_gives_names_and_defaults():
    arguments = torch_compat.schema(torch.ops.aten.add.Tensor).arguments
    assert [a.name for a in arguments] == ["self", "other", "alpha"]
    assert [a.has_default_value() for a in arguments] == [False, False, True]
    assert arguments[2].default_value == 1


def test_linear_targets_are_what_dynamo_records():
    """``nn.Linear`` and ``F.linear`` reach a backend's graph as a call of one of them."""
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    layer = torch.nn.Linear(4, 3, bias=False)
    torch._dynamo.reset()
    torch.compile(lambda x: layer(x) + F.linear(x, layer.weight), backend=recording,
                  fullgraph=True)(torch.randn(2, 4))
    linears = [n for n in graphs[0].graph.nodes if n.op == "call_function"
               and n.target in torch_compat.linear_targets]
    assert len(linears) == 2, graphs[0].code


def test_packet_name():
    assert torch_compat.packet_name(torch.ops.moe.experts) == "moe::experts"
    assert torch_compat.packet_name(torch.ops.aten.add) == "aten::add"


@pytest.fixture(scope="module")
def effectful_op():
    """A test op whose output nothing reads, given an ordered effect."""
    library = torch.library.Library(TEST_NAMESPACE, "FRAGMENT")
    library.define("touch(Tensor x) -> Tensor")
    library.impl("touch", lambda x: x.clone(), "CompositeExplicitAutograd")
    torch.library.register_fake(f"{TEST_NAMESPACE}::touch", lambda x: torch.empty_like(x),
                                lib=library)
    op = getattr(torch.ops, TEST_NAMESPACE).touch.default
    torch_compat.register_ordered_effect(op)
    yield op
    library._destroy()


def test_ordered_effect_threads_a_token_through_the_traced_op(effectful_op):
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    def f(x):
        effectful_op(x)  # its output is unused: only the effect keeps it
        return x + 1

    recorder = AotEagerAndRecordGraphs()
    x = torch.ones(3)
    assert torch.equal(torch.compile(f, backend=recorder, fullgraph=True)(x), x + 1)
    code = recorder.fw_graphs[0].code
    assert "with_effects" in code and f"{TEST_NAMESPACE}.touch" in code


def test_below_autograd_skips_the_autograd_kernels():
    a = torch.ones(2, 2, requires_grad=True)
    with torch_compat.below_autograd():
        below = a * 2
    assert below.grad_fn is None and not below.requires_grad
    assert (a * 2).grad_fn is not None


def test_fake_and_functional_tensor_classes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert isinstance(torch.ones(2), torch_compat.FakeTensor)
    with torch_compat.FunctionalTensorMode():
        assert isinstance(torch.ones(2), torch_compat.FunctionalTensor)
    assert issubclass(torch_compat.FakeTensor, torch.Tensor)
    assert issubclass(torch_compat.FunctionalTensor, torch.Tensor)


@pytest.fixture
def world_of_one():
    """A gloo process group of this process alone."""
    if not dist.is_available():
        pytest.skip("this torch has no torch.distributed")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _skip_where_untested(entry: str) -> None:
    """Skip on a torch of `TESTED_ON` that the docstring's table does not list for ``entry``
    (a torch outside `TESTED_ON` runs every test)."""
    version = ".".join(torch.__version__.split(".")[:2])
    tested_on = _entry_table()[entry][0]
    if version in torch_compat.TESTED_ON and version not in tested_on:
        pytest.skip(f"torch_compat.{entry} is tested on torch {', '.join(tested_on)} alone, "
                    f"this is {torch.__version__}")


def test_functional_collectives_take_the_group_by_name(world_of_one):
    functional = torch_compat.c10d_functional
    name = world_of_one.group_name
    x = torch.arange(4.0)
    assert torch.equal(functional.wait_tensor(functional.all_reduce(x, "sum", name)), x)
    assert torch.equal(functional.wait_tensor(
        functional.all_to_all_single(x, [4], [4], name)), x)
    assert torch.equal(functional.wait_tensor(
        functional.all_gather_into_tensor(x, 1, name)), x)
    assert torch.equal(functional.wait_tensor(
        functional.reduce_scatter_tensor(x, "sum", 1, name)), x)


def test_wait_tensor_calls_what_is_registered_in_flight():
    x, arrivals = torch.arange(4.0), []
    torch_compat.register_in_flight(x, lambda: arrivals.append("arrived"))
    assert arrivals == []
    assert torch_compat.c10d_functional.wait_tensor(x) is x and arrivals == ["arrived"]
    torch_compat.c10d_functional.wait_tensor(x)  # waited once: nothing registered now
    assert arrivals == ["arrived"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_by_rows_and_by_contraction(dtype):
    # The CPU kernels (torch 2.11 on): the CPU backend and the gradients run on them.
    # Every stride but the unit one a multiple of 16 bytes, as torch._grouped_mm takes.
    g = torch.Generator().manual_seed(0)
    ends_G = torch.tensor([2, 2, 6], dtype=torch.int32)  # the middle group is empty
    groups = [slice(0, 2), slice(2, 2), slice(2, 6)]
    a_RK = torch.randn(6, 16, generator=g).to(dtype)
    w_GNK = torch.randn(3, 8, 16, generator=g).to(dtype)
    by_rows_RN = torch_compat.grouped_mm(a_RK, w_GNK.transpose(-2, -1), ends_G)
    assert by_rows_RN.shape == (6, 8) and by_rows_RN.dtype == dtype
    expected_RN = torch.cat([a_RK[rows].float() @ w_GNK[i].float().T
                             for i, rows in enumerate(groups)])
    torch.testing.assert_close(by_rows_RN.float(), expected_RN, rtol=2e-2, atol=2e-2)
    # The weight gradient's form: a transposed a, groups along the contraction.
    b_RN = torch.randn(6, 8, generator=g).to(dtype)
    by_contraction_GKN = torch_compat.grouped_mm(a_RK.t(), b_RN, ends_G)
    assert by_contraction_GKN.shape == (3, 16, 8)
    for i, rows in enumerate(groups):
        if rows.stop > rows.start:  # an empty group's block is left unspecified
            torch.testing.assert_close(by_contraction_GKN[i].float(),
                                       a_RK[rows].float().T @ b_RN[rows].float(),
                                       rtol=2e-2, atol=2e-2)


def test_scaled_grouped_mm_signature_and_output():
    # Its kernel is CUDA sm90 alone: on the CPU, torch's meta kernel checks the call.
    assert torch_compat.has_scaled_grouped_mm()
    names = [a.name for a in torch_compat.schema(torch.ops.aten._scaled_grouped_mm.default)
             .arguments]
    assert names[:5] == ["self", "mat2", "scale_a", "scale_b", "offs"] and "out_dtype" in names
    fp8 = torch.float8_e4m3fn
    a_RK = torch.empty(16, 32, dtype=fp8, device="meta")
    w_GNK = torch.empty(2, 48, 32, dtype=fp8, device="meta")
    out_RN = torch_compat.scaled_grouped_mm(
        a_RK, w_GNK.transpose(-2, -1), torch.empty(16, device="meta"),
        torch.empty(2, 48, device="meta"), torch.empty(2, dtype=torch.int32, device="meta"),
        torch.bfloat16)
    assert out_RN.shape == (16, 48) and out_RN.dtype == torch.bfloat16


def test_resolve_process_group(world_of_one):
    assert torch_compat.resolve_process_group(world_of_one.group_name) is world_of_one
    with pytest.raises((KeyError, ValueError, RuntimeError)):
        torch_compat.resolve_process_group("no such group")


def test_saved_tensor_hooks_off_while_compiling():
    packed = []
    x = torch.randn(3, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        with torch_compat.saved_tensor_hooks_off():
            x.sin()
        assert packed == []
        x.sin()
    assert len(packed) == 1


def test_inductor_compiler_applies_mode_and_options():
    compile_graph = torch_compat.inductor_compiler("reduce-overhead",
                                                   {"reorder_for_peak_memory": False})
    assert callable(compile_graph)
    # reduce-overhead means CUDA graphs; the options come on top of the mode's.
    assert compile_graph.config["triton.cudagraphs"] is True
    assert compile_graph.config["reorder_for_peak_memory"] is False


def _cache_entries(function) -> list:
    return torch._dynamo.eval_frame._debug_get_cache_entry_list(function)


def test_discard_compiled_drops_one_backends_compilations():
    def double(x):
        return x * 2

    def triple(x):
        return x * 3

    x = torch.randn(3)
    discarded, kept = CompileCounter(), CompileCounter()
    torch.compile(double, backend=discarded)(x)
    torch.compile(triple, backend=discarded)(x)
    compiled_triple = torch.compile(triple, backend=kept)
    compiled_triple(x)
    assert (len(_cache_entries(double)), len(_cache_entries(triple))) == (1, 2)
    torch_compat.discard_compiled(discarded)
    # What only `discarded` compiled is gone; where another backend compiled too, all stays.
    assert (len(_cache_entries(double)), len(_cache_entries(triple))) == (0, 2)
    compiled_triple(x)
    assert kept.frame_count == 1
    # Dynamo holds `discarded` no more, once no code object's cache does.
    alone = CompileCounter()
    torch.compile(double, backend=alone)(x)
    torch_compat.discard_compiled(alone)
    alone_ref = weakref.ref(alone)
    del alone
    gc.collect()
    assert alone_ref() is None


@pytest.mark.parametrize("name", ["eager", "aot_eager"])
def test_lookup_backend_runs_a_graph(name):
    # Dynamo hands a backend graphs that return a tuple.
    gm = fx.symbolic_trace(lambda x: (x * 2 + 1,))
    x = torch.arange(3.0)
    (y,) = torch_compat.lookup_backend(name)(gm, [x])(x)
    assert torch.equal(y, x * 2 + 1)


def test_compiled_module_gives_the_module_and_its_backend():
    module = torch.nn.Linear(2, 2)

    def my_backend(gm, example_inputs):
        return gm.forward

    assert torch_compat.compiled_module(module) is None
    original, backend, name = torch_compat.compiled_module(
        torch.compile(module, backend=my_backend))
    assert (original, backend, name) == (module, my_backend, "my_backend")
    # Mode and options stay with torch.compile's wrapper; the backend is as given.
    _, backend, _ = torch_compat.compiled_module(
        torch.compile(module, backend=my_backend, options={"an option": 1}))
    assert backend is my_backend
    _, backend, name = torch_compat.compiled_module(torch.compile(module, backend="eager"))
    assert (backend, name) == (torch_compat.lookup_backend("eager"), "eager")
    _, backend, name = torch_compat.compiled_module(torch.compile(module))
    assert name == "inductor" and callable(backend)
    # A backend handed to Dynamo directly, with no torch.compile wrapper around it.
    _, backend, _ = torch_compat.compiled_module(torch._dynamo.optimize(my_backend)(module))
    assert backend is my_backend


def test_checkpoint_wrapper_recomputes_and_keeps_the_state_dict():
    _skip_where_untested("checkpoint_wrapper")
    module = torch.nn.Linear(3, 2)
    forwards = []
    # A pre-hook: the recomputation stops once it has the saved tensors, before the
    # forward returns.
    module.register_forward_pre_hook(lambda *_: forwards.append(1))
    wrapped = torch_compat.checkpoint_wrapper(module)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    y = wrapped(x)
    assert torch.equal(y, module(x)) and len(forwards) == 2
    y.sum().backward()
    assert len(forwards) == 3  # the backward ran the forward again
    expected = torch.ones(4, 2).T @ x
    torch.testing.assert_close(module.weight.grad, expected)
    # A state dict saved from the module loads into the wrapper, and back.
    assert wrapped.state_dict().keys() == module.state_dict().keys()
    wrapped.load_state_dict(module.state_dict())


def test_flatten_mesh_joins_the_dims(world_of_one):
    _skip_where_untested("flatten_mesh")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "ep"))
    flat = torch_compat.flatten_mesh(mesh)
    assert flat.ndim == 1 and flat.mesh_dim_names == ("dp_shard_ep",)
    assert flat.mesh.tolist() == [0]
    assert dist.get_process_group_ranks(flat.get_group()) == [0]
    assert torch_compat.flatten_mesh(mesh) == flat


def test_fsdp_shard_placement_shards_over_another_mesh(world_of_one):
    _skip_where_untested("fsdp_shard_placement")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "ep"))
    shard_over_dp = torch_compat.fsdp_shard_placement(mesh["dp_shard"])
    module = torch.nn.Linear(3, 2)
    # Every parameter: in a world of one, the two meshes' groups are one group, whose
    # parameters FSDP2 takes over one mesh alone.
    fully_shard(module, mesh=torch_compat.flatten_mesh(mesh),
                shard_placement_fn=lambda p: shard_over_dp(Shard(p.ndim - 1)))
    weight, bias = module.weight, module.bias
    assert isinstance(weight, DTensor) and weight.placements == (Shard(1),)
    assert bias.placements == (Shard(0),)
    assert weight.device_mesh.mesh_dim_names == bias.device_mesh.mesh_dim_names == ("dp_shard",)
    module(torch.ones(1, 3)).sum().backward()
    assert torch.equal(weight.grad.full_tensor(), torch.ones(2, 3))


def test_tensor_version_counts_in_place_writes():
    t = torch.zeros(2)
    before = torch_compat.tensor_version(t)
    t.add_(1)
    assert torch_compat.tensor_version(t) == before + 1
    with torch.inference_mode():
        inference = torch.zeros(2)
    assert torch_compat.tensor_version(inference) is None


def test_op_calls_intercepted_by_modes_transforms_and_profiler():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.overrides import TorchFunctionMode

    assert not torch_compat.op_calls_intercepted()
    seen = []
    torch.vmap(lambda x: seen.append(torch_compat.op_calls_intercepted()) or x)(torch.ones(2))
    with torch.autograd.forward_ad.dual_level():
        seen.append(torch_compat.op_calls_intercepted())
    for mode in (FakeTensorMode(), TorchFunctionMode(),
                 torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])):
        with mode:
            seen.append(torch_compat.op_calls_intercepted())
    torch.compile(lambda: seen.append(torch_compat.op_calls_intercepted()),
                  backend="eager", fullgraph=False)()
    assert seen == [True] * 6, seen
    assert not torch_compat.op_calls_intercepted()


def test_profiler_enabled_follows_the_profiler():
    assert not torch_compat.profiler_enabled()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert torch_compat.profiler_enabled()
    assert not torch_compat.profiler_enabled()


def test_backend_error_reaches_the_caller_unwrapped():
    def refusing_backend(gm, example_inputs):
        raise torch_compat.backend_error("experts backend 'x' is not available: a reason",
                                         inspect.currentframe())

    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x.sin() + 1, backend=refusing_backend)
    with pytest.raises(ValueError) as failure:
        compiled(torch.ones(3))
    torch._dynamo.reset()
    assert not isinstance(failure.value, torch._dynamo.exc.BackendCompilerFailed)
    assert str(failure.value).splitlines()[0] == "experts backend 'x' is not available: a reason"
    # Dynamo's frames between the call and the backend are cut.
    assert failure.traceback[-1].name == "refusing_backend"
    assert not any("output_graph" in str(entry.path) for entry in failure.traceback)


def _entry_table() -> dict[str, tuple[tuple[str, ...], str]]:
    """The module docstring's first table: entry -> (torch versions, test name)."""
    lines = torch_compat.__doc__.splitlines()
    rulers = [i for i, line in enumerate(lines) if line.startswith("===")]
    rows = {}
    for line in lines[rulers[1] + 1:rulers[2]]:
        entry, versions, test = re.split(r"\s{2,}", line.strip())
        rows[entry] = (tuple(v.strip() for v in versions.split(",")), test)
    return rows


def test_every_entry_names_a_test_of_this_module():
    table = _entry_table()
    # A private API used through a new name must be exported, listed and tested.
    public = {name for name in vars(torch_compat)
              if not name.startswith("_") and name not in ("annotations", "torch")}
    assert public == set(torch_compat.__all__)
    assert set(table) == public - {"TESTED_ON"}
    for entry, (versions, test) in table.items():
        # Tested on some of TESTED_ON, in its order (`_skip_where_untested` skips the rest).
        assert versions and versions == tuple(v for v in torch_compat.TESTED_ON
                                              if v in versions), entry
        assert test.startswith("test_") and callable(globals().get(test)), (entry, test)


def test_the_version_check_runs_the_tests_the_docstring_names():
    script = VERSION_CHECK.read_text()
    run = set(re.findall(r"^  ((?:tests|graph_tests)/\w+\.py)(?:::(\w+))?$", script,
                         re.MULTILINE))
    assert run, "no tests found in the version check's TESTS"
    for path, test in run:
        source = (ROOT / path).read_text()
        assert not test or f"def {test}(" in source, (path, test)
    named = set(re.findall(r"(?:tests|graph_tests)/\w+\.py", torch_compat.__doc__))
    assert named <= {path for path, _ in run}


def _private_torch_names(source: str) -> list[str]:
    """The private torch names (a part after ``torch`` starting with ``_``) that the
    code of ``source`` imports, reads as attributes or passes to getattr/hasattr.
    Private attributes of torch objects held in variables (``op._schema``) are not
    seen: those pass for the library's own."""
    def private(dotted: str) -> bool:
        parts = dotted.split(".")
        return parts[0] == "torch" and any(p.startswith("_") and not p.startswith("__")
                                           for p in parts[1:])

    def dotted(node: ast.expr) -> str:
        """``torch.ops.aten`` for a chain of names, else ``""``."""
        if isinstance(node, ast.Attribute):
            base = dotted(node.value)
            return f"{base}.{node.attr}" if base else ""
        return node.id if isinstance(node, ast.Name) else ""

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if private(alias.name)]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found += [f"{node.module}.{alias.name}" for alias in node.names
                      if private(f"{node.module}.{alias.name}")]
        elif isinstance(node, ast.Attribute) and private(dotted(node)):
            found.append(dotted(node))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and private(f"{dotted(node.args[0])}.{node.args[1].value}")):
            found.append(f"{dotted(node.args[0])}.{node.args[1].value}")
    return found


def test_private_torch_apis_go_through_this_module():
    compat = Path(torch_compat.__file__).resolve()
    sources = {path.resolve() for folder in ("torch_moe_ops", "lowering")
               for path in (ROOT / folder).rglob("*.py")}
    assert compat in sources
    outside = {str(path.relative_to(ROOT)): names for path in sorted(sources - {compat})
               if (names := _private_torch_names(path.read_text()))}
    assert not outside, f"private torch APIs used outside torch_compat: {outside}"
    assert "torch._grouped_mm" in _private_torch_names(compat.read_text())
