"""Who may use the channels, over real sockets on loopback: only actors the learner welcomed get
policy files and weights or push segments; with CURVE, an actor_id belongs to the key that
registered it; an actor writes only safe policy file names, inside its folder; what peers send
cannot forge log lines; an actor that gets no answer says what to check."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from asyncvla.common.transport import protocol as P
from asyncvla.common import transport
from asyncvla.common.transport.control import policy_file_parts
from asyncvla.common.transport.sockets import Node, TransportError, printable
from asyncvla.launch import cli
from tests.support.paths import REPO
from tests.support.segments import make_segment
from tests.support.sockets import SPEC, FakeLearner, tcfg, wait_until, welcome_fn_for


class RawPeer:
    """A bare DEALER (what any peer can run), with CURVE keys when `cfg` has them."""

    def __init__(self, endpoint: str, cfg):
        self.node = Node(cfg, server=False)
        self.sock = self.node.socket(zmq.DEALER, connect=endpoint)

    def ask(self, kind: str, meta: dict, timeout_ms: int = 3000) -> P.Message | None:
        self.sock.send_multipart(P.encode_control(kind, meta))
        if not self.sock.poll(timeout_ms):
            return None
        return P.decode(self.sock.recv_multipart(), P.Limits.for_kind("control", 8))

    def close(self):
        self.node.close(0)


# ------------------------------------------------------------------ registration, without CURVE
def test_only_registered_actors_get_policy_files_weights_and_push_segments(tmp_path):
    (tmp_path / "policy.json").write_text("{}")
    cfg = tcfg(heartbeat_timeout_s=6.0)
    receiver = transport.SegmentReceiver(cfg, 0, SPEC, endpoint="tcp://127.0.0.1:*")
    control = transport.ControlServer(cfg, welcome_fn_for([receiver.endpoint]), policy_dir=str(tmp_path),
                                      endpoint="tcp://127.0.0.1:*")
    weights = transport.WeightServer(cfg, endpoint="tcp://127.0.0.1:*")
    weights.publish(1, {"w": np.arange(3, dtype=np.float32)})
    client = transport.LearnerClient(control.endpoint, "a", cfg)
    peer = RawPeer(control.endpoint, cfg)
    sender = transport.SegmentSender([receiver.endpoint], cfg)
    subs = []
    try:
        assert client.join(timeout=10) is not None
        token = client.token
        # policy files: without a token, with another actor's, or a made-up one
        for meta in ({"actor_id": "a", "token": ""}, {"actor_id": "b", "token": token},
                     {"actor_id": "a", "token": "0" * 64}):
            reply = peer.ask("get_policy_files", meta)
            assert reply.kind == "error" and "unregistered" in reply.meta["message"]
        assert control.stats["invalid"]["unregistered"] == 3
        assert peer.ask("get_policy_files", {"actor_id": "a", "token": token}).kind == "policy_files"
        assert client.fetch_policy_files(timeout=10) == {"policy.json": b"{}"}

        # weights: refused (and told so) without the token; served with it, at once when a rejoin
        # brings it (not after the pause that follows a refusal)
        current = {"token": "stale"}
        subs.append(transport.WeightSubscriber(weights.endpoint, cfg, actor_id="a", token=lambda: current["token"],
                                               wait_s=0.2))
        assert wait_until(lambda: subs[-1].stats["refused"] >= 1)
        assert subs[-1].poll_newest() is None and weights.stats["invalid"]["unregistered"] >= 1
        current["token"], asked = token, time.monotonic()
        version, tensors = subs[-1].wait_newer(-1, timeout=10)
        assert version == 1 and tensors["w"].tolist() == [0, 1, 2]
        assert time.monotonic() - asked < 1.5                      # the pause is wait_s + 2 s

        # segments: dropped and counted without a valid token; taken with it (token out of the meta)
        for actor_id, tok in (("a", None), ("a", "f" * 64), ("b", token)):
            seg = make_segment(SPEC, B=2, actor_id=actor_id)
            if tok is None:
                del seg.meta["token"]
            else:
                seg.meta["token"] = tok
            assert sender.send(seg)
        good = make_segment(SPEC, B=2, seq=7, actor_id="a")
        good.meta["token"] = token
        assert sender.send(good)
        out = receiver.recv(timeout_ms=10_000)
        assert out is not None and out.meta["seq"] == 7 and "token" not in out.meta
        assert dict(receiver.stats["invalid"]) == {"unregistered": 3} and receiver.stats["received"] == 1
    finally:
        for s in subs:
            s.close()
        sender.close()
        peer.close()
        client.close()
        control.close(notify=False)
        weights.close()
        receiver.close()


def test_a_token_is_refused_on_every_port_once_its_registration_ends(tmp_path):
    """hello as local-0, bye, the id rejoined by another process: the first token, signature and
    all still valid, is refused on the control, weight and segment ports (stale_token), while
    the new registration's token works on all three. The servers share rank 0's ledger, as the
    learner's do (learner/link.py)."""
    (tmp_path / "policy.json").write_text("{}")
    cfg = tcfg(heartbeat_timeout_s=6.0)
    receiver = transport.SegmentReceiver(cfg, 0, SPEC, endpoint="tcp://127.0.0.1:*")
    control = transport.ControlServer(cfg, welcome_fn_for([receiver.endpoint]), policy_dir=str(tmp_path),
                                      endpoint="tcp://127.0.0.1:*", tokens=receiver.tokens)
    weights = transport.WeightServer(cfg, endpoint="tcp://127.0.0.1:*", tokens=receiver.tokens)
    weights.publish(1, {"w": np.arange(3, dtype=np.float32)})
    impostor, actor = (transport.LearnerClient(control.endpoint, "local-0", cfg) for _ in range(2))
    peer, sender, subs = RawPeer(control.endpoint, cfg), transport.SegmentSender([receiver.endpoint], cfg), []
    try:
        assert impostor.join(timeout=10) is not None
        old = impostor.token
        impostor.close()                                             # says bye
        assert wait_until(lambda: control.counts()["left_total"] == 1)
        assert actor.join(timeout=10) is not None and actor.token != old

        # control: the old token fetches no policy files, and its heartbeat is not heard
        reply = peer.ask("get_policy_files", {"actor_id": "local-0", "token": old})
        assert reply.kind == "error" and "stale_token" in reply.meta["message"]
        assert peer.ask("heartbeat", {"actor_id": "local-0", "token": old}, timeout_ms=500) is None
        assert peer.ask("bye", {"actor_id": "local-0", "token": old}, timeout_ms=500) is None
        assert control.stats["invalid"]["stale_token"] == 3 and control.counts()["alive"] == 1
        assert peer.ask("get_policy_files", {"actor_id": "local-0", "token": actor.token}).kind == "policy_files"

        # weights: refused with the old token, served with the new one
        subs.append(transport.WeightSubscriber(weights.endpoint, cfg, actor_id="local-0", token=old, wait_s=0.2))
        assert wait_until(lambda: subs[0].stats["refused"] >= 1)
        assert subs[0].poll_newest() is None and weights.stats["invalid"]["stale_token"] >= 1
        subs.append(transport.WeightSubscriber(weights.endpoint, cfg, actor_id="local-0", token=actor.token,
                                               wait_s=0.2))
        assert subs[1].wait_newer(-1, timeout=10)[0] == 1

        # trajectories: a segment under the old token is dropped and counted; the new token's is taken
        for seq, token in ((1, old), (2, actor.token)):
            seg = make_segment(SPEC, B=2, seq=seq, actor_id="local-0")
            seg.meta["token"] = token
            assert sender.send(seg)
        out = receiver.recv(timeout_ms=10_000)
        assert out is not None and out.meta["seq"] == 2
        assert dict(receiver.stats["invalid"]) == {"stale_token": 1} and receiver.stats["received"] == 1

        # a ban ends the registration too
        control.ban("local-0")
        assert receiver.tokens.check("local-0", "", actor.token) == "stale_token"
    finally:
        for sub in subs:
            sub.close()
        sender.close()
        peer.close()
        actor.close()
        control.close(notify=False)
        weights.close()
        receiver.close()


