"""Component placement (launch.placement): core specs, each process's share, errors that name the
key and the value, and real pinning of a process and its threads."""

import os
import subprocess
import sys
import textwrap

import pytest

from asyncvla.common import placement
from asyncvla.common.config import ConfigError, load_config

CORES = sorted(os.sched_getaffinity(0))


@pytest.mark.parametrize("spec, want", [
    ("all", list(range(8))), ("3", [3]), ("0-3", [0, 1, 2, 3]), ("0-1,4,6-7", [0, 1, 4, 6, 7]),
    (" 5 , 2-3 ", [2, 3, 5]), ("1,1,0-1", [0, 1]),
])
def test_parse_cores(spec, want):
    assert placement.parse_cores(spec, set(range(8)), "k") == want


@pytest.mark.parametrize("spec, words", [
    ("a-b", ["k='a-b'", "'a-b' is not a core spec", "0-1,4,6-7"]),
    ("", ["no cores named"]),
    ("3-1", ["range 3-1 is reversed"]),
    ("9", ["core 9 does not exist", "cores 0-7"]),
    ("6-11", ["cores 8-11 do not exist"]),
    ("0;1", ["'0;1' is not a core spec"]),
])
def test_parse_errors_name_key_value_and_allowed(spec, words):
    with pytest.raises(ConfigError) as e:
        placement.parse_cores(spec, set(range(8)), "k")
    for w in words:
        assert w in str(e.value)


def test_plan_slices_learner_ranks_and_shares_actor_cores():
    cfg = type("P", (), {"learner": "0-4", "actors": "6-7"})
    p = placement.plan(cfg, 2, 3, set(range(8)))
    assert p.learner == [[0, 1, 2], [3, 4]]             # even, disjoint, first one core larger
    assert p.actors == [[6, 7]] * 3
    assert p.pin_learner and p.pin_actors
    fewer = placement.plan(type("P", (), {"learner": "0", "actors": "all"}), 2, 1, set(range(8)))
    assert fewer.learner == [[0], [0]] and not fewer.pin_actors      # fewer cores than ranks: shared
    assert fewer.actors == [list(range(8))]


def test_compact_round_trips():
    for cores in ([0, 1, 2, 5], [3], [0, 2, 4], list(range(16))):
        assert placement.parse_cores(placement.compact(cores), set(range(16)), "k") == cores


@pytest.mark.parametrize("override, words", [
    (f"launch.placement.learner={max(CORES) + 1}", ["launch.placement.learner", f"core {max(CORES) + 1} does not"]),
    ("launch.placement.actors=x", ["launch.placement.actors='x'", "is not a core spec"]),
    (f"launch.placement.learner={CORES[0]}", None),
    ("launch.placement.gpus=0", ["launch.placement.gpus", "allowed keys"]),
])
def test_config_errors(override, words):
    overrides = [override]
    if words is None:      # learner and actors on the same explicit core: overlap
        overrides.append(f"launch.placement.actors={CORES[0]}")
        words = ["launch.placement.learner", "launch.placement.actors", "share cores", "all"]
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    for w in words:
        assert w in str(e.value)


def test_defaults_pin_nothing():
    cfg = load_config(None, [])
    p = placement.plan(cfg.launch.placement, 2, 2, set(CORES))
    assert not p.pin_learner and not p.pin_actors
    assert "not pinned" in placement.summary(p, set(CORES))


def run_python(code: str, env: dict | None = None) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         env=dict(os.environ, **(env or {})), timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_apply_pins_every_thread_and_sizes_torch():
    """A thread started before pinning is pinned too; torch runs one thread per core given."""
    core = CORES[-1]
    got = run_python(f"""
        import os, threading, time
        from asyncvla.common import placement
        started = threading.Event()
        t = threading.Thread(target=lambda: (started.set(), time.sleep(5)), daemon=True)
        t.start(); started.wait()
        placement.apply([{core}])
        import torch
        tids = os.listdir("/proc/self/task")
        print(sorted({{c for tid in tids for c in os.sched_getaffinity(int(tid))}}), torch.get_num_threads())
    """)
    assert got == f"[{core}] 1"


def test_actor_and_learner_pin_what_placement_gives():
    """The actor takes its cores from the launcher's env var; a learner rank pins its own slice."""
    core = CORES[0]
    got = run_python("""
        import os
        from asyncvla.common import placement
        placement.apply(placement.cores_from_env(), threads=False)
        print(sorted(os.sched_getaffinity(0)))
    """, {placement.CORES_ENV: str(core)})
    assert got == f"[{core}]"
    got = run_python(f"""
        import os
        from asyncvla.common.config import load_config
        from asyncvla.learner.main import _pin_to_cores
        _pin_to_cores(load_config(None, ["launch.placement.learner={CORES[-1]}"]))
        import torch
        print(sorted(os.sched_getaffinity(0)), torch.get_num_threads())
    """, {"LOCAL_RANK": "0", "LOCAL_SIZE": "1"})
    assert got.splitlines()[-1] == f"[{CORES[-1]}] 1"
