"""The private torch APIs the library relies on, each named once here.

None of these is public or stable: a torch release may move or change any of
them. When a release breaks one, the fix goes here, and the other modules keep
calling the name they call now. No other module of the library names a private
torch API (tests/test_torch_compat.py reads their code for one).

Each entry has a test of its own in tests/test_torch_compat.py (it exists and
behaves as relied upon), run on every torch in `TESTED_ON`; a test there asserts
that this table names every entry of ``__all__``, and only tests that exist.
Where an entry is tested on fewer versions than `TESTED_ON`, its test skips on the
others:

=======================  ==========  =========================================================
entry                    tested on   test (tests/test_torch_compat.py)
=======================  ==========  =========================================================
FakeTensor               2.11, 2.13  test_fake_and_functional_tensor_classes
FunctionalTensor         2.11, 2.13  test_fake_and_functional_tensor_classes
FunctionalTensorMode     2.11, 2.13  test_fake_and_functional_tensor_classes
OpOverload               2.11, 2.13  test_op_overload_and_packet_classes
OpOverloadPacket         2.11, 2.13  test_op_overload_and_packet_classes
backend_error            2.11, 2.13  test_backend_error_reaches_the_caller_unwrapped
below_autograd           2.11, 2.13  test_below_autograd_skips_the_autograd_kernels
c10d_functional          2.11, 2.13  test_functional_collectives_take_the_group_by_name
checkpoint_wrapper       2.13        test_checkpoint_wrapper_recomputes_and_keeps_the_state_dict
compiled_module          2.11, 2.13  test_compiled_module_gives_the_module_and_its_backend
discard_compiled         2.11, 2.13  test_discard_compiled_drops_one_backends_compilations
flatten_mesh             2.13        test_flatten_mesh_joins_the_dims
fsdp_shard_placement     2.13        test_fsdp_shard_placement_shards_over_another_mesh
grouped_mm               2.11, 2.13  test_grouped_mm_by_rows_and_by_contraction
has_scaled_grouped_mm    2.11, 2.13  test_scaled_grouped_mm_signature_and_output
inductor_compiler        2.11, 2.13  test_inductor_compiler_applies_mode_and_options
linear_targets           2.11, 2.13  test_linear_targets_are_what_dynamo_records
lookup_backend           2.11, 2.13  test_lookup_backend_runs_a_graph
op_calls_intercepted     2.11, 2.13  test_op_calls_intercepted_by_modes_transforms_and_profiler
packet_name              2.11, 2.13  test_packet_name
profiler_enabled         2.11, 2.13  test_profiler_enabled_follows_the_profiler
register_in_flight       2.11, 2.13  test_wait_tensor_calls_what_is_registered_in_flight
register_ordered_effect  2.11, 2.13  test_ordered_effect_threads_a_token_through_the_traced_op
resolve_process_group    2.11, 2.13  test_resolve_process_group
saved_tensor_hooks_off   2.11, 2.13  test_saved_tensor_hooks_off_while_compiling
scaled_grouped_mm        2.11, 2.13  test_scaled_grouped_mm_signature_and_output
schema                   2.11, 2.13  test_schema_gives_names_and_defaults
tensor_version           2.11, 2.13  test_tensor_version_counts_in_place_writes
=======================  ==========  =========================================================

The library's uses of them are tested on the same versions, by these tests
(`scripts/torch_version_check.sh VERSION` makes a virtualenv with that torch and
runs them, tests/test_torch_compat.py and the import tests included):

- ops/library.py (schema, OpOverload, FakeTensor, FunctionalTensor,
  FunctionalTensorMode): tests/test_opcheck.py, graph_tests/test_decompose.py; its
  op_calls_intercepted: tests/test_eager_call.py;
  its register_ordered_effect: tests/test_tokens_transport.py and
  tests/test_expert_parallel.py's Inductor run with an idle rank.
- ops/group_checks.py (schema, resolve_process_group) and
  backends/common/transport/collectives.py (c10d_functional,
  resolve_process_group): tests/test_tokens_transport.py.
- backends/cpu.py (below_autograd, grouped_mm): tests/test_cpu_backend.py.
- backends/common/kernels/grouped_gemm.py and grouped_backward.py (grouped_mm):
  tests/test_experts_backward.py (the grouped_mm backend's forward and gradient).
- backends/common/kernels/scaled_grouped_gemm.py (scaled_grouped_mm,
  has_scaled_grouped_mm): tests/test_grouped_mm_quant.py; its fp8 kernel runs on
  sm90 alone, so on the CPU a stand-in checked by torch's meta kernel takes its place.
- backends/common/weight_cache.py (tensor_version): the "prepared once per
  version" tests of tests/test_flashinfer_experts.py.
- backends/deepep/in_flight.py (register_in_flight): tests/test_deepep_emulated.py
  (its tokens in flight).
- lowering/explain.py (compiled_module, discard_compiled): tests/test_explain.py.
- lowering/overlap.py (linear_targets): tests/test_chunked_tokens.py.
- lowering/rewrite.py (OpOverload, OpOverloadPacket, packet_name) and
  lowering/compile.py (inductor_compiler, lookup_backend, backend_error):
  graph_tests/test_compile.py; compile.py's saved_tensor_hooks_off:
  tests/test_fsdp_ep.py's CPU test (a compiled block under activation checkpointing).
- parallel.py (checkpoint_wrapper, flatten_mesh, fsdp_shard_placement):
  tests/test_fsdp_ep.py's CPU test, on torch 2.13 alone: an older FSDP2 lacks
  fsdp_shard_placement, and that test skips there.

Tested on means: torch 2.13.0+cpu, and torch 2.11.0 (the PyPI wheel, +cu130, the
GPU machines' build, run on the CPU with Triton 3.6.0's interpreter). Triton
3.6's interpreter needs numpy below 2.4 (3.8's does not): the script installs it
where the Triton is older than 3.8.
"""

