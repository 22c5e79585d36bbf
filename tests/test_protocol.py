"""The message codec: round trips, zero-copy views, and one rejection per kind of bad input."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

from asyncvla.common.transport import protocol as P
from asyncvla.common.transport.protocol import Limits, Segment, SegmentSpec, ValidationError
from tests.support.segments import LIMITS, as_bytearrays, make_segment, make_spec
from tests.support.wire import header_of, pack_header

def assert_same(a: Segment, b: Segment) -> None:
    assert a.meta == b.meta
    assert set(a.arrays) == set(b.arrays)
    for k in a.arrays:
        assert a.arrays[k].dtype == b.arrays[k].dtype and a.arrays[k].shape == b.arrays[k].shape, k
        assert a.arrays[k].tobytes() == b.arrays[k].tobytes(), k


# ------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("S,action_level", [(0, False), (9, True)])
def test_segment_round_trip_is_byte_identical(S, action_level):
    spec = make_spec(S=S, action_level=action_level)
    seg = make_segment(spec)
    frames = as_bytearrays(P.encode_segment(seg))
    out = P.decode_segment(frames, spec, LIMITS)
    assert_same(seg, out)
    assert out.arrays["image"].shape == (17, 8, 128, 128, 3)
    assert ("state" in out.arrays) == bool(S)


def test_decoded_arrays_view_the_received_frames():
    spec = make_spec()
    frames = as_bytearrays(P.encode_segment(make_segment(spec)))
    out = P.decode_segment(frames, spec, LIMITS)
    for name, arr in out.arrays.items():
        assert any(np.shares_memory(arr, np.frombuffer(f, np.uint8)) for f in frames if f) or not arr.size, name
    image = next(f for f in frames if np.shares_memory(out.arrays["image"], np.frombuffer(f, np.uint8)))
    image[0] ^= 0xFF                                  # writing the frame changes the array
    assert out.arrays["image"].flat[0] == image[0]


def test_small_arrays_travel_packed_in_one_frame_and_large_ones_alone():
    spec = make_spec(H=128)                           # images (128 px) large; all else small
    seg = make_segment(spec)
    frames = as_bytearrays(P.encode_segment(seg))
    order = P.wire_order(seg.arrays)                  # how actors send them
    small = [k for k in order if seg.arrays[k].nbytes < P.PACK_BELOW]
    large = [k for k in order if seg.arrays[k].nbytes >= P.PACK_BELOW]
    assert large == ["image", "final_image"] and len(frames) == 2 + len(large)
    out = P.decode_segment(frames, spec, LIMITS)
    packed = np.frombuffer(frames[1], np.uint8)
    end = 0
    for name in small:                                # in order, each at the next multiple of 8
        start = end + (-end % P.ALIGN)
        view = out.arrays[name]
        if view.size:
            assert view.__array_interface__["data"][0] - packed.__array_interface__["data"][0] == start, name
        end = start + view.nbytes
    assert len(frames[1]) == end
    assert [len(f) for f in frames[2:]] == [seg.arrays[k].nbytes for k in large]
    no_small = P.encode("weights", {"version": 1}, {"w": np.zeros(P.PACK_BELOW, np.uint8)})
    assert len(no_small) == 2                          # no packed frame when nothing is small
    assert P.decode(no_small, Limits.for_kind(P.WEIGHTS, 1)).arrays["w"].shape == (P.PACK_BELOW,)


def test_weights_round_trip_with_bf16_and_scalars():
    w = {"lora.A": np.arange(12, dtype=np.float32).reshape(3, 4), "half": np.ones(5, np.float16),
         "steps": np.array(7, np.int64), "bf": torch.tensor([1.5, -2.25, 3e38], dtype=torch.bfloat16)}
    frames = as_bytearrays(P.encode_weights(9, w))
    version, out = P.decode_weights(frames, Limits.for_kind(P.WEIGHTS, 64))
    assert version == 9
    assert out["lora.A"].tobytes() == w["lora.A"].tobytes() and out["lora.A"].shape == (3, 4)
    assert out["half"].dtype == np.float16 and out["steps"].shape == () and int(out["steps"]) == 7
    assert out["bf"].dtype == np.float32
    np.testing.assert_array_equal(out["bf"], w["bf"].float().numpy())


def test_control_round_trip_with_files():
    files = {"policy.json": b'{"a": 1}', "backbone/model.bin": bytes(range(256)) * 10, "empty": b""}
    msg = P.decode_control(as_bytearrays(P.encode_control("policy_files", files=files)),
                           Limits.for_kind("control", 8), "policy_files")
    assert P.files_of(msg) == files


def test_encode_refuses_dtypes_outside_the_allow_list():
    with pytest.raises(TypeError, match="float64"):
        P.encode("weights", {"version": 1}, {"x": np.zeros(3)})
    with pytest.raises(TypeError, match="object"):
        P.encode("weights", {"version": 1}, {"x": np.array([None, 1])})
    seg = make_segment(make_spec(T=2, B=1, H=8))         # an array the schema lacks travels, and is refused
    seg.arrays["extra"] = np.zeros(1, np.uint8)
    with pytest.raises(ValidationError, match="unexpected \\['extra'\\]"):
        P.decode_segment(P.encode_segment(seg), make_spec(T=2, B=1, H=8), LIMITS)


# ------------------------------------------------------------------------------- rejections
SMALL = make_spec(T=4, B=2, H=16, L=8, K=2, D=3, S=3)


def _set_meta(key, value):
    def f(frames):
        h = header_of(frames[0])
        h["meta"][key] = value
        return [pack_header(h)] + frames[1:]
    return f


def _arrays(frames) -> tuple[dict, dict]:
    msg = P.decode(frames, LIMITS)
    return msg.meta, {k: v.copy() for k, v in msg.arrays.items()}


def _set_array(name, fn):
    """Change an array's values (or replace it: fn returns the new one) and encode again."""
    def f(frames):
        meta, arrays = _arrays(frames)
        new = fn(arrays[name])
        if new is not None:
            arrays[name] = new
        return P.encode(P.SEGMENT, meta, arrays)
    return f


