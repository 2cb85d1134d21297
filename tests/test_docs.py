"""docs/architecture.md and the package's overviews against the code: every format between
dispatch and combine and every registered backend is described, and what the code cites
as its design is a file of the repository."""

from __future__ import annotations

import re
from pathlib import Path

import torch_moe_ops.backends
from torch_moe_ops.backends.registry import FORMATS, REGISTRY

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()
# A document the code names: the README, or a path under docs/ or benchmarks/.
CITED = re.compile(r"(?<![\w/])((?:docs|benchmarks)/[\w./-]+\.md|README\.md)")


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def test_architecture_describes_every_format():
    formats = _section(ARCHITECTURE, "Formats")
    described = set(re.findall(r"^- (\w+)", formats, re.MULTILINE))
    assert {fmt.name.capitalize() for fmt in FORMATS} <= described, described


def test_backends_overview_names_every_backend_and_format():
    overview = torch_moe_ops.backends.__doc__
    for kind, backends in (("experts", REGISTRY.experts), ("a2a", REGISTRY.a2a),
                           ("route", REGISTRY.route)):
        for name in backends:
            assert f"``{name}``" in overview, (kind, name)
    for fmt in FORMATS:
        assert re.search(rf"\b{fmt.name}\b", overview), fmt


def test_the_code_cites_only_documents_of_the_repository():
    sources = [path for folder in ("torch_moe_ops", "lowering", "tests", "graph_tests")
               for path in (ROOT / folder).rglob("*.py") if path != Path(__file__).resolve()]
    missing = {}
    for path in sources:
        text = path.read_text()
        # The design the code keeps is docs/architecture.md: no other design document.
        cited = set(CITED.findall(text)) | ({"DESIGN"} if "DESIGN" in text else set())
        absent = sorted(doc for doc in cited if not (ROOT / doc).is_file())
        if absent:
            missing[str(path.relative_to(ROOT))] = absent
    assert not missing, missing
