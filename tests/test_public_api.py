"""The public API is exactly what kvoffload/__init__.py curates in __all__."""

from __future__ import annotations

import importlib
import subprocess
import sys

import kvoffload


def test_all_is_unique_and_importable() -> None:
    names = kvoffload.__all__
    assert len(names) == len(set(names))
    for name in names:
        assert hasattr(kvoffload, name), name


def test_no_private_or_stray_public_names() -> None:
    public = {
        name
        for name, value in vars(kvoffload).items()
        if not name.startswith("_") and not isinstance(value, type(kvoffload))
    }
    assert public <= set(kvoffload.__all__), sorted(public - set(kvoffload.__all__))
    assert not [n for n in kvoffload.__all__ if n.startswith("_") and n != "__version__"]


def test_every_error_subclasses_a_builtin() -> None:
    errors = importlib.import_module("kvoffload.errors")
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.KVOffloadError)
        builtin_bases = [b for b in cls.__mro__ if b.__module__ == "builtins" and b not in (object, BaseException)]
        assert builtin_bases, name
    assert issubclass(errors.OffloadingConfigError, ValueError)
    assert issubclass(errors.SchemaMismatchError, errors.WireError)


def test_import_does_not_need_jinja2() -> None:
    code = (
        "import sys; sys.modules['jinja2'] = None; import kvoffload; from kvoffload import codecs;"
        " print('jinja2' in sys.modules and sys.modules['jinja2'] is not None)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
