"""vLLM's own spec objects -> snapshot documents (schema 1.6): ``Fraction(1, n)``, the hidden-state cache and the
circular buffer, checked against the installed vLLM's page sizes and prefix-cacheability."""

from __future__ import annotations

from fractions import Fraction

import msgspec
import pytest

from kvoffload import ConfigError, KVCacheSpec
from kvoffload._generated import CircularBufferSpec, HiddenStateCacheSpec
from kvoffload.translate._spec_math import num_states, page_size_bytes, prefix_cacheable

torch = pytest.importorskip("torch")
interface = pytest.importorskip("vllm.v1.kv_cache_interface")

from kvoffload.integrations.vllm._snapshot import _spec_document  # noqa: E402  (imports vllm)


def _ours(spec: object) -> KVCacheSpec:
    return msgspec.convert(_spec_document(spec, "kv_cache_groups[0].kv_cache_spec"), KVCacheSpec)


@pytest.mark.parametrize("n", [1, 2, 4, 7])
def test_fraction_one_over_n_becomes_states_per_token(n: int) -> None:
    spec = interface.FullAttentionSpec(
        block_size=16, num_kv_heads=4, head_size=128, dtype=torch.float16, tokens_per_state=Fraction(1, n)
    )
    document = _spec_document(spec, "kv_cache_groups[0].kv_cache_spec")
    assert (document["tokens_per_state"], document["states_per_token"]) == (1, n)
    ours = _ours(spec)
    assert num_states(ours) == spec.num_states == 16 * n
    assert page_size_bytes(ours) == spec.page_size_bytes


def test_an_int_tokens_per_state_is_kept() -> None:
    spec = interface.MLAAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, tokens_per_state=4
    )
    document = _spec_document(spec, "kv_cache_groups[0].kv_cache_spec")
    assert document["tokens_per_state"] == 4 and "states_per_token" not in document
    assert page_size_bytes(_ours(spec)) == spec.page_size_bytes


@pytest.mark.parametrize("value", [Fraction(2, 3), Fraction(3, 1)])
def test_other_fractions_are_refused_naming_the_attribute(value: Fraction) -> None:
    spec = interface.FullAttentionSpec(
        block_size=16, num_kv_heads=4, head_size=128, dtype=torch.float16, tokens_per_state=value
    )
    with pytest.raises(ConfigError) as err:
        _spec_document(spec, "kv_cache_groups[2].kv_cache_spec")
    message = str(err.value)
    assert message.startswith(
        f"kv_cache_groups[2].kv_cache_spec.tokens_per_state=Fraction({value.numerator}, {value.denominator}):"
    )
    assert "Fraction(1, n)" in message


def test_hidden_state_cache_and_circular_buffer_map_to_their_kinds() -> None:
    hidden = interface.HiddenStateCacheSpec(
        block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, alignment=4096
    )
    ours = _ours(hidden)
    assert type(ours) is HiddenStateCacheSpec
    assert page_size_bytes(ours) == hidden.page_size_bytes and prefix_cacheable(ours) == hidden.prefix_cacheable
    ring = interface.CircularBufferSpec(
        block_size=64, num_kv_heads=4, head_size=128, dtype=torch.float16, tokens_per_state=Fraction(1, 2)
    )
    ours_ring = _ours(ring)
    assert type(ours_ring) is CircularBufferSpec and ours_ring.states_per_token == 2
    assert page_size_bytes(ours_ring) == ring.page_size_bytes
    assert prefix_cacheable(ours_ring) is ring.prefix_cacheable is False
