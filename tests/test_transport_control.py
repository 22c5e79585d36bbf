"""Control channel and security over real sockets: joins, heartbeats, time-outs, restarts, CURVE."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import zmq
import zmq.auth

from asyncvla.common.transport import protocol as P
from asyncvla.common import transport
from asyncvla.common.transport.control import Registry
from asyncvla.common.transport.sockets import TransportError, bound_endpoint
from asyncvla.launch import cli
from tests.support.paths import REPO
from tests.support.ports import free_ports, run_ports
from tests.support.segments import make_segment
from tests.support.sockets import (SPEC, deep_list, hostile_requests, reasons_of, send_raw, tcfg, wait_until,
                                   welcome_fn_for)
from tests.support.wire import pack_header


def free_tcp_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_ports(1)[0]}"


def registry_invariant(counts) -> bool:
    return counts["joined_total"] == (counts["alive"] + counts["left_total"] + counts["timed_out_total"]
                                      + counts["replaced_total"])


# ----------------------------------------------------------------------------- registry (pure)
def test_registry_counts():
    live = {b"i1", b"i3"}                                             # connections still open
    r = Registry(connected=lambda identity: identity in live)
    assert r.hello("a", "h", 1, b"i1", now=0.0) == "joined"
    assert r.hello("a", "h", 1, b"i1", now=0.5) == "refreshed"        # its connection says hello again
    assert r.hello("a", "h", 1, b"i2", now=0.5) == "held"             # its host and pid, another connection
    assert r.hello("b", "h", 2, b"i3", now=0.5) == "joined"
    live.discard(b"i3")                                               # b died without bye
    assert r.hello("b", "h", 3, b"i4", now=0.6) == "replaced"         # its restart takes the id at once
    live.add(b"i4")
    assert r.hello("b", "h", 3, b"i9", now=0.6, key="K2") == "taken"  # live under another CURVE key
    assert r.actors["b"].identity == b"i4"
    assert not r.heartbeat("a", b"i2", now=2.0) and not r.bye("a", b"i2")   # not a's connection
    live.discard(b"i1")                                               # ZeroMQ reconnected a's socket
    assert r.heartbeat("a", b"i5", now=2.0) and r.actors["a"].identity == b"i5"
    assert not r.heartbeat("zzz", b"i5", now=2.0)
    assert [a.actor_id for a in r.expire(now=2.5, timeout_s=1.0)] == ["b"]
    assert r.bye("a", b"i5") and not r.bye("a", b"i5")
    assert r.counts() == {"alive": 0, "joined_total": 3, "left_total": 1, "timed_out_total": 1,
                          "replaced_total": 1}
    assert registry_invariant(r.counts())


# ----------------------------------------------------------------------------- join / welcome
def test_join_welcome_policy_files_bye_and_shutdown(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "policy.json").write_text('{"k": 1}')
    (tmp_path / "sub" / "weights.bin").write_bytes(os.urandom(300_000))
    # A generous time-out: this test is about the welcome and the shutdown notice, not expiry,
    # and a loaded CI machine must not make the client think the learner is gone.
    server = transport.ControlServer(tcfg(heartbeat_timeout_s=6.0), welcome_fn_for(["tcp://127.0.0.1:2"]), policy_dir=str(tmp_path),
                                     endpoint="tcp://127.0.0.1:*")
    a = transport.LearnerClient(server.endpoint, "a", tcfg(), num_envs=2)
    b = transport.LearnerClient(server.endpoint, "b", tcfg(keys_dir=None))
    try:
        welcome = a.join(timeout=10)
        assert welcome["rollout"] == {"segments_per_version": 3}           # built from the hello
        assert welcome["segment_endpoints"] == ["tcp://127.0.0.1:2"]
        assert welcome["heartbeat_timeout_s"] == 6.0                     # the learner's setting
        assert welcome["config"]["transport"]["keys_dir"] == "/learner/only"   # passed on untouched
        files = a.fetch_policy_files(timeout=10)
        assert files == {"policy.json": b'{"k": 1}',
                         "sub/weights.bin": (tmp_path / "sub" / "weights.bin").read_bytes()}
        assert b.join(timeout=10) is not None
        assert server.counts()["alive"] == 2
        a.close()                                                         # says bye
        assert wait_until(lambda: server.counts()["left_total"] == 1)
        assert b.final_version == -1
        server.close(notify=True, final_version=7)                        # end of training
        assert wait_until(lambda: b.finished) and b.final_version == 7    # an evaluator waits for it
    finally:
        b.close()
    assert server.counts() == {"alive": 0, "joined_total": 2, "left_total": 2, "timed_out_total": 0,
                               "replaced_total": 0}                   # b answered the notice with bye


def test_every_actor_gets_the_shutdown_notice():
    # Actors heartbeat every 0.1 s, so the learner always holds unread messages when it closes;
    # closing then would reset the connections and lose notices still in flight. It reads until
    # every notified actor has answered bye.
    for _ in range(5):
        server = transport.ControlServer(tcfg(heartbeat_timeout_s=6.0), welcome_fn_for(["tcp://127.0.0.1:2"]),
                                         endpoint="tcp://127.0.0.1:*")
        clients = [transport.LearnerClient(server.endpoint, f"a{i}", tcfg()) for i in range(3)]
        try:
            assert all(c.join(timeout=10) is not None for c in clients)
            time.sleep(0.5)
            server.close(notify=True)
            assert wait_until(lambda: all(c.finished for c in clients), timeout=5)
            assert server.counts()["left_total"] == 3
        finally:
            for c in clients:
                c.close()


def test_an_evaluator_gets_the_last_weights_however_late_it_asks_for_them():
    """The learner ends as `learner/main.py` does: publish the last version, "shutdown", close the
    weight server. An evaluator whose subscriber starts only after the notice (a slow start-up)
    still gets that version: its bye waits for it (defer_bye, then say_bye() as the evaluator
    does once its weights hold the last version), and the learner waits for a client that
    heartbeats, well past the 2 s it gives one that is silent."""
    cfg = tcfg(heartbeat_timeout_s=30.0)
    control = transport.ControlServer(cfg, welcome_fn_for(["tcp://127.0.0.1:2"]), endpoint="tcp://127.0.0.1:*")
    weights = transport.WeightServer(cfg, endpoint="tcp://127.0.0.1:*", tokens=control.tokens)
    evaluator = transport.LearnerClient(control.endpoint, "evaluator-0", cfg, defer_bye=True)
    actor = transport.LearnerClient(control.endpoint, "local-0", cfg)
    sub = []
    closing = threading.Thread(target=control.close, kwargs={"final_version": 3})
    try:
        assert evaluator.join(timeout=10) is not None and actor.join(timeout=10) is not None
        for version in range(4):
            weights.publish(version, {"w": np.full(4, version, np.float32)}, step=version)
        closing.start()
        assert wait_until(lambda: evaluator.finished and actor.finished)
        assert wait_until(lambda: control.counts()["left_total"] == 1)        # the actor's bye at once
        time.sleep(3.0)
        assert closing.is_alive()                     # still waiting for the heartbeating evaluator
        sub.append(transport.WeightSubscriber(weights.endpoint, cfg, actor_id="evaluator-0",
                                              token=lambda: evaluator.token, wait_s=0.2))
        assert wait_until(lambda: sub[0].version >= evaluator.final_version)
        evaluator.say_bye()
        closing.join(timeout=60)
        assert not closing.is_alive()
        weights.close()                               # what the learner does next
        got = sub[0].poll_newest()
        assert got is not None and got[0] == evaluator.final_version == 3 and sub[0].step == 3
        assert got[1]["w"].tolist() == [3, 3, 3, 3]
        assert control.counts() == {"alive": 0, "joined_total": 2, "left_total": 2, "timed_out_total": 0,
                                    "replaced_total": 0}
    finally:
        for c in (evaluator, actor, *sub):
            c.close()
        if closing.is_alive():
            closing.join(timeout=60)
        weights.close()


def test_a_failing_welcome_is_reported_to_the_actor():
    def broken(hello):
        raise RuntimeError("no policy yet")
    server = transport.ControlServer(tcfg(), broken, endpoint="tcp://127.0.0.1:*")
    client = transport.LearnerClient(server.endpoint, "a", tcfg())
    try:
        with pytest.raises(TransportError, match="no policy yet"):
            client.join(timeout=10)
    finally:
        client.close()
        server.close()


def test_control_server_drops_hostile_requests_and_keeps_serving():
    server = transport.ControlServer(tcfg(), welcome_fn_for(["tcp://127.0.0.1:2"]), endpoint="tcp://127.0.0.1:*")
    cases = hostile_requests("hello", {"actor_id": "x", "host": "h", "pid": 1, "num_envs": 0})
    client = transport.LearnerClient(server.endpoint, "a", tcfg())
    try:
        # a frame over the request cap: ZeroMQ drops that connection before the frame is held
        send_raw(server.endpoint, [[bytes(1 << 20)]], settle_s=0.3)
        send_raw(server.endpoint, cases.values())
        assert wait_until(lambda: sum(server.stats["invalid"].values()) >= len(cases))
        assert client.join(timeout=10) is not None                  # a new actor is still answered
        assert dict(server.stats["invalid"]) == reasons_of(cases)    # nothing for the big frame
        assert server.counts()["alive"] == 1
        server.check()
    finally:
        client.close()
        server.close(notify=False)


def test_learner_client_drops_hostile_replies_and_joins():
    ctx = zmq.Context()
    learner = ctx.socket(zmq.ROUTER)                 # a "learner" that answers hellos badly first
    learner.linger = 0
    learner.bind("tcp://127.0.0.1:*")
    good = {"config": {}, "segment_endpoints": ["tcp://127.0.0.1:2"], "weights_endpoint": "tcp://127.0.0.1:3",
            "weight_version": 0, "policy": {"path": "/p"}, "rollout": {}, "token": "t"}
    replies = [[pack_header({"type": "welcome", "v": P.SCHEMA_VERSION, "meta": {**good, "config": deep_list(1000)},
                             "layout": []})],
               P.encode_control("welcome", {**good, "heartbeat_timeout_s": "soon"}),
               P.encode_control("welcome", {**good, "heartbeat_interval_s": float("nan")}),
               P.encode_control("welcome", {k: v for k, v in good.items() if k != "token"}),
               P.encode_control("welcome", good)]
    client = transport.LearnerClient(bound_endpoint(learner), "a", tcfg())
    try:
        joined = []
        thread = threading.Thread(target=lambda: joined.append(client.join(timeout=20)))
        thread.start()
        for reply in replies:                        # the client says hello again after each bad one
            assert learner.poll(10_000)
            peer, *hello = learner.recv_multipart()
            assert P.decode_control(hello, P.Limits.for_kind("request", 1), "hello").meta["actor_id"] == "a"
            learner.send_multipart([peer, *reply])
        thread.join()
        assert joined[0]["segment_endpoints"] == ["tcp://127.0.0.1:2"] and client.token == "t"
        assert dict(client.stats["invalid"]) == {"too_deep": 1, "bad_welcome": 3}
    finally:
        client.close()
        learner.close()
        ctx.term()


def ask(sock, kind: str, meta: dict, timeout_ms: int = 3000) -> P.Message | None:
    """Send a control message from a bare DEALER; its answer, or None."""
    sock.send_multipart(P.encode_control(kind, meta))
    if not sock.poll(timeout_ms):
        return None
    return P.decode(sock.recv_multipart(), P.Limits.for_kind("control", 8))


def test_a_live_id_stays_with_its_connection_whatever_host_and_pid_a_hello_claims(caplog):
    """Without keys: a hello copying a live actor's id, host and pid from another connection is
    refused and counted; with the actor's token (say, leaked), that connection's heartbeats and
    byes change nothing either. The actor keeps its id and never has to rejoin."""
    cfg = tcfg(heartbeat_timeout_s=30.0)        # nothing times out here: only connections decide
    control = transport.ControlServer(cfg, welcome_fn_for(["tcp://127.0.0.1:2"]), endpoint="tcp://127.0.0.1:*")
    actor = transport.LearnerClient(control.endpoint, "local-0", cfg)
    ctx = zmq.Context()
    impostor = ctx.socket(zmq.DEALER)
    impostor.connect(control.endpoint)
    try:
        assert actor.join(timeout=10) is not None
        live = control.registry.actors["local-0"]
        identity, claims = live.identity, {"actor_id": "local-0", "host": live.host, "pid": live.pid,
                                           "num_envs": 0}
        with caplog.at_level(logging.WARNING, logger="asyncvla.transport"):
            reply = ask(impostor, "hello", claims)
        assert reply.kind == "error" and "live in another process" in reply.meta["message"], reply.meta
        assert "token" not in reply.meta
        assert any("id_taken" in r.getMessage() and "local-0" in r.getMessage() for r in caplog.records)
        credentials = {"actor_id": "local-0", "token": actor.token}
        assert ask(impostor, "heartbeat", credentials, timeout_ms=500) is None
        assert ask(impostor, "bye", credentials, timeout_ms=500) is None
        assert dict(control.stats["invalid"]) == {"id_taken": 3}
        assert control.registry.actors["local-0"].identity == identity
        assert control.counts() == {"alive": 1, "joined_total": 1, "left_total": 0, "timed_out_total": 0,
                                    "replaced_total": 0}
        assert actor.learner_alive and actor.rejoins == 0
        actor.close()                                               # its own bye counts
        assert wait_until(lambda: control.counts()["left_total"] == 1) and control.counts()["alive"] == 0
    finally:
        actor.close()
        impostor.close(0)
        ctx.term()
        control.close(notify=False)


def test_a_restarted_actor_takes_its_id_once_the_old_connection_closed(caplog):
    """An actor that died without bye: its restart (same id, here the same host and pid too)
    takes the id as soon as the learner has seen the old connection close, long before a
    time-out would free it; the takeover is logged."""
    cfg = tcfg(heartbeat_timeout_s=30.0)
    control = transport.ControlServer(cfg, welcome_fn_for(["tcp://127.0.0.1:2"]), endpoint="tcp://127.0.0.1:*")
    ctx = zmq.Context()
    hello = {"actor_id": "a", "host": "h", "pid": 1, "num_envs": 0}
    crashed, restarted = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        crashed.connect(control.endpoint)
        assert ask(crashed, "hello", hello).kind == "welcome"
        crashed.close(0)                                            # no bye: the kernel closes it
        restarted.connect(control.endpoint)
        with caplog.at_level(logging.INFO, logger="asyncvla.transport"):
            # (hellos until the learner's socket has seen the close: the id is not freed by time)
            assert wait_until(lambda: (ask(restarted, "hello", hello, timeout_ms=1000) or P.Message("", {})).kind
                              == "welcome", timeout=10)
        counts = control.counts()
        assert counts["replaced_total"] == 1 and counts["alive"] == 1 and counts["timed_out_total"] == 0
        assert registry_invariant(counts)
        assert any(r.getMessage() == "actor a replaced (h pid 1)" for r in caplog.records)
    finally:
        restarted.close(0)
        ctx.term()
        control.close(notify=False)


class FakeLearner:
    """A bare ROUTER that answers a client's hellos as a test scripts them."""
    WELCOME = {"config": {}, "segment_endpoints": ["tcp://127.0.0.1:2"], "weights_endpoint": "tcp://127.0.0.1:3",
               "weight_version": 0, "policy": {"path": "/p"}, "rollout": {}, "token": "t"}

    def __init__(self):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = bound_endpoint(self.sock)

    def answer_hello(self, reply) -> bytes:
        """Answer the next hello with `reply` (frames); the client's identity."""
        while self.sock.poll(10_000):
            peer, *frames = self.sock.recv_multipart()
            if P.decode(frames, P.Limits.for_kind("request", 1)).kind == "hello":
                self.sock.send_multipart([peer, *reply])
                return peer
        raise AssertionError("no hello")

    def join(self, client, welcome: dict) -> bytes:
        """Welcome `client`'s first hello with `welcome`; the client's identity."""
        joined = []
        thread = threading.Thread(target=lambda: joined.append(client.join(timeout=20)))
        thread.start()
        peer = self.answer_hello(P.encode_control("welcome", welcome))
        thread.join()
        assert joined[0] is not None
        return peer

    def close(self):
        self.sock.close()
        self.ctx.term()