from __future__ import annotations

import torch
from torch._ops import OpOverload, OpOverloadPacket
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

TESTED_ON = ("2.11", "2.13")

__all__ = ["TESTED_ON", "FakeTensor", "FunctionalTensor", "FunctionalTensorMode", "OpOverload",
           "OpOverloadPacket", "backend_error", "below_autograd", "c10d_functional",
           "checkpoint_wrapper", "compiled_module", "discard_compiled", "flatten_mesh",
           "fsdp_shard_placement", "grouped_mm", "has_scaled_grouped_mm", "inductor_compiler",
           "linear_targets", "lookup_backend", "op_calls_intercepted", "packet_name",
           "profiler_enabled", "register_in_flight", "register_ordered_effect",
           "resolve_process_group", "saved_tensor_hooks_off", "scaled_grouped_mm", "schema",
           "tensor_version"]

# torch's functional collectives (all_to_all_single, all_gather_into_tensor,
# reduce_scatter_tensor, all_reduce, wait_tensor): they take the group by name,
# run eagerly and trace into compiled graphs.
c10d_functional = torch.ops._c10d_functional
# What Dynamo records an ``nn.Linear`` or ``F.linear`` call as in its graphs (and the public
# name, where a graph was built by hand).
linear_targets = (torch._C._nn.linear, torch.nn.functional.linear)


def backend_error(message: str, frame) -> ValueError:
    """A ValueError for a ``torch.compile`` backend to raise that its caller gets as it is.

    Dynamo wraps any other exception of a backend in ``BackendCompilerFailed``, whose
    first line names the backend object and whose last asks for a PyTorch bug report;
    its own ``ShortenTraceback`` it lets through, with the traceback cut to begin at
    ``frame`` (the backend's frame that raises it: Dynamo's frames above say nothing of
    the cause; ``TORCHDYNAMO_VERBOSE=1`` keeps them). Built when raised: importing
    ``torch._dynamo`` imports triton, which ``import torch_moe_ops`` does not."""
    from torch._dynamo.exc import ShortenTraceback

    class BackendError(ValueError, ShortenTraceback):
        __qualname__ = "BackendError"

    error = BackendError(message)
    error.first_useful_frame = frame
    return error


def schema(op: OpOverload) -> torch.FunctionSchema:
    """The op's schema: its arguments, in order, with their names and defaults."""
    return op._schema


def packet_name(packet: OpOverloadPacket) -> str:
    """``"namespace::name"`` of an op packet (``torch.ops.moe.experts``)."""
    return packet._qualified_op_name


def register_ordered_effect(op: OpOverload) -> None:
    """Give ``op`` an ordered effect: traced graphs thread a token through it, so
    that neither Dynamo nor Inductor removes it or moves it past another such op."""
    from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

    _register_effectful_op(op, _EffectType.ORDERED)