def _drop_array(name):
    def f(frames):
        meta, arrays = _arrays(frames)
        del arrays[name]
        return P.encode(P.SEGMENT, meta, arrays)
    return f


def _episodes(n):
    """Replace the episode arrays with n consistent episodes."""
    def f(frames):
        meta, arrays = _arrays(frames)
        arrays.update(ep_return=np.zeros(n, np.float32), ep_length=np.ones(n, np.int64),
                      ep_success=np.zeros(n, np.uint8), ep_task=np.zeros(n, np.int64))
        return P.encode(P.SEGMENT, meta, arrays)
    return f


def _spec_entry(name, pos, value):
    """Change one layout entry (name, dtype or shape) and nothing else."""
    def f(frames):
        h = header_of(frames[0])
        next(e for e in h["layout"] if e[0] == name)[pos] = value
        return [pack_header(h)] + frames[1:]
    return f


def _deep_list(depth):
    """[[[...]]] `depth` lists deep, built without recursion."""
    out = []
    for _ in range(depth - 1):
        out = [out]
    return out


def _nested(depth):
    return lambda frames: [b"\x91" * depth + b"\x00"] + frames[1:]


CASES = {
    "empty message": (lambda f: [], "frame_count"),
    "garbage header": (lambda f: [b"\xc1\xff\x00"] + f[1:], "bad_header"),
    "header is a list": (lambda f: [msgpack.packb([1, 2])] + f[1:], "bad_header"),
    "truncated header": (lambda f: [bytes(f[0])[:-3]] + f[1:], "bad_header"),
    "nesting bomb": (_nested(20_000), "bad_header"),
    "ext type": (lambda f: [msgpack.packb(msgpack.ExtType(1, b"x"))] + f[1:], "bad_header"),
    "schema version": (lambda f: [pack_header({**header_of(f[0]), "v": 99})] + f[1:], "schema_version"),
    "wrong type": (lambda f: [pack_header({**header_of(f[0]), "type": "weights"})] + f[1:], "wrong_type"),
    "layout not bytes": (lambda f: [msgpack.packb({**header_of(f[0]), "layout": []})] + f[1:], "bad_header"),
    "frame dropped": (lambda f: f[:-1], "frame_count"),
    "frame added": (lambda f: f + [b"1234"], "frame_count"),
    "truncated frame": (lambda f: f[:1] + [bytes(f[1])[:-1]] + f[2:], "frame_size"),
    "padded frame": (lambda f: f[:1] + [bytes(f[1]) + b"\0" * 8] + f[2:], "frame_size"),
    "unknown dtype": (_spec_entry("rewards", 1, "object"), "bad_dtype"),
    "negative dim": (_spec_entry("rewards", 2, [-4, 2]), "bad_shape"),
    "huge declared shape": (_spec_entry("image", 2, [1 << 20, 1 << 20]), "frame_count"),
    "larger declared shape": (_spec_entry("image", 2, [5, 2, 16, 16, 4]), "frame_size"),
    "absurd empty shape": (_spec_entry("rewards", 2, [1 << 62, 1 << 62, 0]), "bad_shape"),
    "deep nesting": (_spec_entry("rewards", 2, _deep_list(1000)), "too_deep"),
    "deep meta": (_set_meta("act_s", _deep_list(1000)), "too_deep"),
    "float dim": (_spec_entry("rewards", 2, [4.0, 2]), "bad_shape"),
    "repeated name": (_spec_entry("rewards", 0, "image"), "bad_header"),
    "field dtype": (_set_array("rewards", lambda a: a.astype(np.float16)), "bad_dtype"),
    "missing field": (_drop_array("final_state"), "bad_fields"),
    "image size": (_set_array("image", lambda a: np.zeros((5, 2, 8, 32, 3), np.uint8)), "bad_shape"),
    "T disagrees with meta": (_set_meta("num_steps", 5), "bad_shape"),
    "meta bool": (_set_meta("seq", True), "bad_meta"),
    "meta huge int": (_set_meta("seq", (1 << 64) - 1), "bad_meta"),
    "meta unknown key": (_set_meta("pickle", "x"), "bad_meta"),
    "meta nan timing": (_set_meta("act_s", float("nan")), "bad_meta"),
    "meta token not a string": (_set_meta("token", 12), "bad_meta"),
    "meta negative version": (_set_meta("policy_version", -1), "bad_meta"),
    "nan reward": (_set_array("rewards", lambda a: a.__setitem__((0, 0), np.nan)), "not_finite"),
    "inf state": (_set_array("state", lambda a: a.__setitem__((1, 1, 1), np.inf)), "not_finite"),
    "positive logp": (_set_array("behavior_logp", lambda a: a.__setitem__((0, 0, 0), 2.0)), "out_of_range"),
    "logp -3e38": (_set_array("behavior_logp", lambda a: a.__setitem__((0, 0, 0), -3e38)), "out_of_range"),
    "huge state": (_set_array("state", lambda a: a.__setitem__((1, 1, 1), 2e30)), "out_of_range"),
    "huge final state": (_set_array("final_state", lambda a: a.__setitem__((0, 0), -1e5)), "out_of_range"),
    "timing 1e308": (_set_meta("act_s", 1e308), "bad_meta"),
    "negative timing": (_set_meta("env_s", -5.0), "bad_meta"),
    "mask not 0/1": (_set_array("instruction_mask", lambda a: a.__setitem__((0, 0, 0), 7)), "bad_values"),
    "token out of vocab": (_set_array("action_tokens", lambda a: a.__setitem__((0, 0, 0), 512)),
                           "bad_token"),
    "negative token": (_set_array("instruction", lambda a: a.__setitem__((0, 0, 0), -1)), "bad_token"),
    "final_index off a truncation": (_set_array("truncated", lambda a: a.__setitem__(slice(None), 0)),
                                     "bad_values"),
    "negative episode length": (_set_array("ep_length", lambda a: a.__setitem__(0, -3)), "bad_counter"),
    "empty episode": (_set_array("ep_length", lambda a: a.__setitem__(0, 0)), "bad_counter"),
    "episode length 2**62": (_set_array("ep_length", lambda a: a.__setitem__(0, 1 << 62)), "bad_counter"),
    "task beyond env.tasks": (_set_array("ep_task", lambda a: a.__setitem__(0, 1)), "out_of_range"),
    "negative task": (_set_array("ep_task", lambda a: a.__setitem__(0, -1)), "out_of_range"),
    # SMALL: T=4 policy steps x K=2 env steps x B=2 envs; the unmutated segment claims all 16
    "env_steps int64 max": (_set_meta("env_steps", (1 << 63) - 1), "bad_counter"),
    "env_steps one beyond the arrays": (_set_meta("env_steps", 4 * 2 * 2 + 1), "bad_counter"),
    "more episodes than env steps end": (_episodes(4 * 2 + 1), "bad_counter"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_invalid_segments_are_rejected_with_their_reason(case):
    mutate, reason = CASES[case]
    frames = [bytes(memoryview(f).cast("B")) if not isinstance(f, bytes) else f
              for f in P.encode_segment(make_segment(SMALL, B=2, truncations=1, episodes=2))]
    P.decode_segment(frames, SMALL, LIMITS)          # the unmutated message is fine
    with pytest.raises(ValidationError) as err:
        P.decode_segment(mutate(list(frames)), SMALL, LIMITS)
    assert err.value.reason == reason, str(err.value)


def _naive_value_problem(arrays: dict, vocab: int, groups) -> str | None:
    """The first group check a segment fails, field by field and element by element."""
    floats, binary, text = groups
    for name in floats:
        if name in arrays and any(not np.isfinite(float(x)) for x in arrays[name].ravel()):
            return "not_finite"
    for name in binary:
        if name in arrays and any(int(x) not in (0, 1) for x in arrays[name].ravel()):
            return "bad_values"
    for name in text:
        if name in arrays and any(not 0 <= int(x) < vocab for x in arrays[name].ravel()):
            return "bad_token"
    return None


@pytest.mark.parametrize("flow_steps", [0, 3])
@pytest.mark.parametrize("order", ["wire", "schema", "shuffled"])
def test_grouped_value_checks_match_a_field_by_field_check(order, flow_steps):
    """Floats finite, flags 0/1 and text ids in the vocabulary are checked once per group of fields
    lying side by side; whatever order a sender uses, the verdict is the per-field one."""
    rng = np.random.default_rng(7)
    spec = make_spec(T=4, B=2, H=16, L=8, K=2, D=3, S=3, vocab=512, flow_steps=flow_steps)
    groups = [names for _, _, _, names in P.check_groups(spec)]
    bad_values = {"not_finite": [np.nan, np.inf, -np.inf], "bad_values": [2, 255], "bad_token": [-1, 512, 1 << 40]}
    for trial in range(120):
        seg = make_segment(spec, B=2, truncations=int(rng.integers(0, 3)), episodes=int(rng.integers(0, 3)), rng=rng)
        arrays = {k: v.copy() for k, v in seg.arrays.items()}
        if trial % 4:                                    # one corrupt element in a random field of a group
            group = groups[int(rng.integers(3))]
            name = str(rng.choice([k for k in group if k in arrays and arrays[k].size]))
            reason = {0: "not_finite", 1: "bad_values", 2: "bad_token"}[groups.index(group)]
            arrays[name].flat[int(rng.integers(arrays[name].size))] = rng.choice(bad_values[reason])
        names = P.wire_order(arrays) if order == "wire" else list(spec.fields())
        if order == "shuffled":
            rng.shuffle(names)
        frames = P.encode(P.SEGMENT, seg.meta, {k: arrays[k] for k in names if k in arrays})
        want = _naive_value_problem(arrays, 512, groups)
        if want is None:
            P.decode_segment(frames, spec, LIMITS)
            continue
        with pytest.raises(ValidationError) as err:
            P.decode_segment(frames, spec, LIMITS)
        assert err.value.reason == want, (order, trial, str(err.value))
        assert f"'{name}'" in str(err.value)                  # names the field, not the group


def test_size_limits_apply_before_parsing():
    frames = P.encode_segment(make_segment(SMALL, B=2))
    size = P.total_bytes(frames)
    with pytest.raises(ValidationError, match="too_large"):
        P.decode_segment(frames, SMALL, Limits(max_bytes=size - 1))
    with pytest.raises(ValidationError, match="frame_count"):
        P.decode_segment(frames, SMALL, Limits(max_bytes=size, max_arrays=3))
    with pytest.raises(ValidationError, match="header_too_large"):
        P.decode_segment(frames, SMALL, Limits(max_bytes=size, max_header_bytes=16))


@pytest.mark.parametrize("kind", ["request", "control", P.WEIGHTS, P.SEGMENT])
def test_every_channel_bounds_frames_bytes_and_depth(kind):
    limits = Limits.for_kind(kind, 1)
    hello = P.encode_control("hello", {"actor_id": "a", "host": "h", "pid": 1, "num_envs": 0})
    many = [hello[0]] + [b"x"] * (limits.max_arrays + 1)
    with pytest.raises(ValidationError) as err:
        P.decode(many, limits)
    assert err.value.reason == "frame_count"
    with pytest.raises(ValidationError) as err:
        P.decode([hello[0] + bytes(limits.max_bytes)], limits)
    assert err.value.reason == "too_large"
    # ~1,000 levels: shallower than msgpack's own limit, deep enough to exhaust Python's stack
    for header in ({"type": "hello", "v": P.SCHEMA_VERSION, "meta": {}, "layout": msgpack.packb(_deep_list(1000))},
                   {"type": "hello", "v": P.SCHEMA_VERSION, "meta": {"x": _deep_list(1000)}, "layout": msgpack.packb([])},
                   {"type": _deep_list(1000), "v": P.SCHEMA_VERSION, "meta": {}, "layout": msgpack.packb([])}):
        with pytest.raises(ValidationError) as err:
            P.decode([msgpack.packb(header)], limits)
        assert err.value.reason == "too_deep"


def test_decoders_turn_unforeseen_errors_into_a_reason(monkeypatch):
    def broken(raw, limits):
        raise IndexError("a check we lack")
    monkeypatch.setattr(P.wire, "_layout", broken)
    hello = P.encode_control("hello", {"actor_id": "a", "host": "h", "pid": 1, "num_envs": 0})
    with pytest.raises(ValidationError) as err:
        P.decode_control(hello, Limits.for_kind("request", 1), "hello")
    assert err.value.reason == "decode_error" and "IndexError" in str(err.value)


def test_action_tokens_in_the_action_range_and_rewards_bounded():
    spec = make_spec(T=4, B=2, H=16, L=8, K=2, D=3, vocab=512)
    spec = SegmentSpec(**{**spec.__dict__, "first_action_id": 256, "max_abs_reward": 100.0})
    seg = make_segment(spec, B=2, truncations=1, episodes=1)
    seg.arrays["action_tokens"][:] = np.arange(seg.arrays["action_tokens"].size).reshape(
        seg.arrays["action_tokens"].shape) % 256 + 256             # every action id, [256, 512)
    seg.arrays["rewards"][0, 0] = -100.0                             # on the bound: fine
    P.decode_segment(P.encode_segment(seg), spec, LIMITS)
    cases = [("action_tokens", (0, 0, 0), 255, "bad_token"),         # a text id, below the action ids
             ("action_tokens", (1, 1, 1), -(1 << 63), "bad_token"),
             ("action_tokens", (1, 1, 1), 512, "bad_token"),
             ("instruction", (0, 0, 0), 0, None),                    # text ids may be anything in the vocab
             ("rewards", (0, 1), 3e38, "bad_reward"),
             ("rewards", (0, 1), -100.5, "bad_reward")]
    for name, where, value, reason in cases:
        arrays = {k: v.copy() for k, v in seg.arrays.items()}
        arrays[name][where] = value
        bad = P.Segment(seg.meta, arrays)
        if reason is None:
            P.decode_segment(P.encode_segment(bad), spec, LIMITS)
            continue
        with pytest.raises(ValidationError) as err:
            P.decode_segment(P.encode_segment(bad), spec, LIMITS)
        assert err.value.reason == reason, (name, value, str(err.value))


def test_episode_stats_within_the_env_limit_and_the_reward_bound():
    """Each ended episode lasts 1..max_episode_steps env steps and returns at most its length x
    max_abs_reward in size: one absurd episode would own the env/* metrics of an update."""
    spec = SegmentSpec(**{**SMALL.__dict__, "max_abs_reward": 2.0, "max_episode_steps": 50})
    seg = make_segment(spec, B=2, truncations=1, episodes=2)
    seg.arrays["ep_length"][:] = [1, 50]                             # both bounds: fine
    seg.arrays["ep_return"][:] = [-2.0, 100.0]                       # 1 x 2 and 50 x 2: fine
    P.decode_segment(P.encode_segment(seg), spec, LIMITS)
    f32_max = float(np.finfo(np.float32).max)
    cases = [("ep_length", 51, "bad_counter"), ("ep_length", 0, "bad_counter"),
             ("ep_length", 1 << 62, "bad_counter"),
             ("ep_return", f32_max, "bad_reward"), ("ep_return", -2.5, "bad_reward"),
             ("ep_return", np.inf, "not_finite")]
    for name, value, reason in cases:
        arrays = {k: v.copy() for k, v in seg.arrays.items()}
        arrays[name][0] = value
        with pytest.raises(ValidationError) as err:
            P.decode_segment(P.encode_segment(P.Segment(seg.meta, arrays)), spec, LIMITS)
        assert err.value.reason == reason, (name, value, str(err.value))
    unbounded = SegmentSpec(**{**SMALL.__dict__})                     # the env's limit unknown here
    arrays = {k: v.copy() for k, v in seg.arrays.items()}
    arrays["ep_length"][0], arrays["ep_return"][0] = P.MAX_EPISODE_STEPS, f32_max
    P.decode_segment(P.encode_segment(P.Segment(seg.meta, arrays)), unbounded, LIMITS)
    arrays["ep_length"][0] = P.MAX_EPISODE_STEPS + 1
    with pytest.raises(ValidationError, match="bad_counter"):
        P.decode_segment(P.encode_segment(P.Segment(seg.meta, arrays)), unbounded, LIMITS)


def test_bool_arrays_must_hold_0_or_1():
    frames = P.encode_weights(1, {"m": np.array([True, False])})
    with pytest.raises(ValidationError, match="bad_values"):
        P.decode_weights([frames[0], b"\x01\x02"], Limits.for_kind(P.WEIGHTS, 1))


def test_weights_rejections():
    limits = Limits.for_kind(P.WEIGHTS, 1)
    good = P.encode_weights(2, {"w": np.ones(4, np.float32)})
    with pytest.raises(ValidationError, match="not_finite"):
        P.decode_weights([good[0], np.array([1, np.inf, 0, 0], np.float32).tobytes()], limits)
    bad_version = msgpack.unpackb(good[0])
    bad_version["meta"]["version"] = -2
    with pytest.raises(ValidationError, match="bad_meta"):
        P.decode_weights([msgpack.packb(bad_version), good[1]], limits)
    with pytest.raises(ValidationError, match="wrong_type"):
        P.decode_weights(P.encode_control("hello", {"actor_id": "a", "host": "h", "pid": 1, "num_envs": 0}), limits)
    with pytest.raises(ValueError, match="version"):
        P.encode_weights(-1, {})


def test_control_meta_is_checked():
    limits = Limits.for_kind("request", 1)
    ok = P.encode_control("hello", {"actor_id": "a", "host": "h", "pid": 3, "num_envs": 2})
    assert P.decode_control(ok, limits, "hello").meta["pid"] == 3
    good = {"actor_id": "a", "host": "h", "pid": 3, "num_envs": 2}
    for meta in ({"actor_id": "a", "host": "h", "num_envs": 2}, dict(good, pid=True), dict(good, extra=1),
                 dict(good, actor_id=5), dict(good, actor_id="a" * 300), dict(good, num_envs="2")):
        with pytest.raises(ValidationError, match="bad_meta"):
            P.decode_control(P.encode("hello", meta), limits, "hello")
    with pytest.raises(ValidationError, match="wrong_type"):
        P.decode_control(ok, limits, "bye")
    ask = {"newer_than": -1, "wait_ms": 0, "actor_id": "a", "token": "t"}
    assert P.decode_control(P.encode_control("get_weights", ask), limits, "get_weights").meta == ask
    for kind, meta in (("get_weights", {k: v for k, v in ask.items() if k != "token"}),
                       ("bye", {"actor_id": "a"}), ("get_policy_files", {"actor_id": "a", "token": 5})):
        with pytest.raises(ValidationError, match="bad_meta"):          # requests carry the token
            P.decode_control(P.encode(kind, meta), limits, kind)
    with pytest.raises(ValidationError, match="frame_count"):      # requests carry no arrays
        P.decode_control(P.encode_control("bye", {"actor_id": "a"}, files={"f": b"x"}), limits, "bye")


def test_all_finite_matches_a_naive_check():
    rng = np.random.default_rng(0)
    for trial in range(300):
        dtype = [np.float32, np.float16][trial % 2]
        a = (rng.standard_normal(rng.integers(0, 50)) * 10 ** rng.integers(0, 4)).astype(dtype)
        if a.size and trial % 3:
            a[rng.integers(a.size)] = [np.nan, np.inf, -np.inf][trial % 3]
        if a.size > 1 and trial % 7 == 0:
            a[0], a[-1] = np.inf, -np.inf                          # inf - inf: still caught
        naive = all(np.isfinite(float(x)) for x in a)
        assert P.all_finite(a) == naive
    big = np.full(1000, np.finfo(np.float32).max, np.float32)      # large but finite: no overflow
    assert P.all_finite(big)


def test_a_flow_heads_segment_carries_its_chains_and_they_are_checked():
    """flow_steps > 0: flow_chain and flow_stochastic replace action_tokens, positive behaviour
    log-densities pass, and a chain without a Gaussian step, a non-finite chain or tokens sent
    instead of chains are refused with their reason."""
    spec = make_spec(T=3, B=2, H=16, L=8, K=2, D=3, flow_steps=4)
    seg = make_segment(spec, B=2, truncations=1, episodes=1)
    assert seg.arrays["behavior_logp"].max() > 0
    back = P.decode_segment(as_bytearrays(P.encode_segment(seg)), spec, LIMITS)
    assert_same(seg, back)

    def refused(change, reason, words):
        arrays = {k: v.copy() for k, v in seg.arrays.items()}
        change(arrays)
        with pytest.raises(ValidationError) as err:
            P.decode_segment(P.encode(P.SEGMENT, seg.meta, arrays), spec, LIMITS)
        assert err.value.reason == reason and words in str(err.value), str(err.value)

    refused(lambda a: a["flow_stochastic"].__setitem__((1, 0), 0), "bad_values", "no Gaussian step")
    refused(lambda a: a["flow_chain"].__setitem__((0, 1, 2, 0, 0), np.nan), "not_finite", "'flow_chain'")
    # finite but huge (a real chain times 2e30 made every update after it non-finite): out of range
    refused(lambda a: a["flow_chain"].__imul__(np.float32(2e30)), "out_of_range", "'flow_chain' holds")
    refused(lambda a: a["behavior_logp"].__setitem__((0, 0, 0), 3e38), "out_of_range", "'behavior_logp'")
    refused(lambda a: a["flow_stochastic"].__setitem__((0, 0, 0), 2), "bad_values", "'flow_stochastic'")
    refused(lambda a: a.__setitem__("flow_chain", a["flow_chain"][:, :, :3]), "bad_shape", "'flow_chain'")
    refused(lambda a: a.update(action_tokens=np.zeros((3, 2, 6), np.int64)), "bad_fields", "unexpected ['action_tokens']")
    token_spec = make_spec(T=3, B=2, H=16, L=8, K=2, D=3)
    with pytest.raises(ValidationError, match="bad_fields"):
        P.decode_segment(P.encode_segment(seg), token_spec, LIMITS)


def test_every_float_field_of_a_segment_declares_its_range_or_has_a_check_of_its_own():
    """Finite is not enough: each float field either names a range of SegmentSpec.bounds() or is
    bounded by a check of its own (rewards and episode returns: learner.max_abs_reward); the
    timings in its meta lie in [0, MAX_SEGMENT_SECONDS], and a NaN one says so."""
    own_check = {"rewards", "ep_return"}
    for head in ("autoregressive", "parallel", "flow", "gaussian"):         # every head's replay too
        spec = make_spec(head=head, S=3)
        for name, field in spec.fields().items():
            if field.dtype == "float32":
                assert (field.bound in spec.bounds()) != (name in own_check), (head, name)
        lo, hi, _ = spec.bounds()["logp"]
        assert lo < 0 and (hi > 1 if spec.densities else 0 < hi < 0.01)
    frames = P.encode_segment(make_segment(SMALL, B=2, truncations=1, episodes=2))
    with pytest.raises(ValidationError, match="meta 'act_s' must be a finite number, got nan"):
        P.decode_segment(_set_meta("act_s", float("nan"))(list(frames)), SMALL, LIMITS)
    with pytest.raises(ValidationError, match=r"meta 'act_s'=1e\+308 is out of range"):
        P.decode_segment(_set_meta("act_s", 1e308)(list(frames)), SMALL, LIMITS)
