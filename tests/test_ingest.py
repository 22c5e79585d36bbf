"""The learner's inbox on real ZeroMQ sockets (loopback): the lag rule holds for every column an
update takes, including columns left over in the buffer while the learner moved on; drops are
counted by reason; a dead server thread stops the wait with an error naming it. And the rollout
plan the learner sends each actor in its welcome, and the segment spec it validates against."""

import collections
import threading
import time

import numpy as np
import pytest

from asyncvla.common.transport import protocol as P
from asyncvla.common import transport
from asyncvla.common.config import Config, TransportConfig
from asyncvla.common.transport.control import ControlServer, LearnerClient
from asyncvla.common.transport.sockets import ThreadDied
from asyncvla.common.transport.weight_channel import WeightServer, WeightSubscriber
from asyncvla.learner.ingest import MAX_SEQ_JUMP, ColumnBuffer, Inbox, SeenSegments, rollout_plan
from asyncvla.learner.metrics import Metrics, TargetWatch, windowed_success
from tests.support.segments import LIMITS, make_segment, make_spec

SPEC = make_spec(T=2, B=4, H=8, L=4, K=2, D=2)


@pytest.fixture
def link():
    cfg = TransportConfig(linger_ms=200)
    receiver = transport.SegmentReceiver(cfg, 0, SPEC, endpoint="tcp://127.0.0.1:*")
    sender = transport.SegmentSender([receiver.endpoint], cfg)
    yield receiver, sender
    sender.close()
    receiver.close()


def send(sender, version: int, seq: int, actor: str = "a"):
    seg = make_segment(SPEC, B=4, seq=seq, actor_id=actor)
    seg.meta["policy_version"] = version
    assert sender.send(seg)


def test_columns_older_than_the_lag_never_reach_an_update(link):
    receiver, sender = link
    seen = []
    inbox = Inbox(receiver, max_policy_lag=1, on_segment=lambda seg, lag: seen.append(lag))
    stop = threading.Event()

    send(sender, version=0, seq=0)
    assert inbox.fill(2, version=0, stop=stop)
    assert list(inbox.take(2).versions) == [0, 0]          # 2 columns of version 0 stay buffered

    # The learner is at version 2 now: the 2 left-over columns are stale, and so is a segment
    # that arrives late from version 0. Only version-2 columns may be taken.
    send(sender, version=0, seq=1)
    send(sender, version=2, seq=2)
    send(sender, version=3, seq=3)                         # made by weights this learner never had
    send(sender, version=2, seq=4)
    assert inbox.fill(6, version=2, stop=stop)
    batch = inbox.take(6)
    assert list(batch.versions) == [2] * 6
    assert inbox.drops == {"stale": 2, "future_version": 1, "duplicate": 0, "invalid": 0, "banned": 0}
    assert seen == [0, 0, 0]                               # the used segments, with their lags


def test_a_repeated_segment_trains_once_and_a_lying_counter_is_dropped(link):
    """The same segment 4 times: trained once, 3 dropped as duplicates, inside the balance. An
    actor restarted under the same id (a new incarnation) starts at seq 0 again and is trained;
    seqs that never came are gaps; a segment claiming more env steps than its arrays hold (it
    would end a run by learner.max_env_steps) is dropped as invalid."""
    receiver, sender = link
    used = []
    inbox, stop = Inbox(receiver, max_policy_lag=4, on_segment=lambda seg, lag: used.append(seg.meta)), \
        threading.Event()

    def segment(seq, **meta):
        seg = make_segment(SPEC, B=4, seq=seq)
        seg.meta.update(policy_version=0, **meta)
        return seg
    repeated = segment(0)
    for seg in (repeated, repeated, repeated, repeated, segment(0, incarnation=7), segment(3),
                segment(4, env_steps=(1 << 63) - 1)):
        assert sender.send(seg)
    assert inbox.fill(12, version=0, stop=stop)
    assert list(inbox.take(12).versions) == [0] * 12
    assert receiver.recv(timeout_ms=1000) is None          # (the last one, if fill did not read it)
    acc = inbox.accounting()
    assert [(m["seq"], m.get("incarnation")) for m in used] == [(0, None), (0, 7), (3, None)]
    assert acc["acked"] == 7 and acc["trained"] == 3 and acc["balanced"], acc
    assert acc["dropped"] == {"stale": 0, "future_version": 0, "duplicate": 3, "invalid": 1, "banned": 0}
    assert acc["invalid"] == {"bad_counter": 1}
    assert acc["seq_gaps"] == 2                            # seqs 1 and 2 of the first actor


