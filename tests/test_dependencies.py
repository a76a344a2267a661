"""The declared dependency floors cover the APIs the code calls."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
# An API the code calls -> the first torch release that has it.
TORCH_FEATURES = {
    "enable_gqa=": "2.5",  # F.scaled_dot_product_attention's GQA argument
}


def _requirement(name: str) -> Requirement:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (found,) = (r for r in map(Requirement, project["dependencies"]) if r.name == name)
    return found


def _floor(requirement: Requirement) -> Version:
    floors = [Version(s.version) for s in requirement.specifier if s.operator in (">=", "==", "~=")]
    assert floors, f"{requirement} has no floor"
    return max(floors)


def test_the_torch_floor_has_every_api_the_code_calls() -> None:
    torch = _requirement("torch")
    source = "\n".join(p.read_text() for p in (ROOT / "src" / "mstar").rglob("*.py"))
    for feature, since in TORCH_FEATURES.items():
        if re.search(re.escape(feature), source):
            assert _floor(torch) >= Version(since), (
                f"the code calls {feature} (torch {since}) but allows {torch}"
            )
