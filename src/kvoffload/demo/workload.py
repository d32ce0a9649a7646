"""The demo's workload: its options, the requests of a multi-turn chat, and the engine's block pool.

The workload is bounded up front (:func:`check_options`): at most :data:`MAX_REQUESTS` requests over at most
:data:`MAX_CONVERSATIONS` conversations, so the checks that replay it and the histories it keeps stay small.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvoffload._generated import OffloadingGroupConfig, TieringConfig
from kvoffload._ints import cdiv, check_int
from kvoffload.demo.snapshots import MiB
from kvoffload.errors import ConfigError
from kvoffload.offload.keys import BlockHash, hash_token_blocks
from kvoffload.runtime.cluster import DEFAULT_WORKER_TIMEOUT_S

__all__ = [
    "DEFAULT_OPTIONS",
    "MAX_CONVERSATIONS",
    "MAX_REQUESTS",
    "BlockPool",
    "DemoOptions",
    "Request",
    "Workload",
    "check_options",
    "check_workload_fits",
    "longest_conversation_tokens",
]


@dataclass(frozen=True)
class DemoOptions:
    """Knobs of the demo workload."""

    requests: int = 48
    conversations: int = 8
    system_prompt_tokens: int = 512
    turn_tokens: tuple[int, int] = (64, 384)
    decode_tokens: int = 16
    max_running: int = 4
    max_batched_tokens: int = 2048
    """Tokens the engine computes per step, prompt chunks and decodes together (vLLM's
    ``max_num_batched_tokens``, chunked prefill): a recomputed prompt costs steps, as in a real engine."""
    seed: int = 0
    shared_pool: bool = False
    memcpy_probe_bytes: int = 64 * MiB
    step_timeout_s: float = 120.0
    worker_timeout_s: float = DEFAULT_WORKER_TIMEOUT_S
    tiering: TieringConfig | None = None


DEFAULT_OPTIONS = DemoOptions()
"""The options of a plain ``kvoffload demo``."""

MAX_REQUESTS = 10_000
"""The most requests one demo run takes (``--requests``): the up-front workload check replays every one."""

MAX_CONVERSATIONS = 10_000
"""The most concurrent conversations (``--conversations``): each keeps its whole history in memory."""


def check_options(options: DemoOptions) -> None:
    """Raise ConfigError naming the option, its value and its bound when the workload is out of range."""
    check_int("requests", options.requests, 1, MAX_REQUESTS, value_first=True)
    check_int("conversations", options.conversations, 1, MAX_CONVERSATIONS, value_first=True)
    check_int("max_batched_tokens", options.max_batched_tokens, 1, value_first=True)


@dataclass
class Request:
    req_id: str
    conversation: int
    tokens: list[int]
    prompt_len: int
    decode_left: int
    hashes: list[BlockHash]
    blocks: list[list[int]] = field(default_factory=list)
    num_computed: int = 0
    loaded: int = 0
    attempt: int = 0
    """Admissions that ended in a failed load (the engine freed its blocks and admitted it again)."""

    @property
    def sid(self) -> str:
        """The id the offload scheduler knows this admission by: a fresh one after each failed load."""
        return self.req_id if not self.attempt else f"{self.req_id}#retry{self.attempt}"


class BlockPool:
    """The engine's free block ids: the never-used ones first, in order, then the released ones, first released
    first. Never-used ids are a counter, so the pool costs memory for the blocks in use, not for ``num_blocks``."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._next_fresh = 0
        self._released: deque[int] = deque()

    @property
    def num_free(self) -> int:
        return self.num_blocks - self._next_fresh + len(self._released)

    def allocate(self, n: int) -> list[int] | None:
        if n > self.num_free:
            return None
        fresh = min(n, self.num_blocks - self._next_fresh)
        blocks = list(range(self._next_fresh, self._next_fresh + fresh))
        self._next_fresh += fresh
        blocks.extend(self._released.popleft() for _ in range(n - fresh))
        return blocks

    def release(self, blocks: Sequence[int]) -> None:
        self._released.extend(blocks)


class Workload:
    """Conversations that alternate user turns and generated replies; the next turn needs the last reply."""

    def __init__(self, options: DemoOptions, tokens_per_hash: int) -> None:
        self.options = options
        self.tph = tokens_per_hash
        self.rng = random.Random(options.seed)
        system = [self.rng.randrange(1, 32000) for _ in range(options.system_prompt_tokens)]
        self.history = [list(system) for _ in range(options.conversations)]
        self.ready = deque(range(options.conversations))
        self.issued = 0

    def next_request(self) -> Request | None:
        if self.issued >= self.options.requests or not self.ready:
            return None
        conv = self.ready.popleft()
        tokens = self.history[conv] + self.next_turn()
        self.issued += 1
        return Request(
            req_id=f"conv{conv}-turn{self.issued}",
            conversation=conv,
            tokens=tokens,
            prompt_len=len(tokens),
            decode_left=self.options.decode_tokens,
            hashes=hash_token_blocks(tokens, self.tph),
        )

    def next_turn(self) -> list[int]:
        """The next user turn's tokens (its length and tokens come from the seed, whichever conversation)."""
        lo, hi = self.options.turn_tokens
        return [self.rng.randrange(1, 32000) for _ in range(self.rng.randint(lo, hi))]

    def finished(self, req: Request) -> None:
        self.history[req.conversation] = list(req.tokens)
        self.ready.append(req.conversation)


def check_workload_fits(
    options: DemoOptions, tokens_per_hash: int, groups: Sequence[OffloadingGroupConfig], num_blocks: int
) -> None:
    """Refuse up front a workload whose longest conversation can never fit the engine block pool.

    The turn lengths are replayed from the seed (they do not depend on scheduling); which conversation gets
    which turn does, so the bound is the least the longest conversation must reach: the system prompt, an
    even share of all turns, and one reply. A workload passing this check may still grow one conversation past
    the pool; the engine then refuses that request as soon as it comes up (never a livelock).
    """
    check_options(options)
    workload = Workload(options, tokens_per_hash)
    system = len(workload.history[0])
    turns = sum(len(workload.next_turn()) for _ in range(options.requests))  # the turn lengths, replayed
    share = cdiv(turns, options.conversations)
    tokens = system + share + options.decode_tokens
    need = sum(cdiv(tokens, g.tokens_per_block) for g in groups)
    if need > num_blocks:
        raise ConfigError(
            f"the workload cannot run: its longest conversation reaches at least {tokens} tokens ({system} system "
            f"prompt + {share} of {turns} turn tokens over {options.conversations} conversations + "
            f"{options.decode_tokens} decoded), {need} engine blocks, but the engine block pool has "
            f"num_blocks={num_blocks} (use fewer --requests, more --conversations, or more num_blocks)"
        )


def longest_conversation_tokens(options: DemoOptions) -> int:
    """A generous bound on the tokens one conversation reaches: system prompt, and one turn more than an even
    share of the requests, each of the longest turn length plus its reply (used to size a shrunk snapshot)."""
    turns = min(options.requests, cdiv(options.requests, options.conversations) + 1)
    return options.system_prompt_tokens + turns * (options.turn_tokens[1] + options.decode_tokens)
