"""Each private torch API of `torch_moe_ops.torch_compat`: it exists, and it does
what the library relies on. Run on every torch in ``torch_compat.TESTED_ON``
(scripts/torch_version_check.sh); the module's docstring names each entry's test."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import fx

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


def test_resolve_process_group(world_of_one):
    assert torch_compat.resolve_process_group(world_of_one.group_name) is world_of_one
    with pytest.raises((KeyError, ValueError, RuntimeError)):
        torch_compat.resolve_process_group("no such group")


def test_inductor_compiler_applies_mode_and_options():
    compile_graph = torch_compat.inductor_compiler("reduce-overhead",
                                                   {"reorder_for_peak_memory": False})
    assert callable(compile_graph)
    # reduce-overhead means CUDA graphs; the options come on top of the mode's.
    assert compile_graph.config["triton.cudagraphs"] is True
    assert compile_graph.config["reorder_for_peak_memory"] is False


@pytest.mark.parametrize("name", ["eager", "aot_eager"])
def test_lookup_backend_runs_a_graph(name):
    # Dynamo hands a backend graphs that return a tuple.
    gm = fx.symbolic_trace(lambda x: (x * 2 + 1,))
    x = torch.arange(3.0)
    (y,) = torch_compat.lookup_backend(name)(gm, [x])(x)
    assert torch.equal(y, x * 2 + 1)


def test_tensor_version_counts_in_place_writes():
    t = torch.zeros(2)
    before = torch_compat.tensor_version(t)
    t.add_(1)
    assert torch_compat.tensor_version(t) == before + 1
    with torch.inference_mode():
        inference = torch.zeros(2)
    assert torch_compat.tensor_version(inference) is None


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
        assert versions == torch_compat.TESTED_ON, entry
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