def test_a_refused_hello_on_rejoining_is_retried():
    """A learner that still holds the id for the actor's previous connection refuses its hello
    after a reconnect; the client says hello again instead of failing for good."""
    learner = FakeLearner()
    welcome = FakeLearner.WELCOME
    answer_hello = learner.answer_hello
    client = transport.LearnerClient(learner.endpoint, "a", tcfg(heartbeat_timeout_s=30.0))
    try:
        peer = learner.join(client, welcome)
        learner.sock.send_multipart([peer, *P.encode_control("rejoin")])         # "who are you?"
        answer_hello(P.encode_control("error", {"message": "actor_id 'a' is live in another process"}))
        answer_hello(P.encode_control("welcome", {**welcome, "token": "t2"}))
        assert wait_until(lambda: client.rejoins == 1)
        assert client.token == "t2" and client.error is None
    finally:
        client.close()
        learner.close()


ACTOR = r"""
import sys, time
from asyncvla.common import transport
from asyncvla.common.config import TransportConfig
from tests.support.segments import make_segment, make_spec
cfg = TransportConfig(heartbeat_interval_s=0.1, heartbeat_timeout_s=0.8, linger_ms=200)
client = transport.LearnerClient(sys.argv[1], sys.argv[2], cfg)
welcome = client.join(timeout=30)
sender = transport.SegmentSender(welcome["segment_endpoints"], cfg)
spec = make_spec(T=2, B=2, H=16, L=8, K=2, D=3)
seq = 0
while True:
    seg = make_segment(spec, B=2, seq=seq, actor_id=sys.argv[2], truncations=1, episodes=1)
    seg.meta["token"] = client.token
    sender.send(seg)
    seq += 1
    time.sleep(0.01)
"""


