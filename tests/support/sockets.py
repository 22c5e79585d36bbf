"""Transport settings, a fake learner and hostile peers, for tests on real ZeroMQ sockets:

    FAST              heartbeat, time-out and reconnect settings short enough for a test
    tcfg              a TransportConfig with a short linger, and FAST's timings unless fast=False
    SPEC              a small segment spec for tests of the control channel and its tokens
    welcome_fn_for    a control server's welcome naming given trajectory and weight endpoints
    REQUEST           the limits a request server decodes a request under
    FakeLearner       a real ROUTER that welcomes any hello and serves given policy files
    wait_until        poll a condition until it holds or a time-out passes; whether it held
    deep_list         lists nested deeper than Python can recurse into, under msgpack's own limit
    hostile_requests  bad messages for a request server, each with the drop reason it must get
    send_raw          send multipart messages from a bare DEALER (what a hostile peer can do)
    reasons_of        the drop reasons a dict of hostile cases must be counted under
"""

from __future__ import annotations

import collections
import threading
import time

import zmq

from asyncvla.common.transport import protocol as P
from asyncvla.common.config import TransportConfig
from asyncvla.common.transport.sockets import bound_endpoint
from tests.support.segments import make_spec
from tests.support.wire import pack_header

FAST = dict(heartbeat_interval_s=0.1, heartbeat_timeout_s=1.5, reconnect_max_s=0.4, linger_ms=200)
SPEC = make_spec(T=2, B=2, H=16, L=8, K=2, D=3)
REQUEST = P.Limits.for_kind("request", 1)


def tcfg(fast: bool = True, **kw) -> TransportConfig:
    """Transport settings for a test: linger 200 ms, with FAST's heartbeats, time-outs and
    reconnects (fast=False: the config's defaults for those), then `kw`."""
    return TransportConfig(**{**(FAST if fast else {"linger_ms": 200}), **kw})


def welcome_fn_for(endpoints, weights="tcp://127.0.0.1:1"):
    def welcome(hello):
        return {"config": {"transport": {"keys_dir": "/learner/only"}}, "segment_endpoints": endpoints,
                "weights_endpoint": weights, "weight_version": 0, "policy": {"path": "/not/here"},
                "rollout": {"segments_per_version": 1 + hello["num_envs"]}}
    return welcome


class FakeLearner:
    """A real ROUTER that welcomes any hello and answers get_policy_files with `files`."""

    def __init__(self, files: dict[str, bytes]):
        self.files = files
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = bound_endpoint(self.sock)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        welcome = {"config": {}, "segment_endpoints": ["tcp://127.0.0.1:2"], "policy": {"path": "/not/here"},
                   "weights_endpoint": "tcp://127.0.0.1:3", "weight_version": 0, "rollout": {}, "token": "t"}
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            peer, *frames = self.sock.recv_multipart()
            kind = P.decode(frames, REQUEST).kind
            if kind == "hello":
                self.sock.send_multipart([peer, *P.encode_control("welcome", welcome)])
            elif kind == "get_policy_files":
                self.sock.send_multipart([peer, *P.encode_control("policy_files", files=self.files)])

    def close(self):
        self._stop.set()
        self._thread.join()
        self.sock.close()
        self.ctx.term()


def wait_until(cond, timeout=10.0, step=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return cond()


def deep_list(depth: int) -> list:
    """[[[...]]] `depth` lists deep: under msgpack's own limit, over what Python can recurse into."""
    out = []
    for _ in range(depth - 1):
        out = [out]
    return out


def hostile_requests(kind: str, meta: dict) -> dict[str, list]:
    """Bad messages a peer may send to a request server, each with the drop reason it must get."""
    header = {"type": kind, "v": P.SCHEMA_VERSION, "meta": meta, "layout": []}
    good = pack_header(header)
    return {"too_deep": [pack_header({**header, "layout": deep_list(1000)})],
            "too_deep ": [pack_header({**header, "meta": {**meta, "x": deep_list(1000)}})],
            "bad_shape": [pack_header({**header, "layout": [["f", "uint8", [1 << 62, 1 << 62, 0]]]})],
            "frame_count": [good] + [bytes(1000)] * 40,
            "bad_header": [b"\xc1"]}


def send_raw(endpoint: str, messages, settle_s: float = 0.0) -> None:
    """Send multipart messages from a bare DEALER (what a hostile peer can do)."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.linger = 2000
    s.connect(endpoint)
    for frames in messages:
        s.send_multipart(frames)
    time.sleep(settle_s)
    s.close()
    ctx.term()


def reasons_of(cases: dict) -> dict:
    return dict(collections.Counter(k.strip() for k in cases))
