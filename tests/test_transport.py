"""Trajectory and weight channels over real ZeroMQ sockets (loopback tcp and ipc)."""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest
import zmq

from asyncvla.common.transport import protocol as P
from asyncvla.common import transport
from asyncvla.common.transport.sockets import bound_endpoint
from asyncvla.common.transport.segment_channel import ack_count, ack_frame
from tests.support.paths import REPO
from tests.support.segments import make_segment, make_spec, process_token
from tests.support.sockets import deep_list, hostile_requests, reasons_of, send_raw, tcfg, wait_until
from tests.support.wire import header_of, pack_header


def subscriber(endpoint: str, cfg, actor_id: str = "a", **kw) -> transport.WeightSubscriber:
    """A weight subscriber with the token this process's servers give `actor_id`."""
    return transport.WeightSubscriber(endpoint, cfg, actor_id=actor_id, token=process_token(actor_id), **kw)


@pytest.fixture(params=["tcp", "ipc"])
def endpoint(request, tmp_path):
    return "tcp://127.0.0.1:*" if request.param == "tcp" else f"ipc://{tmp_path}/traj.sock"


def digest(seg: P.Segment) -> str:
    h = hashlib.sha1()
    for k in sorted(seg.arrays):
        h.update(k.encode() + seg.arrays[k].tobytes())
    return h.hexdigest()


def frame_of(arr: np.ndarray):
    """The object at the root of an array's buffer chain (a zmq.Frame when decoded zero-copy)."""
    obj = arr
    while True:
        nxt = obj.obj if isinstance(obj, memoryview) else getattr(obj, "base", None)
        if nxt is None:
            return obj
        obj = nxt


# -------------------------------------------------------------------------------- trajectories
def test_realistic_segment_round_trip_zero_copy(endpoint):
    spec = make_spec(T=16, B=8, H=128)
    seg = make_segment(spec)
    cfg = tcfg(fast=False)
    receiver = transport.SegmentReceiver(cfg, 0, spec, endpoint=endpoint)
    sender = transport.SegmentSender([receiver.endpoint], cfg)
    try:
        assert sender.send(seg)
        out = receiver.recv(timeout_ms=10_000)
        assert out is not None and out.meta == {k: v for k, v in seg.meta.items() if k != "token"}
        for k, a in seg.arrays.items():
            assert out.arrays[k].dtype == a.dtype and out.arrays[k].shape == a.shape
            assert out.arrays[k].tobytes() == a.tobytes(), k
        image = out.arrays["image"]
        assert image.nbytes == 17 * 8 * 128 * 128 * 3
        root = frame_of(image)
        assert isinstance(root, zmq.Frame)           # the array views the received frame itself
        assert np.shares_memory(image, np.frombuffer(root.buffer, np.uint8))
        assert receiver.stats["received"] == 1 and not receiver.stats["invalid"]
    finally:
        sender.close()
        receiver.close()


@pytest.fixture
def two_ranks():
    """(spec, [rank 0 and rank 1 receivers], a sender connected to both), connections complete."""
    spec = make_spec(T=2, B=1, H=8, L=4)
    cfg = tcfg(fast=False)
    ranks = [transport.SegmentReceiver(cfg, r, spec, endpoint="tcp://127.0.0.1:*") for r in range(2)]
    sender = transport.SegmentSender([r.endpoint for r in ranks], cfg)
    wait_until(lambda: False, timeout=0.3)
    yield spec, ranks, sender
    sender.close()
    for r in ranks:
        r.close()


def test_segments_spread_over_learner_ranks(two_ranks):
    spec, ranks, sender = two_ranks
    for i in range(40):
        sender.send(make_segment(spec, B=1, seq=i, truncations=0))
    got = [[], []]
    deadline = time.monotonic() + 10
    while sum(map(len, got)) < 40 and time.monotonic() < deadline:
        for r, rx in enumerate(ranks):
            seg = rx.recv(timeout_ms=10)
            if seg is not None:
                got[r].append(seg.meta["seq"])
    assert sorted(got[0] + got[1]) == list(range(40))
    assert got[0] and got[1]


