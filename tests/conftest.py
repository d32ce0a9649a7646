"""Shared test fixtures: the repository root and the translate cases recorded from vLLM 0.33.0."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

# Wall-clock deadlines make property tests flaky on a loaded 2-core CI machine; example counts bound them.
settings.register_profile("kvoffload", deadline=None, print_blob=True)
settings.load_profile("kvoffload")

ROOT = Path(__file__).resolve().parent.parent


CASES_FILE = ROOT / "tests" / "data" / "translate_cases.jsonl"


def load_cases() -> list[dict[str, Any]]:
    """The translate cases answered by released vLLM 0.33.0."""
    return [json.loads(line) for line in CASES_FILE.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def translate_cases() -> list[dict[str, Any]]:
    return load_cases()