def test_a_registration_ends_with_a_bye_a_time_out_or_a_replacement():
    """The registry ends in the ledger each registration it lets go; a hello from the holding
    connection keeps its registration (and its token) alive."""
    from asyncvla.common.transport.auth import TokenLedger
    from asyncvla.common.transport.control.server import Registry
    ledger, live = TokenLedger(b"k" * 32), {b"c1", b"c2", b"c3"}
    registry = Registry(connected=lambda identity: identity in live, ended=ledger.end)
    token = lambda actor, identity: ledger.issue(actor, "", registry.actors[actor].registration)  # noqa: E731
    assert registry.hello("a", "h", 1, b"c1", 0.0, registration="r1") == "joined"
    first = token("a", b"c1")
    assert registry.hello("a", "h", 1, b"c1", 1.0, registration="r2") == "refreshed"
    assert token("a", b"c1") == first and ledger.check("a", "", first) is None
    live.discard(b"c1")                                           # the holder's connection closed
    assert registry.hello("a", "h", 2, b"c2", 2.0, registration="r3") == "replaced"
    assert ledger.check("a", "", first) == "stale_token"
    second = token("a", b"c2")
    assert ledger.check("a", "", second) is None and ledger.check("b", "", second) == "unregistered"
    assert [a.actor_id for a in registry.expire(now=100.0, timeout_s=10.0)] == ["a"]
    assert ledger.check("a", "", second) == "stale_token"
    assert registry.hello("a", "h", 3, b"c3", 101.0, registration="r4") == "joined"
    third = token("a", b"c3")
    assert registry.bye("a", b"c3") and ledger.check("a", "", third) == "stale_token"
    assert ledger.ended_after(0) == (["r1", "r3", "r4"], 3) and ledger.ended_after(2) == (["r4"], 3)