def test_in_flight_counts_segments_until_a_rank_takes_them(two_ranks):
    spec, ranks, sender = two_ranks
    for i in range(3):
        assert sender.send(make_segment(spec, B=1, seq=i, truncations=0))
    time.sleep(0.2)                               # delivered, but no rank has taken one
    assert sender.in_flight == 3
    assert not sender.wait_for_room(3, timeout=0.2)
    taken, deadline = 0, time.monotonic() + 10
    while taken < 2 and time.monotonic() < deadline:     # two taken, by the ranks that hold them
        for rx in ranks:
            if taken < 2 and rx.recv(timeout_ms=10) is not None:
                taken += 1
    assert sender.wait_for_room(2, timeout=5.0)   # the acks arrive
    assert sender.in_flight == 1 and not sender.wait_for_room(1, timeout=0.2)
    sender.forget_in_flight()                     # a learner restart: nothing is owed any more
    assert sender.in_flight == 0 and sender.wait_for_room(1, timeout=0)


def test_a_rank_acks_what_it_took_at_once_with_one_count_per_actor():
    spec = make_spec(T=2, B=1, H=8, L=4, K=2, D=2)
    cfg = tcfg(fast=False)
    rx = transport.SegmentReceiver(cfg, 0, spec, endpoint="tcp://127.0.0.1:*")
    senders = [transport.SegmentSender([rx.endpoint], cfg) for _ in range(2)]
    ctx = zmq.Context()
    spy = ctx.socket(zmq.DEALER)                  # sees its acks frame by frame
    spy.connect(rx.endpoint)
    try:
        for i in range(5):
            senders[i % 2].send(make_segment(spec, B=1, seq=i, truncations=0))
        spy_frames = P.encode_segment(make_segment(spec, B=1, seq=9, truncations=0))
        for _ in range(3):
            spy.send_multipart(spy_frames)
        time.sleep(0.3)                           # all 8 have arrived
        assert len(rx.recv_many(3, timeout_ms=5000)) == 3          # what has arrived, up to 3
        got = rx.recv_many(100, timeout_ms=5000)                    # the rest, without waiting
        assert len(got) == 5 and rx.recv_many(100, timeout_ms=100) == []
        assert wait_until(lambda: all(s.in_flight == 0 for s in senders))
        acks = []
        while spy.poll(200):
            acks.append(ack_count(spy.recv()))
        assert sum(acks) == 3 and len(acks) <= 2  # counted per call, not one ack per segment
        assert ack_count(b"") == 0 and ack_count(b"x" * 5) == 0
    finally:
        spy.close(0)
        ctx.term()
        for s in senders:
            s.close()
        rx.close()


def test_an_ack_never_counts_more_than_was_sent():
    ctx = zmq.Context()
    fake = ctx.socket(zmq.ROUTER)                 # a "learner" that acks far too much
    fake.bind("tcp://127.0.0.1:*")
    sender = transport.SegmentSender([bound_endpoint(fake)], tcfg(fast=False))
    try:
        spec = make_spec(T=2, B=1, H=8, L=4, K=2, D=2)
        for i in range(2):
            sender.send(make_segment(spec, B=1, seq=i, truncations=0))
        assert fake.poll(5000)
        peer = fake.recv_multipart()[0]
        fake.send_multipart([peer, ack_frame(10**6)])
        assert sender.wait_for_room(1, timeout=5)
        assert sender.in_flight == 0 and sender.acked == 2
    finally:
        sender.close()
        fake.close(0)
        ctx.term()