def test_killed_actor_process_times_out_and_rejoins_when_restarted():
    receiver = transport.SegmentReceiver(tcfg(), 0, SPEC, endpoint="tcp://127.0.0.1:*")
    server = transport.ControlServer(tcfg(), welcome_fn_for([receiver.endpoint]),
                                     endpoint="tcp://127.0.0.1:*")
    steady = transport.LearnerClient(server.endpoint, "steady", tcfg())    # an actor that stays
    seen: dict[str, int] = {}

    def pump(cond, timeout=20.0):
        """Keep the learner side receiving while waiting for `cond`."""
        deadline = time.monotonic() + timeout
        while not cond() and time.monotonic() < deadline:
            seg = receiver.recv(timeout_ms=20)
            if seg is not None:
                seen[seg.meta["actor_id"]] = seen.get(seg.meta["actor_id"], 0) + 1
        return cond()

    procs = []
    try:
        assert steady.join(timeout=10) is not None
        procs.append(subprocess.Popen([sys.executable, "-c", ACTOR, server.endpoint, "doomed"], cwd=REPO))
        assert pump(lambda: seen.get("doomed", 0) >= 5)
        assert server.counts()["alive"] == 2
        procs[0].kill()                                             # mid-stream, no bye
        procs[0].wait()
        assert pump(lambda: server.counts()["timed_out_total"] == 1)
        assert server.counts()["alive"] == 1 and steady.learner_alive
        before = seen["doomed"]
        pump(lambda: False, timeout=0.3)                            # the learner side keeps going
        assert seen["doomed"] == before
        procs.append(subprocess.Popen([sys.executable, "-c", ACTOR, server.endpoint, "doomed"], cwd=REPO))
        assert pump(lambda: seen["doomed"] >= before + 5)           # the restarted actor streams again
        counts = server.counts()
        assert counts["alive"] == 2 and counts["joined_total"] == 3 and registry_invariant(counts)
        assert not receiver.stats["invalid"]
    finally:
        for p in procs:
            p.kill()
            p.wait()
        steady.close()
        server.close()
        receiver.close()


