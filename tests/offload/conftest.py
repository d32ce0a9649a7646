"""The CPU copy engine has two implementations of its inner loop: the native kernel (built at install time)
and the pure-Python path (no compiler, or ``native=False``). Copy tests run on both."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvoffload.offload.worker.copy import _engine, _native


@pytest.fixture
def native_kernel() -> _native.NativeKernel:
    """The built native kernel; a test that needs it fails (never skips) when it was not built."""
    if _native.KERNEL is None:
        pytest.fail("the native copy kernel is not built: reinstall with a C compiler (pip install -e .)")
    return _native.KERNEL


@pytest.fixture(params=["native", "python"])
def copy_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Every ``CopyEngine`` built in the test uses this path (``native`` requires the built kernel)."""
    if request.param == "native":
        request.getfixturevalue("native_kernel")
    else:
        monkeypatch.setattr(_engine, "KERNEL", None)
    yield request.param
