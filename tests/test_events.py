"""KV events over real ZMQ sockets: order, sequence numbers, gaps (injected and from drops), errors."""

from __future__ import annotations

import time

import pytest
import zmq

from kvoffload import (
    BlockRemoved,
    BlockStored,
    ConfigError,
    JobResult,
    KVEventBatch,
    Medium,
    WireError,
    WorkerReport,
    wire,
)
from kvoffload._events import DEFAULT_TOPIC, KVEventPublisher, KVEventSubscriber
from kvoffload.offload.manager import HostBlockManager
from kvoffload.offload.scheduler import OffloadScheduler
from tests.helpers import chained_hashes as _hashes
from tests.helpers import offloading_config


def _connected(endpoint: str) -> tuple[KVEventPublisher, KVEventSubscriber]:
    pub = KVEventPublisher(endpoint, engine_id="engine-a")
    sub = KVEventSubscriber(pub.endpoint)
    assert pub.wait_for_subscriber(10.0)
    return pub, sub


def test_scheduler_events_arrive_in_order_with_sequence_numbers() -> None:
    manager = HostBlockManager(4, enable_events=True)
    sched = OffloadScheduler(offloading_config(events=True), manager)
    pub, sub = _connected("tcp://127.0.0.1:0")
    published: list[tuple[object, ...]] = []
    try:
        for i in range(6):  # each request stores 4 chunks: from the second on, the previous 4 are evicted
            hs = _hashes(f"r{i}", 4)
            sched.add_request(f"r{i}", hs, 64)
            sched.on_blocks_allocated(f"r{i}", [[1, 2, 3, 4]])
            sched.on_tokens_computed(f"r{i}", 64)
            plan = sched.build_step_plan()
            results = tuple(
                JobResult(job_id=j.job_id, success=True, is_store=True, num_bytes=1, seconds=0.0)
                for j in plan.store_jobs
            )
            sched.on_worker_reports([WorkerReport(rank=0, step=plan.step, results=results)])
            sched.finish_request(f"r{i}")
            events = sched.take_events()
            assert pub.publish(events)
            published.append(tuple(events))
        received = []
        while len(received) < len(published):
            got = sub.recv(timeout_s=10.0)
            assert got is not None, f"only {len(received)} of {len(published)} batches arrived"
            received.append(got)
    finally:
        sub.close()
        pub.close()
    assert [r.batch.seq for r in received] == list(range(6))
    assert all(r.gap is None for r in received) and sub.gaps == [] and sub.missed == 0
    assert [r.events for r in received] == published
    assert {r.batch.engine_id for r in received} == {"engine-a"}
    kinds = [type(e).__name__ for r in received for e in r.events]
    assert kinds.count("BlockStored") == 24 and kinds.count("BlockRemoved") == 5
    assert pub.sent == 6 and pub.dropped == 0 and pub.next_seq == 6


def test_tier_events_carry_their_medium() -> None:
    pub, sub = _connected("tcp://127.0.0.1:0")
    try:
        events = [
            BlockStored(block_hashes=(b"h1",), group_idx=0, medium=Medium.STORAGE),
            BlockRemoved(block_hashes=(b"h0",), group_idx=0, medium=Medium.CPU),
        ]
        assert pub.publish(events)
        got = sub.recv(timeout_s=10.0)
    finally:
        sub.close()
        pub.close()
    assert got is not None and [e.medium for e in got.events] == [Medium.STORAGE, Medium.CPU]


def _raw_batch(seq: int, engine_id: str = "raw") -> list[bytes]:
    batch = KVEventBatch(ts=time.time(), events=(BlockStored(block_hashes=(b"x",)),), seq=seq, engine_id=engine_id)
    return [DEFAULT_TOPIC, bytes(wire.encode(batch)[0])]


def test_subscriber_reports_an_injected_gap_and_a_restart() -> None:
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.XPUB)
    raw.setsockopt(zmq.LINGER, 0)
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    sub = KVEventSubscriber(f"tcp://127.0.0.1:{port}")
    try:
        assert raw.poll(10_000) and raw.recv()[:1] == b"\x01"  # the subscription arrived
        for seq in (0, 1, 3, 4, 0):  # batch 2 never sent; then the publisher restarts
            raw.send_multipart(_raw_batch(seq))
        got = [sub.recv(timeout_s=10.0) for _ in range(5)]
    finally:
        sub.close()
        raw.close(0)
    assert all(g is not None for g in got)
    gaps = [g.gap for g in got if g is not None]
    assert gaps[0] is None and gaps[1] is None and gaps[3] is None and gaps[4] is None
    gap = gaps[2]
    assert gap is not None and (gap.engine_id, gap.expected, gap.received, gap.missed) == ("raw", 2, 3, 1)
    assert sub.missed == 1 and sub.restarts == 1


def test_a_full_publisher_queue_never_blocks_publish_and_drops_are_counted_as_gaps() -> None:
    # queue=1: publish() outruns the publisher's thread, so it drops (hands over at most 2 batches unsent)
    pub, sub = KVEventPublisher("tcp://127.0.0.1:0", queue=1), None
    try:
        sub = KVEventSubscriber(pub.endpoint)
        assert pub.wait_for_subscriber(10.0)
        events = [BlockStored(block_hashes=(b"h",))]
        outcomes = [pub.publish(events) for _ in range(2000)]
        assert pub.dropped > 0 and pub.sent + pub.dropped == 2000 and outcomes.count(False) == pub.dropped
        seqs = []
        while (got := sub.recv(timeout_s=0.5)) is not None:
            seqs.append(got.batch.seq)
        # every batch handed over arrived, in order (the subscriber's own queue had room); the drops are its gaps
        assert seqs == sorted(seqs) and len(seqs) == pub.sent and pub.undelivered == 0
        assert sub.missed + (pub.next_seq - 1 - seqs[-1]) + seqs[0] == pub.dropped
    finally:
        if sub is not None:
            sub.close()
        pub.close()
    assert not pub.publish(events) and pub.dropped == 2000 - pub.sent + 1  # closed: dropped, counted


def test_malformed_message_and_bad_endpoints() -> None:
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.XPUB)
    raw.setsockopt(zmq.LINGER, 0)
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    sub = KVEventSubscriber(f"tcp://127.0.0.1:{port}")
    try:
        assert raw.poll(10_000) and raw.recv()
        raw.send_multipart([DEFAULT_TOPIC, b"KVOW not a frame"])
        with pytest.raises(WireError):
            sub.recv(timeout_s=10.0)
        raw.send_multipart([DEFAULT_TOPIC])
        with pytest.raises(WireError, match="2 frames"):
            sub.recv(timeout_s=10.0)
        assert sub.recv(timeout_s=0.05) is None
    finally:
        sub.close()
        raw.close(0)
    with pytest.raises(ConfigError, match="not-an-endpoint"):
        KVEventPublisher("not-an-endpoint")
    with pytest.raises(ConfigError, match="cannot bind"):
        KVEventPublisher("tcp://256.0.0.1:1")
    with pytest.raises(ConfigError, match="hwm"):
        KVEventPublisher("tcp://127.0.0.1:0", hwm=0)
    with pytest.raises(ConfigError, match="queue"):
        KVEventPublisher("tcp://127.0.0.1:0", queue=0)
    with pytest.raises(ConfigError, match="max_message_bytes"):
        KVEventSubscriber("tcp://127.0.0.1:5557", max_message_bytes=0)
    with KVEventPublisher("tcp://127.0.0.1:0") as pub:
        assert not pub.publish([]) and pub.next_seq == 0