@pytest.mark.parametrize("outage", ["short", "past_timeout"])
def test_learner_restart_on_the_same_port_is_rejoined(outage):
    endpoint = free_tcp_endpoint()
    server = transport.ControlServer(tcfg(), welcome_fn_for(["tcp://127.0.0.1:2"]), endpoint=endpoint)
    client = transport.LearnerClient(endpoint, "a", tcfg())
    try:
        assert client.join(timeout=10) is not None and client.learner_alive
        server.close(notify=False)                                  # a crash: no shutdown notice
        if outage == "past_timeout":
            assert wait_until(lambda: not client.learner_alive, 10)
        server = transport.ControlServer(tcfg(), welcome_fn_for(["tcp://127.0.0.1:3"]), endpoint=endpoint)
        assert wait_until(lambda: client.rejoins == 1 and client.learner_alive, 10)
        assert client.welcome["segment_endpoints"] == ["tcp://127.0.0.1:3"]
        assert wait_until(lambda: server.counts()["alive"] == 1)
        assert server.counts()["joined_total"] == 1 and not client.finished
    finally:
        client.close()
        server.close()


# ------------------------------------------------------------------------------------ security
def test_keygen_layout_and_adding_clients(tmp_path):
    keys = tmp_path / "keys"
    assert cli.main(["keygen", str(keys), "--clients", "2"]) == 0
    server_public = (keys / "server.key").read_bytes()
    assert cli.main(["keygen", str(keys)]) == 0                      # adds client_002, keeps the server
    assert (keys / "server.key").read_bytes() == server_public
    assert sorted(p.name for p in (keys / "authorized_clients").iterdir()) == [
        "client_000.key", "client_001.key", "client_002.key"]
    for i in range(3):
        bundle = keys / "clients" / f"client_{i:03d}"
        assert sorted(p.name for p in bundle.iterdir()) == ["client.key", "client.key_secret", "server.key"]
        assert (bundle / "server.key").read_bytes() == server_public
        assert oct((bundle / "client.key_secret").stat().st_mode & 0o777) == "0o600"