def _rank_of_a_link(rank: int, port: int, answers) -> None:
    """One of two gloo ranks running ActorLink's sharing of ended registrations on the state it
    reads: rank 0 holds the servers (here: which registrations ended), rank 1 an inbox."""
    import torch.distributed as dist
    from types import SimpleNamespace
    from asyncvla.common.transport.auth import TokenLedger
    from asyncvla.learner.link import ActorLink
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        ledger = TokenLedger(b"k" * 32)
        link = SimpleNamespace(world=2, rank0=object() if rank == 0 else None, _ended_mark=0,
                               inbox=SimpleNamespace(receiver=SimpleNamespace(tokens=ledger)))
        tokens = {r: ledger.issue("a", "", r) for r in ("r1", "r2", "r3")}
        if rank == 0:
            ledger.end("r1", "r2")
        ActorLink._share_ended_registrations(link)
        first = {r: ledger.check("a", "", t) for r, t in tokens.items()}
        if rank == 0:
            ledger.end("r3")
        ActorLink._share_ended_registrations(link)
        answers.put((rank, (first, ledger.check("a", "", tokens["r3"]), ledger.ended_after(0)[1])))
    except Exception as e:             # (reported, not lost in the child's stderr)
        answers.put((rank, repr(e)))
    finally:
        dist.destroy_process_group()


def test_the_other_ranks_learn_each_update_which_registrations_rank_0_ended():
    """Ranks > 0 check tokens with a ledger of their own: at every update rank 0 tells them what
    its control server ended since the last one (a broadcast), and they refuse those tokens too."""
    from tests.support.gloo import run_ranks
    seen = ({"r1": "stale_token", "r2": "stale_token", "r3": None}, "stale_token", 3)   # after each update
    assert run_ranks(_rank_of_a_link) == {0: seen, 1: seen}


