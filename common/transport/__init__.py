"""ZeroMQ transport between actors and the learner: the three channels under one name.

    segments  common/transport/segment_channel.py  actor SegmentSender -> rank r SegmentReceiver
                                                    (acked, bounded, backpressure)
    weights   common/transport/weight_channel.py   rank 0 WeightServer <- actor WeightSubscriber
                                                    ("newer than v?" long polls)
    control   common/transport/control/            rank 0 ControlServer <- actor LearnerClient
                                                    (hello/welcome, heartbeats, bye)

Messages are those of common/transport/protocol/ (msgpack header + raw frames, zero-copy both ways);
every received one is validated, and an invalid one, whatever it holds, is dropped, counted per
reason in `.stats` and logged at a bounded rate. A server thread that dies all the same (a bug)
keeps its exception: the server's `check()` raises ThreadDied naming it (the learner polls it).
Endpoints are tcp://HOST:PORT or ipc://PATH; the servers take an explicit `endpoint=` (tests,
ipc) instead of the configured port. Keys (CURVE) and the public-bind rule: see
common/transport/sockets.py. This module holds no code of its own.
"""

from asyncvla.common.transport.control import ControlServer, LearnerClient, Registry
from asyncvla.common.transport.protocol import Segment, SegmentSpec, ValidationError
from asyncvla.common.transport.sockets import ThreadDied, TransportError
from asyncvla.common.transport.segment_channel import BACKPRESSURE, SegmentReceiver, SegmentSender
from asyncvla.common.transport.weight_channel import WeightServer, WeightSubscriber

__all__ = ["BACKPRESSURE", "SegmentReceiver", "SegmentSender", "WeightServer", "WeightSubscriber", "ControlServer",
           "LearnerClient", "Registry", "Segment", "SegmentSpec", "ThreadDied", "TransportError", "ValidationError"]