def test_curve_refuses_unknown_clients_and_admits_known_ones(tmp_path):
    keys = tmp_path / "keys"
    assert cli.main(["keygen", str(keys), "--clients", "1"]) == 0
    rogue = tmp_path / "rogue"                     # a key pair the learner never authorised
    rogue.mkdir()
    zmq.auth.create_certificates(rogue, "client")
    (rogue / "server.key").write_bytes((keys / "server.key").read_bytes())

    learner_cfg = tcfg(keys_dir=str(keys))
    receiver = transport.SegmentReceiver(learner_cfg, 0, SPEC, endpoint="tcp://127.0.0.1:*")
    server = transport.ControlServer(learner_cfg, welcome_fn_for([receiver.endpoint]),
                                     endpoint="tcp://127.0.0.1:*")
    clients = []
    try:
        for keys_dir in (str(rogue), None):
            clients.append(transport.LearnerClient(server.endpoint, f"rogue-{keys_dir is None}",
                                                   tcfg(keys_dir=keys_dir)))
            assert clients[-1].join(timeout=1.5) is None
        intruder = transport.SegmentSender([receiver.endpoint], tcfg(keys_dir=str(rogue)), "drop_oldest")
        intruder.send(make_segment(SPEC, B=2))
        assert receiver.recv(timeout_ms=500) is None
        intruder.close()
        assert server.counts()["joined_total"] == 0

        bundle = str(keys / "clients" / "client_000")
        clients.append(transport.LearnerClient(server.endpoint, "good", tcfg(keys_dir=bundle)))
        welcome = clients[-1].join(timeout=10)
        assert welcome is not None                                        # a known client joins
        sender = transport.SegmentSender(welcome["segment_endpoints"], tcfg(keys_dir=bundle))
        seg = make_segment(SPEC, B=2, seq=5, actor_id="good")
        seg.meta["token"] = clients[-1].token              # bound to this bundle's key
        sender.send(seg)
        out = receiver.recv(timeout_ms=10_000)
        sender.close()
        assert out is not None and out.arrays["image"].tobytes() == seg.arrays["image"].tobytes()
        assert server.counts() == {"alive": 1, "joined_total": 1, "left_total": 0, "timed_out_total": 0,
                                   "replaced_total": 0}
    finally:
        for c in clients:
            c.close()
        server.close()
        receiver.close()