def _fuzz_messages(spec, count, rng):
    """(frames, kind) pairs: kind 'good' (valid, checked on arrival), 'flip' (a random header
    byte flipped: usually invalid, may by chance stay valid) or 'bad' (invalid by construction)."""
    base = [bytes(memoryview(f).cast("B")) if not isinstance(f, bytes) else f
            for f in P.encode_segment(make_segment(spec, B=2, truncations=1, episodes=1, actor_id="fuzz"))]
    names = [a[0] for a in header_of(base[0])["layout"]]

    def mutated(i):
        frames = list(base)
        choice = i % 12
        if choice == 0:
            return [rng.bytes(int(rng.integers(0, 300))) for _ in range(int(rng.integers(1, 6)))], "bad"
        if choice == 1:
            h = bytearray(frames[0])
            h[int(rng.integers(len(h)))] ^= int(rng.integers(1, 256))
            return [bytes(h)] + frames[1:], "flip"
        if choice == 2:
            return [frames[0][: int(rng.integers(0, len(frames[0])))]] + frames[1:], "bad"
        if choice == 3:
            k = int(rng.integers(1, len(frames)))
            cut = frames[k][: max(0, len(frames[k]) - int(rng.integers(1, 9)))] if frames[k] else b"x"
            return frames[:k] + [cut] + frames[k + 1:], "bad"
        if choice == 4:
            return frames[: int(rng.integers(1, len(frames)))], "bad"
        if choice == 5:
            return frames + [rng.bytes(8)] * int(rng.integers(1, 40)), "bad"
        h = header_of(frames[0])
        entry = h["layout"][int(rng.integers(len(names)))]
        if choice == 6:
            entry[1] = str(rng.choice(["float64", "object", "O", "<U8", "complex64", "V8"]))
        elif choice == 7:
            entry[2] = [int(d) for d in rng.integers(-3, 1 << 31, size=int(rng.integers(0, 10)))]
        elif choice == 8:
            h["v"] = int(rng.integers(2, 1000))
        elif choice == 9:
            h["meta"]["num_steps"] = int(rng.integers(5, 1 << 40))
        elif choice == 10:                      # NaN into a float field
            msg = P.decode(frames, P.Limits.for_kind(P.SEGMENT, 1))
            arrays = {k: v.copy() for k, v in msg.arrays.items()}
            arrays["rewards"].flat[int(rng.integers(arrays["rewards"].size))] = np.nan
            return P.encode(P.SEGMENT, msg.meta, arrays), "bad"
        else:                                   # over the total size limit, each frame under it
            return [frames[0]] + [bytes(400 << 10)] * 3, "bad"
        return [pack_header(h)] + frames[1:], "bad"

    for i in range(count):
        if i % 20 == 0:
            seg = make_segment(spec, B=2, seq=i, truncations=int(rng.integers(0, 3)),
                               episodes=int(rng.integers(0, 3)), actor_id="good", rng=rng)
            yield P.encode_segment(seg), "good", digest(seg)
        else:
            frames, kind = mutated(i)
            yield frames, kind, None


