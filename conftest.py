"""Repository-wide pytest hooks (cover tests/ and graph_tests/ alike).

``@pytest.mark.gpu`` tests skip without a CUDA GPU and ``@pytest.mark.multigpu``
tests skip with fewer than two; the markers are declared in pyproject.toml.
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


def _cuda_device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    num_gpus = _cuda_device_count()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU, found none")
    skip_multigpu = pytest.mark.skip(reason=f"needs >= 2 CUDA GPUs, found {num_gpus}")
    for item in items:
        # get_closest_marker, not `in item.keywords`: keywords also hold test and
        # parameter names, so a test called test_gpu_... would match.
        if item.get_closest_marker("multigpu") is not None and num_gpus < 2:
            item.add_marker(skip_multigpu)
        elif item.get_closest_marker("gpu") is not None and num_gpus < 1:
            item.add_marker(skip_gpu)


@pytest.fixture
def fresh_dynamo():
    """Compile caches emptied before and after: compilation counts start at zero."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