def test_curve_weights_channel(tmp_path):
    keys = tmp_path / "keys"
    assert cli.main(["keygen", str(keys)]) == 0
    cfg = tcfg(keys_dir=str(keys))                  # local: the first client bundle
    control = transport.ControlServer(cfg, welcome_fn_for(["tcp://127.0.0.1:2"]), endpoint="tcp://127.0.0.1:*")
    server = transport.WeightServer(cfg, endpoint="tcp://127.0.0.1:*")
    client = transport.LearnerClient(control.endpoint, "a", cfg)
    sub = None
    try:
        assert client.join(timeout=10) is not None
        sub = transport.WeightSubscriber(server.endpoint, cfg, actor_id="a", token=lambda: client.token)
        server.publish(3, {"w": np.arange(5, dtype=np.float32)})
        version, tensors = sub.wait_newer(-1, timeout=10)
        assert version == 3 and tensors["w"].tolist() == [0, 1, 2, 3, 4]
    finally:
        if sub is not None:
            sub.close()
        client.close()
        control.close(notify=False)
        server.close()


def test_public_bind_needs_keys_or_an_explicit_opt_in(caplog, tmp_path):
    with pytest.raises(TransportError, match="allow_insecure_public_bind"):
        transport.ControlServer(tcfg(bind_host="0.0.0.0"), welcome_fn_for([]), endpoint=None)
    with pytest.raises(TransportError, match="keys_dir"):
        transport.WeightServer(tcfg(), endpoint="tcp://0.0.0.0:*")
    with caplog.at_level(logging.WARNING, logger="asyncvla.transport"):
        server = transport.WeightServer(tcfg(allow_insecure_public_bind=True), endpoint="tcp://0.0.0.0:*")
    server.close()
    assert any("without CURVE" in r.getMessage() for r in caplog.records)
    keys = tmp_path / "keys"
    assert cli.main(["keygen", str(keys)]) == 0
    server = transport.WeightServer(tcfg(keys_dir=str(keys)), endpoint="tcp://0.0.0.0:*")
    server.close()
    with pytest.raises(TransportError, match="server.key_secret"):
        transport.WeightServer(tcfg(keys_dir=str(tmp_path)), endpoint="tcp://127.0.0.1:*")
    with pytest.raises(TransportError, match="client.key_secret"):
        transport.WeightSubscriber("tcp://127.0.0.1:1", tcfg(keys_dir=str(tmp_path / "nothing")), actor_id="a",
                                   token="t")


