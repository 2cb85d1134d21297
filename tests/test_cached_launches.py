"""`launch.CachedLaunches`: a Triton kernel launched again with the specialization of an
earlier launch runs that launch's compiled kernel directly, and whatever Triton would
specialize differently (alignment, an int equal to 1 or of another width, None, a
constexpr, an option, the device) compiles through Triton's own launch.

The CPU tests check the key against Triton's own specialization and the cache's logic
on a stand-in kernel; the GPU tests check bitwise equal results against Triton's own
launch, for a small kernel and for the triton backend's kernels.

Legend: T tokens, H hidden size, E experts, K experts per token.
"""

from __future__ import annotations

import itertools
import types

import pytest
import torch

from torch_moe_ops.backends.common.kernels import launch

triton = pytest.importorskip("triton")

ALIGNED = torch.zeros(64, dtype=torch.int32)
ARG_SAMPLES = [0, 1, 2, 15, 16, 17, -1, -16, 2**31 - 1, 2**31, -2**31, -2**31 - 1, 2**32,
               2**63, 1.0, 0.5, True, False, None, ALIGNED, ALIGNED[1:], ALIGNED.float(),
               ALIGNED.float()[4:], ALIGNED.to(torch.bfloat16)]


def test_the_key_tells_apart_what_triton_specializes_apart():
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    def triton_class(arg):
        return native_specialize_impl(BaseBackend, arg, False, True, True)

    for a, b in itertools.combinations(ARG_SAMPLES, 2):
        if launch._arg_class(a) == launch._arg_class(b):
            assert triton_class(a) == triton_class(b), (a, b)


class StandIn:
    """A kernel's launch surface: ``kernel[grid](*args, **kwargs)`` (Triton's own launch,
    counted) returns a compiled kernel whose ``run`` records what it launches."""

    def __init__(self):
        self.arg_names = ["x_ptr", "n", "scale", "BLOCK"]
        self.pre_run_hooks, self.used_global_vals = [], {}
        self.triton_launches, self.direct_runs = [], []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.triton_launches.append((grid, args, kwargs))
            return types.SimpleNamespace(run=self._record, function="f", packed_metadata="m",
                                         launch_metadata=lambda *_: None)
        return run

    def _record(self, *launched):
        self.direct_runs.append(launched)


@pytest.fixture
def stand_in():
    kernel = StandIn()
    launches = launch.CachedLaunches.__new__(launch.CachedLaunches)
    launches.kernel, launches.compiled = kernel, {}
    launches._knobs = types.SimpleNamespace(
        runtime=types.SimpleNamespace(debug=False, launch_enter_hook=None,
                                      launch_exit_hook=None),
        compilation=types.SimpleNamespace())
    launches._driver = types.SimpleNamespace(active=types.SimpleNamespace(
        get_current_device=lambda: 0, get_current_stream=lambda device: 7))
    return kernel, launches


def test_a_known_specialization_launches_directly(stand_in):
    kernel, launches = stand_in
    x = torch.zeros(64)
    launches[(4,)](x, 32, 0.5, BLOCK=16, num_warps=4)
    launches[(8, 2)](x, 48, 2.0, BLOCK=16, num_warps=4)
    assert len(kernel.triton_launches) == 1
    # grid, stream, function, metadata, launch metadata, hooks, then every argument in
    # the kernel's order (the constexprs too).
    assert kernel.direct_runs == [(8, 2, 1, 7, "f", "m", None, None, None, x, 48, 2.0, 16)]


@pytest.mark.parametrize("change", [
    lambda x: ((x[1:], 32, 0.5), {}),              # not 16-byte aligned
    lambda x: ((x.double(), 32, 0.5), {}),         # another dtype
    lambda x: ((x, 1, 0.5), {}),                   # an int equal to 1
    lambda x: ((x, 33, 0.5), {}),                  # an int not a multiple of 16
    lambda x: ((x, 2**40, 0.5), {}),               # a 64-bit int
    lambda x: ((x, None, 0.5), {}),                # None
    lambda x: ((x, 32, 1), {}),                    # an int where a float was
    lambda x: ((x, 32, 0.5), {"BLOCK": 32}),       # a constexpr
    lambda x: ((x, 32, 0.5), {"num_warps": 8}),    # an option
], ids=["unaligned", "dtype", "one", "odd_int", "int64", "none", "int_for_float", "constexpr",
        "option"])
def test_another_specialization_goes_through_triton(stand_in, change):
    kernel, launches = stand_in
    x = torch.zeros(64)
    launches[(4,)](x, 32, 0.5, BLOCK=16, num_warps=4)
    args, replace = change(x)
    launches[(4,)](*args, **{"BLOCK": 16, "num_warps": 4, **replace})
    assert len(kernel.triton_launches) == 2 and not kernel.direct_runs


