"""mypy reveal_type examples: decoders return concrete types, never Any (checked by tests/test_typing.py)."""

from __future__ import annotations

from typing import reveal_type

from kvoffload import EngineSnapshot, OffloadingConfig, StepPlan, codecs
from kvoffload._packed import Int64Array, pack_int32, pack_int64

snapshot = codecs.decode(b"{}", EngineSnapshot, format="json")
reveal_type(snapshot)  # revealed: kvoffload._generated.types.EngineSnapshot
reveal_type(snapshot.kv_cache_config.kv_cache_groups)  # revealed: tuple[kvoffload._generated.types.KVCacheGroupSpec, ...]
reveal_type(snapshot.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size)  # revealed: int
reveal_type(snapshot.engine_config.kv_transfer_config)  # revealed: kvoffload._generated.types.KVTransferConfig | None
reveal_type(codecs.decode("{}", type=EngineSnapshot, format="json"))  # revealed: kvoffload._generated.types.EngineSnapshot
reveal_type(codecs.decode(b"", OffloadingConfig))  # revealed: kvoffload._generated.types.OffloadingConfig
reveal_type(codecs.decode(memoryview(b""), StepPlan, format="msgpack").load_jobs[0].block_ids)  # revealed: kvoffload._packed.Int64Bytes
reveal_type(codecs.MESSAGE_DECODERS[2](b""))  # revealed: kvoffload._generated.types.Hello | kvoffload._generated.types.StepPlan | kvoffload._generated.types.WorkerReport | kvoffload._generated.types.Shutdown | kvoffload._generated.types.KVEventBatch | kvoffload._generated.types.WorkerFailure | kvoffload._generated.types.Heartbeat
reveal_type(codecs.encode(snapshot, format="json"))  # revealed: bytes
reveal_type(codecs.encode(snapshot))  # revealed: bytes
reveal_type(pack_int64([1, 2]))  # revealed: kvoffload._packed.Int64Bytes
reveal_type(pack_int32([1, 2]))  # revealed: kvoffload._packed.Int32Bytes
reveal_type(Int64Array.from_buffer(pack_int64([1]))[0])  # revealed: int
