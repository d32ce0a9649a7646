"""kvoffload's code generator: schema TOML -> typed msgspec classes and codecs.

`python -m codegen` regenerates `src/kvoffload/_generated/`; `--check` verifies it is up to date;
`python -m codegen compat OLD NEW` reports breaking changes between two schema versions.
"""

from .errors import SchemaError
from .loader import Schema, load_schema, load_schema_text
from .render import render

__all__ = ["Schema", "SchemaError", "load_schema", "load_schema_text", "render"]
