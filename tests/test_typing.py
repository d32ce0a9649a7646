"""Run mypy on tests/typing/ and compare every reveal_type with the `# revealed:` comment on its line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "tests" / "typing").glob("*.py"))


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_reveal_types(path: Path) -> None:
    expected: dict[int, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        match = re.search(r"# revealed: (.+)$", line)
        if match:
            expected[number] = match.group(1).strip()
    assert expected, "no reveal_type expectations"
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--show-absolute-path", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    revealed: dict[int, str] = {}
    errors: list[str] = []
    for line in proc.stdout.splitlines():
        match = re.match(rf"{re.escape(str(path))}:(\d+): note: Revealed type is \"(.+)\"$", line)
        if match:
            revealed[int(match.group(1))] = match.group(2)
        elif ": error:" in line:
            errors.append(line)
    assert not errors, "\n".join(errors)
    assert revealed == expected
