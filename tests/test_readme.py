"""The README's code runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_python_blocks_in_the_readme_run() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, str(README), "exec", dont_inherit=True), {})  # as in a file of its own


def test_quick_start_has_exactly_two_commands_and_ci_runs_the_test_one() -> None:
    text = README.read_text()
    quick = text.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [
        line.split("#")[0].strip() for line in quick.splitlines() if line.split("#")[0].strip()
    ]
    assert commands == ["scripts/demo.sh", "scripts/test.sh"]
    assert "scripts/test.sh" in (README.parent / ".ci" / "run").read_text()