def test_advertised_endpoint_for_a_wildcard_bind(tmp_path):
    keys = tmp_path / "keys"
    assert cli.main(["keygen", str(keys)]) == 0
    cfg = tcfg(keys_dir=str(keys), bind_host="0.0.0.0", advertise_host="learner-0",
               segment_port=free_port())
    rx = transport.SegmentReceiver(cfg, 1, SPEC)
    try:
        assert rx.endpoint.startswith("tcp://learner-0:")
    finally:
        rx.close()


def free_port() -> int:
    return run_ports()["transport.segment_port"]       # the receiver adds its rank (1): that one is free too


def test_a_flood_of_hellos_is_folded_into_summary_lines(caplog):
    server = transport.ControlServer(tcfg(heartbeat_timeout_s=0.5), welcome_fn_for(["tcp://127.0.0.1:2"]),
                                     endpoint="tcp://127.0.0.1:*")
    server._events.interval_s = 1.0
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(server.endpoint)
    try:
        with caplog.at_level(logging.INFO, logger="asyncvla"):
            for i in range(200):                    # joins, then (no heartbeats) 200 time-outs
                sock.send_multipart(P.encode_control("hello", {"actor_id": f"x{i}", "host": "h", "pid": i,
                                                               "num_envs": 0}))
            assert wait_until(lambda: server.counts()["timed_out_total"] == 200, timeout=20)
            time.sleep(1.5)                         # the windows end; their summaries are written
        lines = [r.getMessage() for r in caplog.records if r.name == "asyncvla.transport"]
        joined = [m for m in lines if " joined (h pid " in m]
        timed_out = [m for m in lines if "timed out: no heartbeat" in m]
        folded = [m for m in lines if "more actor(s)" in m]
        assert len(joined) <= 40 and len(timed_out) <= 40, (len(joined), len(timed_out))
        total = {"joined": len(joined), "timed out": len(timed_out)}
        for m in folded:
            n, kind = int(m.split()[0]), "joined" if " joined " in m else "timed out"
            total[kind] += n
        assert total == {"joined": 200, "timed out": 200}, (total, folded)   # nothing is lost from the count
        assert server.counts()["joined_total"] == 200
    finally:
        sock.close(0)
        ctx.term()
        server.close(notify=False)