def test_a_seq_far_past_the_highest_is_dropped_and_the_stream_goes_on(link):
    """seq = 2**63 - 1 in a stream that started used to be taken: every later segment of the
    actor then looked like a repeat, and seq_gaps read 9e18. It is dropped as bad_counter,
    inside the balance, and the stream takes its next seq."""
    receiver, sender = link
    used = []
    inbox = Inbox(receiver, max_policy_lag=4, on_segment=lambda seg, lag: used.append(seg.meta["seq"]))
    for seq in (0, (1 << 63) - 1, 1, 2 + MAX_SEQ_JUMP, 2):
        send(sender, version=0, seq=seq)
    assert inbox.fill(12, version=0, stop=threading.Event())
    assert receiver.recv(timeout_ms=1000) is None
    acc = inbox.accounting()
    assert used == [0, 1, 2] and acc["seq_gaps"] == 0
    assert acc["invalid"] == {"bad_counter": 2} and acc["dropped"]["invalid"] == 2 == inbox.drops["invalid"]
    assert acc["acked"] == 5 and acc["balanced"], acc


def test_seen_segments_refuse_a_jump_without_moving_the_stream():
    seen = SeenSegments(max_jump=100)
    assert seen.admit("a", 10**12) is None                  # a first segment: any seq (a learner restarted)
    assert seen.admit("a", 10**12 + 101) == "bad_counter"
    assert seen.admit("a", 10**12 + 100) is None and seen.gaps == 99
    assert seen.admit("b", 0) is None and seen.admit("b", (1 << 63) - 1) == "bad_counter"
    assert seen.admit("b", 1) is None and seen.admit("b", 1) == "duplicate"
    assert seen.gaps == 99


def test_episode_metric_sums_are_float64():
    """Episode stats summed in their own dtypes: lengths of 2**62 wrap an int64 sum round to a
    plausible value, returns at float32's maximum overflow a float32 sum to inf."""
    metrics = Metrics(None, progress_total=1, show_progress=False)
    seg = make_segment(SPEC, B=4, episodes=4)
    seg.arrays["ep_length"][:] = 1 << 62
    seg.arrays["ep_return"][:] = np.finfo(np.float32).max
    metrics.add_segment(seg, lag=0)
    assert metrics.counts["length_sum"] == 4.0 * 2**62
    assert metrics.counts["return_sum"] == 4.0 * float(np.finfo(np.float32).max)


def test_retried_starts_are_counted_apart_from_fresh_ones():
    """env.retry_failed_starts: segments say how many of their episodes were retries and how many
    of those succeeded; the report gives their share and the fresh starts' success, counted here
    against the episodes themselves, and leaves both out until a retry is seen."""
    metrics = Metrics(None, progress_total=3, show_progress=False)
    seg = make_segment(SPEC, B=4, episodes=4)
    metrics.add_segment(seg, lag=0)
    assert "env/fresh_episode_success" not in metrics.report(1, {}, {}, samples=1)
    rows = [(True, True), (True, False), (False, True), (False, True), (False, False)]   # (retried, success)
    for retried, success in rows:
        seg = make_segment(SPEC, B=4, episodes=1)
        seg.arrays["ep_success"][:] = success
        if retried:
            seg.meta.update(ep_retried=1, ep_retried_success=int(success))
        metrics.add_segment(seg, lag=0)
    report = metrics.report(2, {}, {}, samples=1)
    fresh = [s for r, s in rows if not r]
    assert report["env/retried_share"] == 2 / 5
    assert report["env/fresh_episode_success"] == sum(fresh) / len(fresh)
    assert report["env/episode_success"] == 3 / 5
    metrics.add_segment(make_segment(SPEC, B=4, episodes=2), lag=0)   # no retry in this update: 0 %
    assert metrics.report(3, {}, {}, samples=1)["env/retried_share"] == 0.0
    with pytest.raises(P.ValidationError, match="ep_retried_success"):
        P.check_segment_meta({**seg.meta, "ep_retried": 1, "ep_retried_success": 2})
    with pytest.raises(P.ValidationError, match="ep_retried"):
        P.check_segment_meta({**seg.meta, "ep_retried": -1})


