"""Shared test fixtures: paths to the repository and to the shared reference cases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import settings

# Wall-clock deadlines make property tests flaky on a loaded 2-core CI machine; example counts bound them.
settings.register_profile("kvoffload", deadline=None, print_blob=True)
settings.load_profile("kvoffload")

ROOT = Path(__file__).resolve().parent.parent


def shared_dir() -> Path:
    """The `shared/` folder beside the checkout (CI lays it next to the clone)."""
    for candidate in (ROOT.parent / "shared", ROOT / "shared"):
        if (candidate / "cases" / "translate.jsonl").exists():
            return candidate
    raise FileNotFoundError("shared/cases/translate.jsonl not found beside the repository")


def load_cases() -> list[dict[str, object]]:
    """The translate cases answered by released vLLM 0.33.0."""
    path = shared_dir() / "cases" / "translate.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def translate_cases() -> list[dict[str, object]]:
    return load_cases()