def test_a_heartbeat_or_bye_without_the_token_changes_nothing():
    cfg = tcfg(heartbeat_timeout_s=6.0)
    control = transport.ControlServer(cfg, welcome_fn_for(["tcp://127.0.0.1:2"]), endpoint="tcp://127.0.0.1:*")
    client = transport.LearnerClient(control.endpoint, "a", cfg)
    peer = RawPeer(control.endpoint, cfg)
    try:
        assert client.join(timeout=10) is not None
        identity = control.registry.actors["a"].identity
        assert peer.ask("heartbeat", {"actor_id": "a", "token": "x"}, timeout_ms=500) is None
        assert peer.ask("bye", {"actor_id": "a", "token": "x"}, timeout_ms=500) is None
        assert control.stats["invalid"]["unregistered"] == 2
        assert control.counts()["alive"] == 1 and control.registry.actors["a"].identity == identity
        assert peer.ask("heartbeat", {"actor_id": "nobody"}).kind == "rejoin"   # unknown: say hello
    finally:
        peer.close()
        client.close()
        control.close(notify=False)


# ------------------------------------------------------------------------------ CURVE key binding
def test_with_curve_an_actor_id_belongs_to_the_key_that_registered_it(tmp_path):
    keys = tmp_path / "keys"
    assert cli.main(["keygen", str(keys), "--clients", "2"]) == 0
    learner = tcfg(keys_dir=str(keys), heartbeat_timeout_s=6.0)
    first, second = (tcfg(keys_dir=str(keys / "clients" / f"client_00{i}")) for i in (0, 1))
    receiver = transport.SegmentReceiver(learner, 0, SPEC, endpoint="tcp://127.0.0.1:*")
    control = transport.ControlServer(learner, welcome_fn_for([receiver.endpoint]), endpoint="tcp://127.0.0.1:*")
    weights = transport.WeightServer(learner, endpoint="tcp://127.0.0.1:*")
    weights.publish(1, {"w": np.zeros(2, np.float32)})
    actor = transport.LearnerClient(control.endpoint, "a", first)
    other = RawPeer(control.endpoint, second)                 # an authorised key, not a's
    stolen, notified = None, False
    clients = [actor]
    try:
        assert actor.join(timeout=10) is not None
        identity, token = control.registry.actors["a"].identity, actor.token
        reply = other.ask("hello", {"actor_id": "a", "host": "h", "pid": 1, "num_envs": 0})
        assert reply.kind == "error" and "another CURVE key" in reply.meta["message"]
        assert other.ask("heartbeat", {"actor_id": "a", "token": token}, timeout_ms=500) is None
        assert other.ask("bye", {"actor_id": "a", "token": token}, timeout_ms=500) is None
        assert control.stats["invalid"] == {"wrong_key": 1, "unregistered": 2}
        assert control.counts()["alive"] == 1 and control.registry.actors["a"].identity == identity
        assert actor.learner_alive

        # a's token is worthless from the other key on the other channels too
        stolen = transport.WeightSubscriber(weights.endpoint, second, actor_id="a", token=token, wait_s=0.2)
        assert stolen.wait_newer(-1, timeout=1.5) is None and weights.stats["invalid"]["unregistered"] >= 1
        sender = transport.SegmentSender([receiver.endpoint], second)
        seg = make_segment(SPEC, B=2, actor_id="a")
        seg.meta["token"] = token
        sender.send(seg)
        assert receiver.recv(timeout_ms=1000) is None and receiver.stats["invalid"]["unregistered"] == 1
        sender.close()

        # once a has left, the other key may take the id; a's old token then no longer speaks for it
        actor.close()
        assert wait_until(lambda: control.counts()["alive"] == 0)
        clients.append(transport.LearnerClient(control.endpoint, "a", second))
        assert clients[-1].join(timeout=10) is not None and clients[-1].token != token
        old = RawPeer(control.endpoint, first)
        assert old.ask("heartbeat", {"actor_id": "a", "token": token}, timeout_ms=500) is None
        old.close()
        assert control.stats["invalid"]["stale_token"] == 1
        notified = True
        control.close(notify=True)                      # the notice reaches the id's real owner
        assert wait_until(lambda: clients[-1].finished)
    finally:
        if stolen is not None:
            stolen.close()
        for c in clients:
            c.close()
        other.close()
        if not notified:
            control.close(notify=False)
        weights.close()
        receiver.close()