def test_windowed_success_matches_a_naive_count_and_stays_bounded():
    """learner.target_success's measure: the success rate over the newest whole updates holding at
    least n episodes, against a naive recount of the whole history at every update."""
    rng = np.random.default_rng(0)
    history, recent = [], collections.deque()
    for _ in range(300):
        episodes = int(rng.integers(0, 12))
        update = (episodes, float(rng.binomial(episodes, 0.4)))
        history.append(update)
        recent.append(update)
        got = windowed_success(recent, 20)
        # naive: walk back from the newest update until 20 episodes are covered
        total = successes = 0
        for e, s in reversed(history):
            total, successes = total + e, successes + s
            if total >= 20:
                break
        assert got == (successes / total if total >= 20 else None)
        assert len(recent) <= 21        # (updates without episodes are dropped once the window is covered)


def test_the_target_success_ends_a_run_once_it_held_over_two_windows_in_a_row():
    """Metrics.report gives the window's success on real segments; TargetWatch, which the
    learner's loop stops on, fires once the target has held while a whole further window arrived."""
    metrics = Metrics(None, progress_total=10, show_progress=False, success_window=9)
    watch = TargetWatch(0.5, 9)
    decisions = []
    for successes in (0, 3, 6, 0, 6, 6, 6):      # of 6 episodes an update: 2 segments of 3
        for half in (0, 1):
            seg = make_segment(SPEC, B=4, episodes=3)
            seg.arrays["ep_success"][:] = 0
            seg.arrays["ep_success"][:(successes + 1 - half) // 2] = 1
            metrics.add_segment(seg, lag=0)
        report = metrics.report(1, {}, {}, samples=1)
        assert report["env/episodes"] == 6
        window = report.get("env/episode_success_window")
        decisions.append((window, watch.update(window, report["env/episodes"])))
    # 9 episodes take the newest 2 updates (12 episodes); the first update alone has too few.
    # The window reaches 50 % at the 3rd update, and holds it for 6 + 6 >= 9 more episodes at the 5th.
    assert decisions == [(None, False), (0.25, False), (0.75, False), (0.5, False), (0.5, True),
                         (1.0, True), (1.0, True)]


def test_a_target_crossing_that_does_not_hold_starts_the_count_again():
    watch = TargetWatch(0.8, 100)
    assert [watch.update(w, 60) for w in (0.85, 0.9, 0.7, 0.8, 0.9, 0.95)] == [False] * 5 + [True]
    assert not TargetWatch(None, 100).update(1.0, 1000)          # no target: never


def test_seen_segments_bounded_per_actor_and_in_actors():
    seen = SeenSegments(window=8, max_streams=2)
    assert all(seen.admit("a", s) is None for s in range(0, 100, 2))    # every other seq
    assert seen.gaps == 49
    assert seen.admit("a", 97) is None and seen.gaps == 48  # late, within the window: fills a gap
    assert seen.admit("a", 97) == seen.admit("a", 98) == "duplicate"
    assert seen.admit("a", 50) == "duplicate"               # far below the highest: only a repeat
    for s in range(100, 10_000):
        seen.admit("a", s)
    assert seen.held <= 2 * 8
    assert seen.admit("b", 0) is None and seen.admit("c", 0) is None    # a third stream: "a" is forgotten
    assert seen.admit("a", 9_999) is None and seen.held <= 2 * 2 * 8
    quiet = SeenSegments(count_gaps=False)                  # several ranks: each sees a share only
    assert quiet.admit("x", 0) is None and quiet.admit("x", 5) is None
    assert quiet.gaps == 0


def test_drop_stale_checks_the_whole_queue():
    """Actors run different versions: a stale segment may sit behind a fresh one."""
    buf = ColumnBuffer(max_policy_lag=2)
    arrays = make_segment(SPEC, B=4).arrays
    for version in (5, 1, 4, 2):
        buf.add(arrays, version)
    buf.drop_stale(current_version=5)
    assert buf.columns == 8 and buf.dropped["stale"] == 2
    assert sorted(set(buf.take(8).versions)) == [4, 5]


def test_fill_returns_false_on_stop(link):
    receiver, _ = link
    stop = threading.Event()
    stop.set()
    assert not Inbox(receiver, max_policy_lag=1).fill(1, version=0, stop=stop)


@pytest.mark.parametrize("ranks,local_actors,envs,batch,expect", [
    (1, 2, 8, 16, 1),      # two local actors of 8 envs fill a batch of 16 with one segment each
    (2, 2, 4, 16, 2),      # 2 ranks x 8 columns: one segment per rank from each actor
    (2, 0, 2, 16, 8),      # a standalone actor alone: a whole batch, 4 segments per rank
    (2, 2, 3, 16, 4),      # uneven: ceil(8 / 6) = 2 per rank
])
def test_rollout_plan_gives_each_actor_its_share(ranks, local_actors, envs, batch, expect):
    cfg = Config()
    cfg.launch.num_local_actors, cfg.learner.batch_trajectories = local_actors, batch
    plan = rollout_plan(cfg, ranks, envs)
    assert plan == {"segments_per_version": expect, "max_segments_in_flight": expect}
    # enough segments in flight from the expected actors to fill every rank's share
    assert plan["segments_per_version"] * max(1, local_actors) * envs >= batch


def test_rollout_plan_in_flight_setting_and_drop_oldest():
    cfg = Config()
    cfg.actor.max_segments_in_flight = 5
    assert rollout_plan(cfg, 1, 8)["max_segments_in_flight"] == 5
    cfg.actor.backpressure = "drop_oldest"
    assert rollout_plan(cfg, 1, 8)["max_segments_in_flight"] == 0         # never waits


# ------------------------------------------------------------------ what the learner relies on
@pytest.mark.parametrize("head", ["autoregressive", "parallel"])
def test_the_learners_spec_refuses_text_ids_as_actions_and_absurd_rewards(head):
    from asyncvla.common.policy.action_tokenizer import ActionTokenizer
    from asyncvla.common.policy.heads import make_head
    cfg = Config()
    cfg.policy.image_size, cfg.actor.rollout_length, cfg.policy.action_head = 8, 2, head
    tokenizer = ActionTokenizer(n_bins=256, vocab_size=1024)
    spec = P.SegmentSpec.for_policy(cfg, make_head(cfg.policy), tokenizer)
    seg = make_segment(spec, B=2, truncations=0, episodes=0)
    seg.arrays["action_tokens"] = seg.arrays["action_tokens"] % 256 + tokenizer.first_id
    P.decode_segment(P.encode_segment(seg), spec, LIMITS)
    for name, value, reason in [("action_tokens", tokenizer.first_id - 1, "bad_token"),
                                ("rewards", 2 * cfg.learner.max_abs_reward, "bad_reward")]:
        arrays = dict(seg.arrays, **{name: seg.arrays[name].copy()})
        arrays[name].flat[0] = value
        with pytest.raises(P.ValidationError) as err:
            P.decode_segment(P.encode_segment(P.Segment(seg.meta, arrays)), spec, LIMITS)
        assert err.value.reason == reason


@pytest.mark.parametrize("dead", ["control-server", "weight-server"])
def test_a_dead_server_thread_stops_the_learner_and_names_it(link, monkeypatch, dead):
    from asyncvla.learner.servers import check_alive

    def bug(self, *args):                 # not something a peer can cause: a bug of ours
        raise KeyError("a bug of ours")
    monkeypatch.setattr(ControlServer if dead == "control-server" else WeightServer,
                        "_on_message" if dead == "control-server" else "_on_request", bug)
    receiver, _ = link
    cfg = TransportConfig(linger_ms=200)
    servers = (ControlServer(cfg, welcome_fn=lambda hello: {}, endpoint="tcp://127.0.0.1:*"),
               WeightServer(cfg, endpoint="tcp://127.0.0.1:*"))
    client = LearnerClient(servers[0].endpoint, "a", cfg)
    subscriber = WeightSubscriber(servers[1].endpoint, cfg, actor_id="a", token="")   # refused, if served
    stop = threading.Event()
    timer = threading.Timer(20, stop.set)          # without a watchdog, fill would wait for data for ever
    timer.start()
    try:
        client.join(timeout=0.2)                   # a hello, and a weights request, reach the servers
        inbox = Inbox(receiver, 4, watchdog=lambda: check_alive(servers))
        started = time.monotonic()
        with pytest.raises(ThreadDied, match=f"the {dead} thread died: KeyError"):
            inbox.fill(4, 0, stop)
        assert time.monotonic() - started < 5
        servers[dead == "control-server"].check()                   # the other one is fine
    finally:
        timer.cancel()
        client.close()
        subscriber.close()
        servers[0].close(notify=False)
        servers[1].close()