def below_autograd():
    """A context in which torch calls skip their autograd kernels (as a kernel
    registered below autograd runs): for an op whose gradient is its own formula."""
    return torch._C._AutoDispatchBelowADInplaceOrView()


def resolve_process_group(group_name: str):
    """The live ``ProcessGroup`` named ``group_name`` (``ProcessGroup.group_name``)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._resolve_process_group(group_name)


def saved_tensor_hooks_off():
    """A context in which the saved-tensor hooks that are active (activation
    checkpointing's) do not fire: for compile-time tracing, whose saves of fake
    values are no saves of the run (Dynamo defers the hooks so while it traces)."""
    from torch._dynamo.utils import _disable_saved_tensors_hooks_during_tracing

    return _disable_saved_tensors_hooks_during_tracing()


def checkpoint_wrapper(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with activation checkpointing (non-reentrant): its forward keeps its
    inputs alone and runs again in the backward. The wrapper's state dict has the
    module's keys (without the ``_checkpoint_wrapped_module.`` prefix of its own
    parameters' names), so a checkpoint loads with or without it. Imported when called:
    ``import torch_moe_ops`` leaves torch's checkpoint wrapper unimported."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper as wrap,
    )

    return wrap(module)


def flatten_mesh(mesh):
    """The 1-D ``DeviceMesh`` of every rank of ``mesh`` (a ``DeviceMesh`` with
    ``mesh_dim_names``), in its row-major order, named by those names joined with
    ``"_"``; its process group is made once, and a second call gives the same mesh."""
    return mesh._flatten()


def fsdp_shard_placement(mesh):
    """For ``fully_shard``'s ``shard_placement_fn``: a function of a ``Shard(dim)`` that
    gives FSDP2 the parameter sharded on ``dim`` over the 1-D ``mesh``, not over the mesh of
    its ``fully_shard`` group. FSDP2 takes a parameter's own mesh from torch 2.13 on: on an
    older torch this raises RuntimeError, before any module is sharded."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import (
            FSDPMeshInfo,
            ShardPlacementResult,
        )
    except ImportError as error:
        raise RuntimeError(f"sharding a parameter over another mesh than its fully_shard "
                           f"group's needs torch >= 2.13 (FSDP2 shards a group's parameters "
                           f"over several meshes there), got {torch.__version__}") from error
    mesh_info = FSDPMeshInfo(mesh, shard_mesh_dim=0)
    return lambda placement: ShardPlacementResult(placement, mesh_info)


def inductor_compiler(mode: str | None, options: dict):
    """Inductor as ``torch.compile(backend="inductor", mode=mode, options=options)``
    runs it: a ``(graph_module, example_inputs) -> callable`` that applies ``mode``
    (``"reduce-overhead"``: CUDA graphs) as well as ``options``."""
    return torch._TorchCompileInductorWrapper(mode, options, None)


def compiled_module(module: torch.nn.Module):
    """``(original, backend, name)`` for a module ``torch.compile`` returned (an
    ``OptimizedModule``): the module it wraps, the backend its graphs are compiled with, as
    ``torch.compile`` was given it (the object or function passed; for a name, the function
    registered under it; Inductor's compiler for the default), and that backend's name (as
    ``torch.compile`` names it: the string passed, else a function's name or an object's
    repr). None for any other module.

    The backend sits at the end of a chain of Dynamo's wrappers around the module's frame
    callback, each holding the next in ``_torchdynamo_orig_backend``; ``torch.compile``
    wraps every backend but Inductor in a ``_TorchCompileWrapper`` of its ``mode`` and
    ``options``. Imported when called: importing ``torch._dynamo`` imports triton."""
    from torch._dynamo.eval_frame import OptimizedModule

    if not isinstance(module, OptimizedModule):
        return None
    backend = module.dynamo_ctx.callback
    while hasattr(backend, "_torchdynamo_orig_backend"):
        backend = backend._torchdynamo_orig_backend
    if isinstance(backend, torch._TorchCompileWrapper):
        return module._orig_mod, backend.compiler_fn, backend.compiler_name
    if isinstance(backend, torch._TorchCompileInductorWrapper):
        return module._orig_mod, backend, "inductor"
    return module._orig_mod, backend, getattr(backend, "__name__", repr(backend))


