"""``tmo.backend(..., device=...)`` rejects, before anything compiles, a backend that
cannot run on the device, with the message the compile would give; a misspelled
backend name gets the nearest registered one."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

import torch_moe_ops as tmo
from torch_moe_ops.backends import install
from torch_moe_ops.backends.registry import REGISTRY, Problem
from torch_moe_ops.config import BackendSpec

CPU = torch.device("cpu")


def registry_message(kind: str, name: str) -> str:
    """What the compile raises for backend ``name`` of ``kind`` on a float32 CPU layer."""
    with pytest.raises(ValueError) as failure:
        getattr(REGISTRY, f"choose_{kind}")(BackendSpec(**{kind: name}), Problem(torch.float32),
                                            CPU)
    return str(failure.value)


@pytest.mark.parametrize("kind, name", [("experts", "flashinfer"), ("a2a", "deepep"),
                                        ("route", "flashinfer")])
def test_unavailable_backend_fails_up_front(kind, name):
    with pytest.raises(ValueError) as failure:
        tmo.backend(**{kind: name}, device="cpu")
    message = str(failure.value)
    assert message.startswith(registry_message(kind, name))
    library = install.LIBRARIES[name][0]
    if importlib.util.find_spec(library) is None:
        assert message.endswith(f"; {library} is not installed here (python -m "
                                f"torch_moe_ops.backends.install {name} says how)")


def test_available_backends_pass():
    backend = tmo.backend(experts="cpu", a2a="all_to_all", device="cpu")
    assert backend.spec == BackendSpec(experts="cpu", a2a="all_to_all")
    # Without a device nothing is checked until the model is compiled.
    assert tmo.backend(a2a="deepep").spec.a2a == "deepep"


@pytest.mark.parametrize("kwargs, suggestion", [(dict(experts="trition"), "triton"),
                                                (dict(a2a="deep_ep"), "deepep"),
                                                (dict(a2a="alltoall"), "all_to_all")])
def test_misspelled_backend_gets_a_suggestion(kwargs, suggestion):
    with pytest.raises(ValueError, match=re.escape(f"(did you mean {suggestion!r}?)") + "$"):
        tmo.backend(**kwargs)


def test_install_notes(capsys):
    assert install.main(["deepep"]) == 0
    assert "pip install --no-build-isolation" in capsys.readouterr().out
    assert install.main(["nccl"]) == 2
    assert capsys.readouterr().err == ("backend must be one of deepep, deepgemm, flashinfer, got "
                                       "nccl\n")
    assert install.main(["deepgemm"]) == 0
    assert "-static-libstdc++" in capsys.readouterr().out


def test_flashinfer_install_note_gives_the_trimmed_module_build_time(capsys):
    from torch_moe_ops.backends.flashinfer import cutlass_module

    assert install.main(["flashinfer"]) == 0
    note = capsys.readouterr().out
    # The time of the module this package builds (as the README gives it), not of
    # FlashInfer's full one, which is never built.
    assert cutlass_module.BUILD_TIME in note
    assert cutlass_module.BUILD_COMMAND in note
