"""The Triton kernels' sources survive Inductor's embedding in the module it generates.

Inductor pastes a user-defined kernel's source, with the globals it reads repr'd, into a
triple-quoted string (`user_defined_triton_kernel_transitive_closure_source_code`). torch
2.13 doubles its backslashes first; torch 2.11 does not, so an escape in a global (a newline
in a PTX string) became a real character there and the module failed to import
(``SyntaxError: unterminated string literal`` at the first compiled call on a GPU).

Checked in a process of its own: under the interpreter (as the tests run on the CPU)
``triton.jit`` makes interpreted functions, whose sources Inductor never embeds.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import pkgutil
import subprocess
import sys

import pytest

from torch_moe_ops.backends.common import TRITON_INSTALLED


def embedding_errors() -> dict[str, str]:
    """Each Triton kernel of the backends: '' where its source parses once embedded as
    torch 2.11 embeds it, else the error."""
    import triton
    from torch._inductor.codegen.wrapper import (
        user_defined_triton_kernel_transitive_closure_source_code as inductor_source,
    )

    import torch_moe_ops.backends as package

    errors = {}
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if info.name.endswith("__main__"):
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # a backend whose library is not installed
            continue
        for name, value in vars(module).items():
            if isinstance(value, triton.JITFunction) and value.__module__ == info.name:
                source = inductor_source(value).replace("'''", "\\'\\'\\'")
                try:
                    ast.parse(ast.literal_eval("'''" + source + "'''"))
                    errors[f"{info.name}.{name}"] = ""
                except SyntaxError as error:
                    errors[f"{info.name}.{name}"] = str(error)
    return errors


@pytest.mark.skipif(not TRITON_INSTALLED, reason="needs Triton")
def test_every_kernel_source_parses_as_torch_2_11_embeds_it():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, __file__], env=env, check=True, capture_output=True,
                         text=True, timeout=300).stdout
    errors = json.loads(out.splitlines()[-1])
    assert len(errors) >= 20, sorted(errors)
    assert {name: error for name, error in errors.items() if error} == {}


if __name__ == "__main__":
    print(json.dumps(embedding_errors()))
