"""Errors of the code generator."""

from __future__ import annotations


class SchemaError(ValueError):
    """A schema file is invalid; the message names the file, the type and the field."""

    def __init__(self, message: str, *, file: str = "", type_name: str = "", field: str = "") -> None:
        where = ", ".join(
            part
            for part in (
                file,
                f"type {type_name}" if type_name else "",
                f"field {field}" if field else "",
            )
            if part
        )
        super().__init__(f"{where}: {message}" if where else message)
        self.file = file
        self.type_name = type_name
        self.field = field