def test_fuzzed_messages_are_counted_and_valid_ones_arrive_intact(caplog):
    spec = make_spec(T=4, B=2, H=16, L=8, K=2, D=3, S=3)
    cfg = tcfg(fast=False, max_message_mb=1, recv_hwm=64)
    receiver = transport.SegmentReceiver(cfg, 0, spec, endpoint="tcp://127.0.0.1:*")
    accepted, errors, done = [], [], threading.Event()

    def drain():
        try:
            while not done.is_set():
                seg = receiver.recv(timeout_ms=50)
                if seg is not None:
                    accepted.append((seg.meta["actor_id"], seg.meta["seq"], digest(seg)))
        except Exception as e:          # the test fails on any crash of the receiving side
            errors.append(e)

    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    oversize = ctx.socket(zmq.DEALER)     # frames over MAXMSGSIZE: ZeroMQ cuts that connection
    for s in (dealer, oversize):
        s.linger = 1000
        s.connect(receiver.endpoint)
    thread = threading.Thread(target=drain)
    thread.start()
    rng = np.random.default_rng(1)
    sent = {"good": {}, "flip": 0, "bad": 0}
    count = 10_500
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="asyncvla.transport"):
        for i, (frames, kind, dig) in enumerate(_fuzz_messages(spec, count, rng)):
            dealer.send_multipart(frames)
            if kind == "good":
                sent["good"][i] = dig
            else:
                sent[kind] += 1
            if i % 3000 == 0:
                oversize.send(bytes((1 << 20) + 1))
        assert wait_until(lambda: len(accepted) + sum(receiver.stats["invalid"].values()) >= count, 60)
        time.sleep(0.2)
        done.set()
        thread.join()
    dealer.close()
    oversize.close()
    ctx.term()
    receiver.close()

    assert not errors
    invalid = receiver.stats["invalid"]
    good = {seq: dig for actor, seq, dig in accepted if actor == "good"}
    assert good == sent["good"]                                     # every valid one, intact
    assert len(accepted) + sum(invalid.values()) == count           # each message counted once
    assert len(accepted) - len(good) <= sent["flip"]                # only a lucky flip may pass
    assert sum(invalid.values()) >= sent["bad"]
    assert {"bad_header", "frame_count", "frame_size", "bad_dtype", "bad_shape", "schema_version",
            "not_finite", "too_large"} <= set(invalid)
    # logging is rate-bounded: a line per reason, then at most one per reason every 10 s
    assert len(caplog.records) <= len(invalid) * (1 + (time.monotonic() - started) // 10)
    assert len(caplog.records) < 100


# ---------------------------------------------------------------------- hostile peers, each channel
def in_action_range(seg: P.Segment, first: int, vocab: int) -> P.Segment:
    seg.arrays["action_tokens"] = seg.arrays["action_tokens"] % (vocab - first) + first
    return seg


def test_segment_receiver_drops_hostile_segments_and_keeps_serving():
    spec = make_spec(T=2, B=2, H=8, L=4, K=2, D=2, vocab=512)
    spec = P.SegmentSpec(**{**spec.__dict__, "first_action_id": 256, "max_abs_reward": 1e4})
    good = in_action_range(make_segment(spec, B=2, truncations=1, episodes=1), 256, 512)
    frames = [bytes(memoryview(f).cast("B")) for f in P.encode_segment(good)]
    header = header_of(frames[0])

    def with_array(name, fn):
        arrays = {k: v.copy() for k, v in good.arrays.items()}
        fn(arrays[name])
        return P.encode_segment(P.Segment(good.meta, arrays))

    huge = header_of(frames[0])
    next(e for e in huge["layout"] if e[0] == "rewards")[2] = [1 << 62, 1 << 62, 0]
    cases = {"too_deep": [pack_header({**header, "layout": header["layout"] + [deep_list(1000)]})] + frames[1:],
             "bad_shape": [pack_header(huge)] + frames[1:],
             "frame_count": frames + [bytes(1000)] * 40,
             "bad_token": with_array("action_tokens", lambda a: a.__setitem__((0, 0, 0), 255)),
             "bad_reward": with_array("rewards", lambda a: a.__setitem__((0, 0), 3e38))}
    cfg = tcfg(fast=False)
    receiver = transport.SegmentReceiver(cfg, 0, spec, endpoint="tcp://127.0.0.1:*")
    sender = transport.SegmentSender([receiver.endpoint], cfg)
    try:
        send_raw(receiver.endpoint, cases.values())
        assert receiver.recv(timeout_ms=500) is None
        assert dict(receiver.stats["invalid"]) == reasons_of(cases)
        assert sender.send(good)
        out = receiver.recv(timeout_ms=10_000)                     # still serving
        assert out is not None and digest(out) == digest(good)
    finally:
        sender.close()
        receiver.close()


def test_weight_server_drops_hostile_requests_and_keeps_serving():
    cfg = tcfg(fast=False)
    server = transport.WeightServer(cfg, endpoint="tcp://127.0.0.1:*")
    server.publish(1, {"w": np.arange(4, dtype=np.float32)})
    cases = hostile_requests("get_weights", {"newer_than": -1, "wait_ms": 0})
    sub = None
    try:
        # a frame over the request cap: ZeroMQ drops that connection before the frame is held
        send_raw(server.endpoint, [[bytes(1 << 20)]], settle_s=0.3)
        send_raw(server.endpoint, cases.values())
        assert wait_until(lambda: sum(server.stats["invalid"].values()) >= len(cases))
        sub = subscriber(server.endpoint, cfg, wait_s=0.2)
        version, tensors = sub.wait_newer(-1, timeout=10)
        assert version == 1 and tensors["w"].tolist() == [0, 1, 2, 3]
        assert dict(server.stats["invalid"]) == reasons_of(cases)     # nothing for the big frame
        server.check()
    finally:
        if sub is not None:
            sub.close()
        server.close()


# ------------------------------------------------------------------------------ backpressure
def _rss() -> int:
    return psutil.Process().memory_info().rss


def _mb_segment(spec, seq):
    return make_segment(spec, B=4, seq=seq, truncations=0, episodes=0)


BP_SPEC = make_spec(T=3, B=4, H=128, L=4)          # ~0.8 MB per segment (images)


def test_drop_oldest_bounds_memory_and_counts_every_segment():
    cfg = tcfg(fast=False, send_hwm=2, recv_hwm=2)
    receiver = transport.SegmentReceiver(cfg, 0, BP_SPEC, endpoint="tcp://127.0.0.1:*")
    sender = transport.SegmentSender([receiver.endpoint], cfg, backpressure="drop_oldest")
    total = 300                                              # ~240 MB offered to a learner that reads nothing
    base = _rss()
    peak = 0
    for i in range(total):
        sender.send(_mb_segment(BP_SPEC, i))
        peak = max(peak, _rss() - base)
    assert sender.dropped > 0
    assert peak < 80 << 20, f"sender memory grew by {peak >> 20} MB"
    assert sender.sent + sender.dropped + sender.pending == total

    delivered = []
    stop = threading.Event()
    reader = threading.Thread(target=lambda: [delivered.append(s.meta["seq"]) for s in iter(
        lambda: receiver.recv(timeout_ms=50) if not stop.is_set() else "end", "end") if s is not None])
    reader.start()
    assert sender.flush(timeout=20)
    assert wait_until(lambda: len(delivered) == sender.sent, 20)
    stop.set()
    reader.join()
    sender.close()
    receiver.close()
    assert len(delivered) + sender.dropped == total
    assert delivered == sorted(delivered)                    # dropped ones are the oldest unsent
    assert delivered[-1] == total - 1


def test_block_mode_waits_with_bounded_memory_and_loses_nothing():
    cfg = tcfg(fast=False, send_hwm=2, recv_hwm=2)
    receiver = transport.SegmentReceiver(cfg, 0, BP_SPEC, endpoint="tcp://127.0.0.1:*")
    sender = transport.SegmentSender([receiver.endpoint], cfg, backpressure="block")
    total = 80
    base = _rss()
    thread = threading.Thread(target=lambda: [sender.send(_mb_segment(BP_SPEC, i)) for i in range(total)])
    thread.start()
    last, stable_since = -1, time.monotonic()
    while time.monotonic() - stable_since < 0.5:            # until the sender is stuck
        if sender.sent != last:
            last, stable_since = sender.sent, time.monotonic()
        time.sleep(0.02)
    assert sender.sent < total and thread.is_alive()
    assert _rss() - base < 80 << 20
    assert sender.send(_mb_segment(BP_SPEC, 999), timeout=0.2) is False   # caller keeps it
    stop = threading.Event()
    stop.set()
    assert sender.send(_mb_segment(BP_SPEC, 998), stop=stop) is False

    got = []
    while len(got) < total:
        seg = receiver.recv(timeout_ms=10_000)
        assert seg is not None
        got.append(seg.meta["seq"])
    thread.join()
    assert got == list(range(total)) and sender.sent == total and sender.dropped == 0
    sender.close()
    receiver.close()


def _send_and_leave(endpoint: str, count: int, token: str) -> None:
    spec = make_spec(T=2, B=1, H=64, L=4)
    sender = transport.SegmentSender([endpoint], tcfg(fast=False, linger_ms=10_000))
    for i in range(count):
        seg = make_segment(spec, B=1, seq=i, truncations=0)
        seg.meta["token"] = token                  # the learner's process gave it (not this one)
        sender.send(seg)
    sender.close()


def test_an_actor_that_leaves_right_after_sending_loses_nothing():
    # A rank discards what it still queues from a peer that disconnected; close() waits until the
    # rank has taken (acked) everything, so a slow learner still gets every segment.
    spec = make_spec(T=2, B=1, H=64, L=4)
    receiver = transport.SegmentReceiver(tcfg(fast=False), 0, spec, endpoint="tcp://127.0.0.1:*")
    proc = mp.get_context("spawn").Process(target=_send_and_leave,
                                           args=(receiver.endpoint, 300, process_token("actor-0")))
    proc.start()
    got = []
    while len(got) < 300:
        # generous: the spawned sender first imports torch, which on a busy 2-core machine takes long
        seg = receiver.recv(timeout_ms=120_000)
        assert seg is not None, f"missing after {len(got)} segments"
        got.append(seg.meta["seq"])
        time.sleep(0.002)                        # slower than the sender: segments queue up here
    proc.join(30)
    receiver.close()
    assert got == list(range(300)) and proc.exitcode == 0


def test_close_with_an_absent_learner_counts_unsent_as_dropped():
    cfg = tcfg(fast=False, linger_ms=100)
    sender = transport.SegmentSender(["tcp://127.0.0.1:9"], cfg, backpressure="drop_oldest")
    spec = make_spec(T=2, B=1, H=8, L=4)
    for i in range(10):
        sender.send(make_segment(spec, B=1, seq=i, truncations=0))
    sender.close()                                           # must return (bounded linger)
    assert sender.sent + sender.dropped == 10 and sender.dropped >= 10 - 2 * cfg.send_hwm


# ----------------------------------------------------------------------------------- weights
def test_late_joiner_gets_the_newest_version_first_and_never_a_backlog():
    cfg = tcfg(fast=False)
    server = transport.WeightServer(cfg, endpoint="tcp://127.0.0.1:*")
    for v in range(1, 8):
        server.publish(v, {"w": np.full(1000, v, np.float32)})
    sub = subscriber(server.endpoint, cfg, wait_s=0.2)
    try:
        version, tensors = sub.wait_newer(-1, timeout=10)
        assert version == 7 and float(tensors["w"][0]) == 7.0
        assert sub.poll_newest(newer_than=7) is None
        for v in (8, 9, 10):                  # published while the actor is busy acting
            server.publish(v, {"w": np.full(1000, v, np.float32)})
        assert wait_until(lambda: sub.version == 10)
        version, tensors = sub.poll_newest(newer_than=7)
        assert version == 10 and float(tensors["w"][-1]) == 10.0
        assert sub.poll_newest(newer_than=7) is None                 # handed out once
        assert sub.wait_newer(10, timeout=0.3) is None
        with pytest.raises(ValueError, match="newer"):
            server.publish(10, {"w": np.zeros(1, np.float32)})
    finally:
        sub.close()
        server.close()


def test_subscriber_drops_invalid_weights_and_keeps_going():
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)              # a server that answers with garbage first
    server.linger = 0
    server.bind("tcp://127.0.0.1:*")
    sub = subscriber(server.getsockopt(zmq.LAST_ENDPOINT).decode(), tcfg(fast=False), wait_s=0.2)
    huge = header_of(P.encode_weights(4, {"w": np.zeros(0, np.float32)})[0])
    huge["layout"][0][2] = [1 << 62, 1 << 62, 0]
    deep = {"type": "weights", "v": P.SCHEMA_VERSION, "meta": {"version": 4}, "layout": deep_list(1000)}
    replies = [[b"\x93\x01"], P.encode_weights(4, {"w": np.array([1.0, np.nan], np.float32)}),
               [pack_header(deep)], [pack_header(huge), b""],
               P.encode_weights(5, {"w": np.array([1.0, 2.0], np.float32)})]
    try:
        for reply in replies:
            assert server.poll(10_000)
            peer, *request = server.recv_multipart()
            ask = P.decode_control(request, P.Limits.for_kind("request", 1), "get_weights")
            assert ask.meta["newer_than"] == -1
            server.send_multipart([peer, *reply])
        version, tensors = sub.wait_newer(-1, timeout=10)
        assert version == 5 and tensors["w"].tolist() == [1.0, 2.0]
        assert sub.stats["invalid"] == {"bad_header": 1, "not_finite": 1, "too_deep": 1, "bad_shape": 1}
    finally:
        sub.close()
        server.close()
        ctx.term()