# ------------------------------------------------------------------- policy files on the actor
@pytest.mark.parametrize("name", ["../x", "a/../../x", "/ABS/x", "a//b", "./x", "a/", "a\\b", "x\x00y",
                                  "x\ny", "/".join("d" * 9), "y" * 256])
def test_an_actor_refuses_policy_files_with_unsafe_names(tmp_path, monkeypatch, name):
    from asyncvla.actors.join import join
    name = name.replace("/ABS", str(tmp_path / "abs"))
    work = tmp_path / "work"                     # the actor's temporary folders go here
    work.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(work))
    learner = FakeLearner({"policy.json": b"{}", name: b"owned"})
    try:
        with pytest.raises(TransportError, match="refusing its files"):
            join(learner.endpoint, "a", tcfg(), threading.Event(), timeout=10)
    finally:
        learner.close()
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written == [] and list(work.iterdir()) == []      # nothing written, inside or out


def test_policy_files_land_inside_the_folder(tmp_path):
    from asyncvla.actors.join import _policy_dir
    files = {"policy.json": b"{}", "backbone/config.json": b"c", "adapter/w.safetensors": b"w"}
    learner = FakeLearner(files)
    client = transport.LearnerClient(learner.endpoint, "a", tcfg())
    try:
        assert client.join(timeout=10) is not None
        folder, tmp = _policy_dir({"path": "/not/here"}, client)
        try:
            got = {p.relative_to(folder).as_posix(): p.read_bytes() for p in Path(folder).rglob("*") if p.is_file()}
            assert got == files
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        client.close()
        learner.close()
    assert policy_file_parts("backbone/config.json") == ["backbone", "config.json"]


def test_the_policy_size_is_checked_on_disk_before_reading(tmp_path, monkeypatch):
    (tmp_path / "policy.json").write_text("{}")
    with open(tmp_path / "backbone.bin", "wb") as f:
        f.truncate(3 << 20)                          # 3 MiB, sparse: over the 1 MiB limit
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail(f"read {self} before checking the size"))
    cfg = tcfg(max_message_mb=1)
    control = transport.ControlServer(cfg, welcome_fn_for(["tcp://127.0.0.1:2"]), policy_dir=str(tmp_path),
                                      endpoint="tcp://127.0.0.1:*")
    client = transport.LearnerClient(control.endpoint, "a", cfg)
    try:
        assert client.join(timeout=10) is not None
        with pytest.raises(TransportError, match="policy directory is 3 MiB > transport.max_message_mb"):
            client.fetch_policy_files(timeout=10)
        control.check()                              # the serving thread read nothing and lives
    finally:
        client.close()
        control.close(notify=False)


# ----------------------------------------------------------------------------------------- logs
def test_control_characters_from_a_peer_cannot_forge_log_lines(caplog):
    control = transport.ControlServer(tcfg(), welcome_fn_for(["tcp://127.0.0.1:2"]), endpoint="tcp://127.0.0.1:*")
    peer = RawPeer(control.endpoint, tcfg())
    evil = "evil\n2099-01-01 learner INFO forged\r\x1b[31m\u202e"
    try:
        with caplog.at_level(logging.INFO, logger="asyncvla.transport"):
            assert peer.ask("hello", {"actor_id": evil, "host": "h\nx", "pid": 1, "num_envs": 0}).kind == "welcome"
            assert peer.ask("get_policy_files", {"actor_id": evil, "token": "x"}).kind == "error"
    finally:
        peer.close()
        control.close(notify=False)
    joined = [r.getMessage() for r in caplog.records if "joined" in r.getMessage()]
    assert joined == ["actor evil\\n2099-01-01 learner INFO forged\\r\\x1b[31m\\u202e joined (h\\nx pid 1)"]
    for r in caplog.records:
        assert not any(c in r.getMessage() for c in "\n\r\x1b\u202e"), r.getMessage()
    assert printable("x" * 300, 10) == "xxxxxxxxxx...(+290 chars)"


