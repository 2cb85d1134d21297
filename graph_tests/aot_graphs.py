"""A compile backend for tests: lowers the MoE ops, then records the graphs
AOTAutograd traces (what the inner compiler would receive)."""

from __future__ import annotations

from functorch.compile import make_boxed_func
from torch._functorch.aot_autograd import aot_module_simplified

from torch_moe_ops.config import BackendSpec
from torch_moe_ops.lowering import lower


class AotGraphs:
    """``torch.compile(fn, backend=AotGraphs(spec))``; ``codes`` holds the forward
    graph's code of each compilation, then the backward's where there is one."""

    def __init__(self, spec: BackendSpec):
        self.spec = spec
        self.codes: list[str] = []

    def __call__(self, gm, example_inputs):
        def record(graph, _):
            self.codes.append(graph.code)
            return make_boxed_func(graph.forward)

        return aot_module_simplified(lower(gm, self.spec), example_inputs, fw_compiler=record,
                                     bw_compiler=record)