def test_what_is_not_cached_goes_through_triton(stand_in):
    kernel, launches = stand_in
    x = torch.zeros(64)
    for _ in range(2):
        launches[lambda meta: (4,)](x, 32, 0.5, BLOCK=16)      # a callable grid
        launches[(4,)](x, 32, 0.5)                              # BLOCK left to its default
        launches[(4,)](x, (32, 64), 0.5, BLOCK=16)              # a tuple argument
    assert len(kernel.triton_launches) == 6 and not kernel.direct_runs
    launches[(4,)](x, 32, 0.5, BLOCK=16)
    launches._driver.active.get_current_device = lambda: 1    # another device
    launches[(4,)](x, 32, 0.5, BLOCK=16)
    kernel.pre_run_hooks.append(lambda *args, **kwargs: None)
    launches._driver.active.get_current_device = lambda: 0
    launches[(4,)](x, 32, 0.5, BLOCK=16)
    assert len(kernel.triton_launches) == 9 and not kernel.direct_runs


def test_under_the_interpreter_kernels_launch_themselves(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernel = object()
    assert launch.launcher(kernel) is kernel


# On the GPU: the cached launches against Triton's own.

@pytest.mark.gpu
def test_a_small_kernel_matches_triton_bitwise_across_specializations():
    import triton.language as tl

    @triton.jit
    def scaled_add(x_ptr, y_ptr, out_ptr, n, shift, scale, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        x = tl.load(x_ptr + offsets, mask=mask)
        if y_ptr is not None:
            x += tl.load(y_ptr + offsets, mask=mask)
        tl.store(out_ptr + offsets, x * scale + shift, mask=mask)

    launches = launch.CachedLaunches(scaled_add)
    generator = torch.Generator("cuda").manual_seed(0)
    base = torch.randn(4096 + 8, device="cuda", generator=generator)
    calls = 0
    for n, offset, shift, with_y, block, dtype in itertools.product(
            (1, 16, 17, 1000), (0, 1, 4), (1, 2, 16), (False, True), (64, 128),
            (torch.float32, torch.bfloat16)):
        x = base.to(dtype)[offset:offset + n]
        y = base.to(dtype)[8 - offset:8 - offset + n] if with_y else None
        ours, theirs = torch.empty_like(x), torch.empty_like(x)
        grid = (triton.cdiv(n, block),)
        for launcher, out in ((launches, ours), (scaled_add, theirs)):
            launcher[grid](x, y, out, n, shift, 0.5, BLOCK=block)
        calls += 1
        assert torch.equal(ours, theirs), (n, offset, shift, with_y, block, dtype)
    # Every combination again: each one's compiled kernel launches directly.
    kept = len(launches.compiled)
    assert 0 < kept < calls
    x = base[:1000]
    out = torch.empty_like(x)
    launches[(16,)](x, None, out, 1000, 2, 0.5, BLOCK=64)
    assert len(launches.compiled) == kept
    torch.testing.assert_close(out, x * 0.5 + 2, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_backend_kernels_match_triton_bitwise(dtype, monkeypatch):
    from torch_moe_ops.backends.triton import align, fused, route

    generator = torch.Generator("cuda").manual_seed(0)
    E, K, H, I = 16, 4, 256, 128
    w13_EFH = torch.randn(E, 2 * I, H, device="cuda", generator=generator).to(dtype) / 16
    w2_EHI = torch.randn(E, H, I, device="cuda", generator=generator).to(dtype) / 16
    for T, offset in itertools.product((1, 3, 16, 17, 257, 1024, 16, 3, 1), (0, 1)):
        # Offset by one element: rows not 16-byte aligned.
        x_TH = torch.randn(T * H + offset, device="cuda", generator=generator).to(dtype)
        x_TH = x_TH[offset:].view(T, H)
        logits_TE = torch.randn(T, E, device="cuda", generator=generator)
        results = []
        for plain in (True, False):
            with monkeypatch.context() as patch:
                if plain:  # Triton's own launch of each kernel
                    patch.setattr(launch, "_cached_launches", lambda kernel: kernel)
                weights_TK, ids_TK = route.route(logits_TE, None, K, "softmax", True, 1, 1, 1.0)
                out_TH = fused.fused_experts(x_TH, weights_TK, ids_TK, w13_EFH, w2_EHI, None,
                                             None, "silu", 1.702, 7.0)
                results.append((weights_TK, ids_TK, out_TH, *align.align_rows(ids_TK, E, 64)))
        for theirs, ours in zip(*results):
            assert torch.equal(ours, theirs), (T, offset)
    for kernel in (route.moe_route_topk_kernel, align.moe_align_one_program_kernel):
        assert launch._LAUNCHES[id(kernel)].compiled, kernel