# ------------------------------------------------------------------------------ no answer at all
def test_an_actor_without_keys_says_why_a_curve_learner_is_silent_and_gives_up(tmp_path):
    keys = tmp_path / "keys"
    assert cli.main(["keygen", str(keys)]) == 0
    control = transport.ControlServer(tcfg(keys_dir=str(keys)), welcome_fn_for(["tcp://127.0.0.1:2"]),
                                      endpoint="tcp://127.0.0.1:*")
    started = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "asyncvla.launch.cli", "actor", "--learner", control.endpoint,
                               "--join-timeout", "8"], cwd=REPO, capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, PYTHONUNBUFFERED="1"))
    finally:
        control.close(notify=False)
    lines = proc.stderr.splitlines()
    warning = next(i for i, line in enumerate(lines) if "WARNING no answer from the learner at" in line)
    assert "pass --keys-dir DIR" in lines[warning] and "still trying" in lines[warning]
    assert proc.returncode == 1 and lines[-1].startswith("asyncvla actor: no answer from the learner at")
    assert time.monotonic() - started < 60 and control.counts()["joined_total"] == 0


# ---------------------------------------------------------------------- the run's join secret
def test_without_keys_only_holders_of_the_run_s_join_secret_may_say_hello(tmp_path):
    """RUN/join_secret is drawn once (0600) and kept; a control server given it refuses a hello
    without it or with another, in one counted line and an error saying why; the actor command
    without it exits 1 with that line, and with --run-dir RUN it joins."""
    from asyncvla.common.transport.auth import JOIN_SECRET_ENV, ensure_join_secret, read_join_secret
    secret = ensure_join_secret(tmp_path)
    assert ensure_join_secret(tmp_path) == secret == read_join_secret(tmp_path) and len(secret) == 64
    assert oct((tmp_path / "join_secret").stat().st_mode & 0o777) == "0o600"
    cfg = tcfg(heartbeat_timeout_s=30.0)
    control = transport.ControlServer(cfg, welcome_fn_for(["tcp://127.0.0.1:2"]), endpoint="tcp://127.0.0.1:*",
                                      join_secret=secret)
    peer = RawPeer(control.endpoint, cfg)
    hello = {"actor_id": "outsider", "host": "h", "pid": 1, "num_envs": 0}
    try:
        for meta, reason in ((hello, "no_join_secret"), ({**hello, "join_secret": "0" * 64}, "wrong_join_secret"),
                             ({**hello, "join_secret": "é"}, "wrong_join_secret")):
            reply = peer.ask("hello", meta)
            assert reply.kind == "error" and reply.meta["reason"] == reason, reply.meta
            assert "join secret" in reply.meta["message"] and "--run-dir" in reply.meta["message"]
        assert dict(control.stats["invalid"]) == {"no_join_secret": 1, "wrong_join_secret": 2}
        assert peer.ask("hello", {**hello, "join_secret": secret}).kind == "welcome"
        env = {k: v for k, v in os.environ.items() if k != JOIN_SECRET_ENV}
        refused = subprocess.run([sys.executable, "-m", "asyncvla.launch.cli", "actor", "--learner", control.endpoint,
                                  "--actor-id", "a"], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
        assert refused.returncode == 1, refused.stderr[-2000:]
        assert refused.stderr.strip().splitlines()[-1].startswith("asyncvla actor: learner at ") and \
            "join refused" in refused.stderr.strip().splitlines()[-1], refused.stderr[-2000:]
        assert control.stats["invalid"]["no_join_secret"] == 2 and control.counts()["joined_total"] == 1
        client = transport.LearnerClient(control.endpoint, "b", cfg, join_secret=read_join_secret(tmp_path))
        try:
            assert client.join(timeout=10) is not None
        finally:
            client.close()
        bad = tmp_path / "elsewhere"
        bad.mkdir()
        no_file = subprocess.run([sys.executable, "-m", "asyncvla.launch.cli", "actor", "--learner", control.endpoint,
                                  "--run-dir", str(bad)], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
        assert no_file.returncode == 1 and "--run-dir: cannot read the run's join secret" in no_file.stderr
    finally:
        peer.close()
        control.close(notify=False)
