"""The kvoffload error tree.

Every error kvoffload raises on purpose derives from :class:`KVOffloadError` and from the builtin that
best describes it, so callers can catch either the library-wide base or the builtin they already handle::

    KVOffloadError(Exception)                  base of everything below
    ├── ConfigError(ValueError)                a snapshot or config value is invalid (names field and value)
    │   ├── OffloadingConfigError              a vLLM 0.33 translator rule rejects the input (vLLM's message)
    │   ├── ConfigImportError(ImportError)     a configured module_path or class cannot be imported
    │   │   └── ConfigModuleNotFoundError(ModuleNotFoundError)  the configured module does not exist
    │   ├── ConfigClassError(AssertionError)   a configured class is not of the kind it must be (vLLM asserts it)
    │   └── TierUnusableError(TierError)       a configured tier cannot be used at start (also an OSError)
    ├── ArgumentTypeError(TypeError)           an argument has the wrong type (e.g. a non-int in a packed array)
    ├── ValueOverflowError(OverflowError)      a value does not fit its fixed-width field (e.g. int32 ids)
    ├── WireError(ValueError)                  a frame is truncated, oversized, corrupted or of an unknown kind
    │   └── SchemaMismatchError                the peer speaks an incompatible schema version (names both)
    ├── HostMemoryError(MemoryError)           the host pool cannot be sized or allocated (with the numbers)
    ├── InvalidStateError(RuntimeError)        an API was called out of order (e.g. loading a key not ready)
    ├── TransferError(RuntimeError)            a copy between engine memory and the host pool failed
    ├── WorkerError(RuntimeError)              a worker process died, stalled, failed or refused the handshake
    ├── DeadlineError(TimeoutError)            nothing arrived, or a run did not finish, within its deadline
    ├── TierError(OSError)                     a secondary tier (disk, Valkey) failed an operation or is down
    │   └── RecordError                        a tier record is malformed: bad magic, version, key, length, checksum
    └── VerificationError(RuntimeError)        reloaded KV bytes differ from what was stored (demo/checks)

Validation never uses ``assert``: every check raises one of these with a message that names the offending
field and value. The only other exceptions raised on purpose are Python protocol ones: ``KeyError`` from a
mapping-style lookup (``Explanation.find``) and ``NotImplementedError`` from a msgspec schema hook.
"""

from __future__ import annotations

__all__ = [
    "ArgumentTypeError",
    "ConfigClassError",
    "ConfigError",
    "ConfigImportError",
    "ConfigModuleNotFoundError",
    "DeadlineError",
    "HostMemoryError",
    "InvalidStateError",
    "KVOffloadError",
    "OffloadingConfigError",
    "RecordError",
    "SchemaMismatchError",
    "TierError",
    "TierUnusableError",
    "TransferError",
    "ValueOverflowError",
    "VerificationError",
    "WireError",
    "WorkerError",
]


class KVOffloadError(Exception):
    """Base class of every error kvoffload raises deliberately."""


class ConfigError(KVOffloadError, ValueError):
    """An engine snapshot, config or argument holds an invalid value."""


class OffloadingConfigError(ConfigError):
    """The input violates a rule of vLLM 0.33's ``build_offloading_config``.

    The message is vLLM's own text, so logs read the same on both sides. ``vllm_exception`` names the
    exception type vLLM raises for the same input (``"ValueError"`` or ``"AssertionError"``).
    """

    def __init__(self, message: str, *, vllm_exception: str = "ValueError") -> None:
        super().__init__(message)
        self.vllm_exception = vllm_exception


class ConfigImportError(ConfigError, ImportError):
    """A configured out-of-tree class (a tier's ``module_path``, a ``policy_cls``) cannot be imported.

    Both a :class:`ConfigError` (the message names the config entry and the module) and an ``ImportError``, as
    vLLM's users see an unimportable ``module_path``; the import's own error is chained as ``__cause__``.
    """


class ConfigModuleNotFoundError(ConfigImportError, ModuleNotFoundError):
    """A configured ``module_path`` names no module: a ``ModuleNotFoundError``, as vLLM raises."""


class ConfigClassError(ConfigError, AssertionError):
    """A configured out-of-tree class is not of the kind it must be (a tier class that is not a tier).

    vLLM refuses it with ``assert issubclass(...)``; this is also an ``AssertionError`` so code written against
    vLLM catches it, while kvoffload never uses ``assert`` to validate.
    """


class ArgumentTypeError(KVOffloadError, TypeError):
    """An argument has the wrong type (e.g. a non-integer packed into an id array, a non-message encoded)."""


class ValueOverflowError(KVOffloadError, OverflowError):
    """A value does not fit its fixed-width field (e.g. an id outside int32 in a packed array)."""


class WireError(KVOffloadError, ValueError):
    """A wire frame could not be decoded: truncated, oversized, corrupted or of an unknown kind."""


class SchemaMismatchError(WireError):
    """The peer's schema version cannot be read by this process (different major version)."""

    def __init__(self, message: str, *, local_version: str, remote_version: str) -> None:
        super().__init__(message)
        self.local_version = local_version
        self.remote_version = remote_version


class HostMemoryError(KVOffloadError, MemoryError):
    """The host pool cannot be sized from the budget or does not fit in available memory."""


class InvalidStateError(KVOffloadError, RuntimeError):
    """An API call does not fit the current state (a protocol misuse by the caller)."""


class TransferError(KVOffloadError, RuntimeError):
    """A copy between engine KV memory and the host pool failed."""


class WorkerError(KVOffloadError, RuntimeError):
    """A worker process died, timed out or refused the handshake."""


class DeadlineError(KVOffloadError, TimeoutError):
    """Nothing arrived within a receive timeout, or a run did not finish within its step or time budget."""


class TierError(KVOffloadError, OSError):
    """A secondary tier failed an operation (IO error, disk full, server down); the tier turns unavailable."""


class RecordError(TierError):
    """A tier record failed verification (magic, format version, key, length or checksum): treated as a miss.

    ``damaged`` is False for a sound record this reader cannot verify (a BLAKE3 MAC without the ``blake3``
    package): a miss here, but the record stays on the tier for the readers that can verify it.
    """

    def __init__(self, message: str, *, damaged: bool = True) -> None:
        super().__init__(message)
        self.damaged = damaged


class TierUnusableError(ConfigError, TierError):
    """A configured tier cannot be used when the engine starts (a ``root_dir`` that is a file, a server that is
    not there): a :class:`ConfigError` naming the tier, and an ``OSError`` as vLLM's tier constructors raise."""


class VerificationError(KVOffloadError, RuntimeError):
    """Reloaded KV bytes differ from the bytes that were stored."""