def test_a_rejoin_says_whether_the_learner_restarted_or_only_lost_the_actor(caplog):
    """A welcome names its learner (learner_id). Asked to rejoin by the same learner (it had timed
    the actor out: e.g. an actor paused with SIGSTOP), the client says so and counts no restart;
    welcomed by another learner, it counts a restart (the actor then drops its weights)."""
    learner = FakeLearner()
    welcome = {**FakeLearner.WELCOME, "learner_id": "A"}
    client = transport.LearnerClient(learner.endpoint, "a", tcfg(heartbeat_timeout_s=30.0))
    try:
        with caplog.at_level(logging.INFO, logger="asyncvla.transport"):
            peer = learner.join(client, welcome)
            assert client.learner_id == "A"
            learner.sock.send_multipart([peer, *P.encode_control("rejoin")])       # the same learner lost us
            peer = learner.answer_hello(P.encode_control("welcome", welcome))
            assert wait_until(lambda: client.rejoins == 1) and client.restarts == 0
            learner.sock.send_multipart([peer, *P.encode_control("rejoin")])
            learner.answer_hello(P.encode_control("welcome", {**welcome, "learner_id": "B"}))   # a new learner
            assert wait_until(lambda: client.rejoins == 2) and client.restarts == 1 and client.learner_id == "B"
        said = [r.getMessage() for r in caplog.records if "rejoined" in r.getMessage() or "restarted" in r.getMessage()]
        assert len(said) == 2 and "the same learner" in said[0] and "restarted" not in said[0], said
        assert "restarted; rejoined it" in said[1], said
    finally:
        client.close()
        learner.close()


def test_a_first_hello_refused_as_id_taken_is_said_again_until_the_id_is_free():
    """A restarted actor whose id another connection still holds does not fail its join: it says
    hello again (back-off) and is welcomed once the holder is gone; refused for another reason, or
    for longer than id_wait_s, join() fails with the learner's message."""
    cfg = tcfg(heartbeat_timeout_s=30.0, reconnect_max_s=0.5)
    control = transport.ControlServer(cfg, welcome_fn_for(["tcp://127.0.0.1:2"]), endpoint="tcp://127.0.0.1:*")
    holder = transport.LearnerClient(control.endpoint, "local-0", cfg)
    late = transport.LearnerClient(control.endpoint, "local-0", cfg)
    impatient = transport.LearnerClient(control.endpoint, "local-0", cfg, id_wait_s=0.5)
    try:
        assert holder.join(timeout=10) is not None
        joined = []
        thread = threading.Thread(target=lambda: joined.append(late.join(timeout=30)))
        thread.start()
        assert wait_until(lambda: control.stats["invalid"]["id_taken"] >= 2, 10)    # refused, and said again
        with pytest.raises(transport.TransportError, match="is live in another process"):
            impatient.join(timeout=10)
        holder.close()                                        # its connection goes: the id is free
        thread.join(timeout=30)
        assert joined and joined[0] is not None and late.learner_alive
    finally:
        for c in (holder, late, impatient):
            c.close()
        control.close(notify=False)