def discard_compiled(backend) -> None:
    """Drop what Dynamo keeps of the compilations with ``backend`` (the function or object
    given to ``torch.compile``) once their code is no longer run: its reference to
    ``backend`` (kept for ``torch._dynamo.reset``, and with it all ``backend`` holds), and
    the cache of each code object that ``backend`` alone has entries in (its cache, guards,
    automatic-dynamic sizes and compilation count: each counts towards the recompile limits
    of a later compilation of that code). A code object that another backend compiled keeps
    its cache whole, ``backend``'s entries included: Dynamo drops a code object's entries
    all at once or none.

    Dynamo records each code object it compiles (``convert_frame.input_codes``, weakly);
    each cache entry holds what ``torch.compile`` wrapped the backend in, a
    ``_TorchCompileWrapper`` whose ``compiler_fn`` is ``backend`` for a callable."""
    from torch._dynamo import convert_frame, eval_frame

    def compiles_with_backend(wrapper) -> bool:
        return wrapper is backend or getattr(wrapper, "compiler_fn", None) is backend

    for key, cached in list(eval_frame.cached_backends.items()):
        if compiles_with_backend(cached):
            del eval_frame.cached_backends[key]
    for code_ref in list(convert_frame.input_codes.seen):
        code = code_ref()
        entries = eval_frame._debug_get_cache_entry_list(code) if code is not None else []
        if entries and all(compiles_with_backend(entry.backend) for entry in entries):
            torch._dynamo.reset_code(code)


def lookup_backend(name: str):
    """The ``torch.compile`` backend registered under ``name`` (``"eager"``, ``"aot_eager"``)."""
    return torch._dynamo.lookup_backend(name)


def tensor_version(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter, which every in-place write bumps; None for an
    inference tensor (made under ``torch.inference_mode``), which has none."""
    return None if tensor.is_inference() else tensor._version


def op_calls_intercepted() -> bool:
    """Whether anything but plain eager execution sees op calls now: Dynamo, a dispatch
    mode (FakeTensorMode, functionalization, make_fx's proxies, FlopCounterMode), a
    torch function mode, a functorch transform (vmap, grad), forward-mode AD, the
    TorchScript tracer or the profiler (a trace names each op)."""
    return (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0
            or torch._C._is_torch_function_mode_enabled()
            or torch._C._functorch.peek_interpreter_stack() is not None
            or torch.autograd.forward_ad._current_level >= 0
            or torch._C._get_tracing_state() is not None or profiler_enabled())


def register_in_flight(tensor: torch.Tensor, arrived) -> None:
    """Make the next ``_c10d_functional.wait_tensor(tensor)`` (the wait of a functional
    collective, a node of traced graphs) call ``arrived()``, as it waits for a collective's
    work: for a transfer issued outside torch.distributed whose result ``tensor`` is."""
    from torch._C import _distributed_c10d

    def wait(timeout):
        arrived()
        return True

    _distributed_c10d._register_work(tensor, _distributed_c10d.PythonCallbackWork(wait))


def profiler_enabled() -> bool:
    """Whether a ``torch.profiler`` (or autograd profiler) session is recording."""
    return torch.autograd.profiler._is_profiler_enabled


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """One matmul per group; ``offs`` (int32) holds the groups' cumulative ends.

    2-D ``a [R, K]``, 3-D ``b [G, K, N]``: groups of rows, ``out[r] = a[r] @ b[g]``
    for ``r`` in group ``g``; ``[R, N]``. 2-D ``a [M, R]``, 2-D ``b [R, N]``: groups
    of the contraction, ``out[g] = a[:, rows of g] @ b[rows of g]``; ``[G, M, N]``.
    """
    return torch._grouped_mm(a, b, offs=offs)


def has_scaled_grouped_mm() -> bool:
    """Whether this torch has `scaled_grouped_mm`."""
    return hasattr(torch, "_scaled_grouped_mm")


def scaled_grouped_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                      scale_b: torch.Tensor, offs: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """`grouped_mm` by rows of fp8 ``a [R, K]`` and ``b [G, K, N]`` (CUDA, sm90):
    ``out[r] = (a[r] @ b[g]) * scale_a[r] * scale_b[g]``, fp32 scales ``[R]`` and
    ``[G, N]``, accumulated in fp32 and written as ``out_dtype``."""
    return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=out_dtype)