WEIGHT_CLIENTS = r"""
import sys, time
from asyncvla.common import transport
from asyncvla.common.config import TransportConfig
subs = [transport.WeightSubscriber(sys.argv[1], TransportConfig(), actor_id="a", token=sys.argv[3])
        for _ in range(int(sys.argv[2]))]
got = [s.wait_newer(-1, timeout=60) for s in subs]
print(" ".join(str(g[0]) + ":" + str(int(g[1]["w"].nbytes)) for g in got), flush=True)
for s in subs:
    s.close()
"""


def test_weight_server_does_not_copy_the_payload_per_request():
    cfg = tcfg(fast=False)
    server = transport.WeightServer(cfg, endpoint="tcp://127.0.0.1:*")
    payload = np.ones(16 << 20, np.float32)                  # 64 MB, pages touched
    base, peak = _rss(), 0
    server.publish(1, {"w": payload})
    proc = subprocess.Popen([sys.executable, "-c", WEIGHT_CLIENTS, server.endpoint, "3", process_token("a")],
                            cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        while proc.poll() is None:
            peak = max(peak, _rss() - base)
            time.sleep(0.01)
        out = proc.stdout.read().split()
    finally:
        proc.kill()
        server.close()
    assert out == [f"1:{64 << 20}"] * 3
    assert server.stats["replies"] == 3
    assert peak < 32 << 20, f"server memory grew by {peak >> 20} MB serving 3 x 64 MB"
