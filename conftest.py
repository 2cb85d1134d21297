"""Repository-wide pytest hooks (cover tests/ and graph_tests/ alike).

``@pytest.mark.gpu`` tests skip without a CUDA GPU, ``@pytest.mark.multigpu``
tests skip with fewer than two, and ``@pytest.mark.triton`` tests (Triton
kernels) skip without the triton package; the markers are declared in
pyproject.toml.
"""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU the Triton kernels run under the interpreter, so their indexing is
# tested on the CPU too. Triton reads this when a kernel is defined: it must be
# set before anything imports torch_moe_ops.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# FlashInfer's experts profile their tactics on the first call of each layer shape: 20 to
# 100 s per shape on an H200, the bulk of the GPU suite's time where every backend's test
# met it. Tests run its fallback tactics unless they test the tuned path, which sets this
# back (tests/test_flashinfer_experts.py).
os.environ.setdefault("TORCH_MOE_OPS_FLASHINFER_AUTOTUNE", "0")


def _cuda_device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _why_triton_cannot_run() -> str | None:
    from torch_moe_ops.backends.common import TRITON_INSTALLED

    if not TRITON_INSTALLED:
        return "runs Triton kernels: the triton package is not installed (pip install triton)"
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return ("runs Triton kernels: needs a CUDA GPU or TRITON_INTERPRET=1, found no GPU "
                f"and TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}")
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    num_gpus = _cuda_device_count()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU, found none")
    skip_multigpu = pytest.mark.skip(reason=f"needs >= 2 CUDA GPUs, found {num_gpus}")
    triton_reason = _why_triton_cannot_run()
    for item in items:
        # get_closest_marker, not `in item.keywords`: keywords also hold test and
        # parameter names, so a test called test_gpu_... would match.
        if item.get_closest_marker("multigpu") is not None and num_gpus < 2:
            item.add_marker(skip_multigpu)
        elif item.get_closest_marker("gpu") is not None and num_gpus < 1:
            item.add_marker(skip_gpu)
        elif item.get_closest_marker("triton") is not None and triton_reason is not None:
            item.add_marker(pytest.mark.skip(reason=triton_reason))


@pytest.fixture
def fresh_dynamo():
    """Compile caches emptied before and after: compilation counts start at zero."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``TORCH_MOE_OPS_DURATIONS_LOG`` set, each test's call time is appended to that
    file as the test ends, in ``--durations``' line format: a run cut short by its time
    bound still balances the next run's shards (scripts/gpu_shards.py)."""
    path = os.environ.get("TORCH_MOE_OPS_DURATIONS_LOG")
    if path and report.when == "call":
        with open(path, "a") as log:
            log.write(f"{report.duration:.2f}s call     {report.nodeid}\n")


@pytest.fixture(autouse=True)
def _backend_choices_end_with_the_test():
    """Tests fake the machine (a GPU, a built module, an installed package) by patching
    what the backends' ``supports`` read. The eager kernels' backend choices are cached for
    a machine that does not change (`registry.EagerChoices`): none made under a test's
    fakes may serve the tests after it."""
    yield
    from torch_moe_ops.backends.registry import REGISTRY

    REGISTRY.changed()
