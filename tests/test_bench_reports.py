"""The learning benchmark's report and the results page, on made-up runs: which threshold is
compared, each seed's figures, the ratio to sync, and that a benchmark run alone rewrites only its
own section of docs/results.md; and where a benchmark keeps its cached stages.
Pure functions, well under a second."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np

from tests.benchmarks import learning, report, results_page


def _run(times_to, success_end, updates, wait_s, train_s):
    """A run's curve: the SFT point at 10 %, then 20 % and 40 % at the given wall times."""
    t20, t40 = times_to
    curve = [{"wall_s": 0.0, "env_steps": 0, "step": 0, "success": 0.1, "ci_low": 0.0, "ci_high": 0.2},
             {"wall_s": t20, "env_steps": int(100 * t20), "step": 5, "success": 0.2, "ci_low": 0.1, "ci_high": 0.3},
             {"wall_s": t40, "env_steps": int(100 * t40), "step": 9, "success": success_end, "ci_low": 0.3,
              "ci_high": 0.5}]
    return {"curve": curve, "updates": updates, "train_s": train_s, "rollout_s": wait_s, "policy_lag_mean": 1.0}


def _results():
    runs = {"sync": {s: _run((100.0 + s, 300.0 + 10 * s), 0.4, 30, 5.0, 4.0) for s in range(3)},
            "async": {s: _run((50.0 + s, 150.0 + 10 * s), 0.45, 60, 0.5, 4.5) for s in range(3)}}
    return {"thresholds": [0.5, 0.4, 0.3, 0.2, 0.1], "sft": {"success": 0.1, "ci_low": 0.0, "ci_high": 0.2}, "runs": runs, "seeds": [0, 1, 2],
            "calibration": None, "profile": "plain", "tag": "maniskill", "env_id": "PushCube-v1", "episodes": 64}


def test_summary_compares_at_the_highest_threshold_every_run_reaches():
    results = _results()
    s = learning.summarize(results)
    assert s["threshold"] == 0.4                     # 0.5 is reached by no run; 0.1 is the warm start's
    assert s["thresholds"] == [0.5, 0.4, 0.3, 0.2]
    assert s["arms"]["sync"]["to"][0.4]["wall_s"][0] == np.mean([300, 310, 320])
    assert s["arms"]["sync"]["to"][0.5] == {"reached": 0, "of": 3}
    r = s["ratios"]["async"][0.4]
    assert abs(r["wall_s"][0] - 160 / 310) < 1e-9 and r["wall_s"][1] <= r["wall_s"][0] <= r["wall_s"][2]
    assert 0.5 not in s["ratios"]["async"] and set(s["ratios"]["async"]) == {0.4, 0.3, 0.2}
    assert r["resolution"] == np.sqrt(r["wall_s"][2] / r["wall_s"][1])
    assert s["sync_rollout_to_train"] == [1.25] * 3  # measured, not modelled: reported for every profile
    # at 5 min a sync run holds 20 % (its 40 % comes at 300-320 s); async runs ended at 40-45 %, and hold it
    assert s["arms"]["sync"]["at_time"][300.0]["mean"][0] == (0.4 + 0.2 + 0.2) / 3
    assert s["arms"]["async"]["at_time"][600.0]["mean"][0] == 0.45

    results["summary"] = s
    md = learning.markdown(results)
    assert ("| sync | 310 [300, 320] | 300, 310, 320 | 31 [30, 32] | - | - | 40 % [40, 40] | 30 | 1.0 | 5.0 / 4.0 |"
            in md)
    assert "| async | 160 [150, 170] | 150, 160, 170 | 16 [15, 17] | 0.52 [" in md
    assert "| sync | 0/3 | 310 [300, 320] |" in md                        # every threshold, reached or not
    assert "| async | 2 | - | 170 s, 17 k |" in md                         # every seed's figures
    names = [f.name for f in learning.figures(results)]
    assert "sync: rollout / train time" in names and "async / sync: time to 40%" in names


def test_a_headline_threshold_not_every_run_reaches_is_reported_as_such():
    """With the task's top threshold fixed (progress-based runs), an arm some of whose runs fall
    short gets a count, not a mean, and no ratio."""
    results = _results()
    results["runs"]["async"][2]["curve"][-1]["success"] = 0.35
    results["top"] = 0.4
    results["summary"] = s = learning.summarize(results)
    assert s["threshold"] == 0.4 and s["arms"]["async"]["to"][0.4] == {"reached": 2, "of": 3}
    assert 0.4 not in s["ratios"]["async"]
    md = learning.markdown(results)
    assert "| async | 2/3 reached | 150, 160, - | - | not reached by all | - |" in md
    figs = {f.name: f for f in learning.figures(results)}
    assert figs["async: time to 40%"].value is None and "reached by 2 of 3" in figs["async: time to 40%"].note


def test_arms_from_their_own_warm_starts_are_judged_against_them_and_against_async():
    """The heads comparison: the flow arm starts from its own (higher) warm start. A run is raised
    when its last evaluation's lower bound clears its own warm start's upper bound, and each arm's
    end is set against async's with an interval; without a sync arm there is no ratio column."""
    results = _results()
    flow = {s: _run((20.0, 200.0), 0.5, 40, 0.5, 4.5) for s in range(3)}
    flow[1]["curve"][-1]["ci_low"] = 0.25                    # seed 1 does not clear its warm start
    results["runs"] = {"async": results["runs"]["async"], "async_flow": flow}
    results["warm_starts"] = {"async": results["sft"], "async_flow": {"success": 0.2, "ci_low": 0.12, "ci_high": 0.28}}
    s = learning.summarize(results)
    assert [p["raised"] for p in s["arms"]["async"]["per_seed"].values()] == [True] * 3    # 0.3 > 0.2
    assert [p["raised"] for p in s["arms"]["async_flow"]["per_seed"].values()] == [True, False, True]
    d = s["final_vs_baseline"]["async_flow"]
    assert abs(d[0] - 0.05) < 1e-9 and d[1] <= d[0] <= d[2] and set(s["final_vs_baseline"]) == {"async_flow"}
    results["summary"] = s
    md = learning.markdown(results)
    assert "| async_flow | 20 % [12, 28] | 50 % [30, 50], 50 % [25, 50], 50 % [30, 50] | 2/3 | +5 [" in md
    assert "| async | 10 % [0, 20] | " in md and "not reached by all" not in md


def test_lag_in_updates_counts_the_publish_interval():
    results = _results()
    results["publish_interval"] = {"sync": 1, "async": 4}
    s = learning.summarize(results)
    assert [p["lag_updates"] for p in s["arms"]["async"]["per_seed"].values()] == [4 * 1.0 + 1.5] * 3
    assert learning.iqm([5, 1, 3, 100, 2]) == 10 / 3          # the middle three of five


def test_a_run_keeps_only_the_checkpoints_its_curve_is_made_of(tmp_path):
    import json
    import os

    from asyncvla.learner import checkpoint
    run = tmp_path / "run"
    (run / checkpoint.CHECKPOINTS).mkdir(parents=True)
    (run / "launch_config.yaml").write_text("")
    os.utime(run / "launch_config.yaml", (1000.0, 1000.0))              # the launcher's start
    saved_at = {5: 1020.0, 10: 1045.0, 15: 1070.0, 20: 1090.0, 25: 1150.0, 30: 1160.0}
    for step, t in saved_at.items():                # every 5 updates, 10-60 s apart
        tag = run / checkpoint.CHECKPOINTS / checkpoint.tag_name(step)
        tag.mkdir()
        (tag / "model_states.pt").write_bytes(b"x" * step)
        checkpoint.mark_complete(tag, ["model_states.pt"], step=step, world_size=1, zero_stage=3, bf16=False)
        marker = json.loads((tag / checkpoint.MARKER).read_text())
        (tag / checkpoint.MARKER).write_text(json.dumps(dict(marker, saved_at=t)))
    (run / checkpoint.CHECKPOINTS / checkpoint.tag_name(35)).mkdir()      # a save cut short: no marker

    chosen = [t.name for t in learning.evaluated_checkpoints(run, 50.0)]
    assert chosen == ["step_00000015", "step_00000025", "step_00000030"]   # >= 50 s apart, and the last
    learning.prune_checkpoints(run, 50.0)
    left = sorted(d.name for d in (run / checkpoint.CHECKPOINTS).iterdir() if d.is_dir())
    assert left == [*chosen, "step_00000035"]              # the incomplete one is not the benchmark's to judge
    assert [t.name for t in learning.evaluated_checkpoints(run, 50.0)] == chosen    # pruning twice is a no-op
    assert checkpoint.resolve(run).name == "step_00000030"


def test_results_page_keeps_the_sections_a_run_did_not_make():
    old_page = ("# Results\n\n## Performance\n\nold performance table\n\n## Learning over seeds\n\nThe pixel "
                "task; measured on 2 cores, A CPU, 8 GB; commit abc; today. Means.\n\n| a | b |\n|---|---|\n"
                "| sync | 1 |\n\n![plot](learning_model.png)\n")
    md = "| arm | x |\n|---|---|\n| async | 2 |\n"
    env = {"hardware": {"cores": 2, "cpu": "B CPU", "memory_gb": 16}, "commit": "def", "time": "now"}
    page = results_page.render(None, {"maniskill": (md, env)}, old_page)
    assert "old performance table" in page and "| sync | 1 |" in page     # kept: no new inputs for them
    assert "## Learning on ManiSkill" in page and "| async | 2 |" in page and "commit def" in page
    assert "measured on 2 cores, A CPU, 8 GB; commit abc; today." in page   # each section names its machine
    assert "Measured on 2 cores, B CPU, 16 GB" in page
    assert "(learning_model.png)" in page and "(learning_maniskill.png)" in page
    assert results_page.render(None, {}, page) == page                     # nothing new: nothing changes
    heads_md = "| arm | warm start |\n|---|---|\n| async_flow | 40 % |\n"
    with_heads = results_page.render(None, {"heads": (heads_md, env)}, page)
    assert "## Learning with each action head" in with_heads and "| async_flow | 40 % |" in with_heads
    assert "| async | 2 |" in with_heads and "old performance table" in with_heads


def test_a_benchmarks_cached_stages_go_beside_its_json(tmp_path, monkeypatch):
    """`--out DIR/x.json` moves the stages a benchmark caches (learning: OUT/learning/) to DIR too, so
    a second run with another --out starts from nothing instead of reusing the first's runs."""
    seen = []
    fake = types.SimpleNamespace(__doc__="A fake benchmark.", __name__="fake", __spec__=None,
                                 run=lambda quick, out_dir=Path("bench_results"): seen.append(out_dir) or {},
                                 figures=lambda results: [])
    monkeypatch.setattr(sys, "argv", ["fake", "--out", str(tmp_path / "second" / "fake.json")])
    report.main(fake)
    assert seen == [tmp_path / "second"] and (tmp_path / "second" / "fake.json").exists()


def test_the_gpu_node_script_dry_run_checks_the_config_and_names_both_arms(tmp_path):
    """tests/benchmarks/gpu_node.sh --dry-run on this machine: the GPU profile's config loads with
    each arm's overrides, and the JSON lists the commands and the fields a real run reports."""
    import json
    import subprocess

    from tests.benchmarks import async_sync
    from tests.support.paths import REPO

    r = subprocess.run(["bash", "tests/benchmarks/gpu_node.sh", str(tmp_path), "--dry-run", "--time-s", "90"],
                       cwd=REPO, env={**__import__("os").environ, "PYTHON": sys.executable},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads((tmp_path / "async_sync_gpu.json").read_text())["results"]
    assert got["dry_run"] and got["device"] == "cuda" and got["config"] == "configs/maniskill_gpu.yaml"
    for mode, sync in (("sync", "true"), ("async", "false")):
        assert {f"launch.sync={sync}", "actor.device=cuda", "learner.max_time_s=90.0"} <= set(got["overrides"][mode])
        assert f"{mode}: asyncvla train configs/maniskill_gpu.yaml" in r.stdout
    assert got["samples_per_update"] == 24 * 16                  # the config's batch: 24 trajectories x 16 steps
    assert got["schema"] == {"arm": list(async_sync.ARM_FIELDS), "overlap": list(async_sync.OVERLAP_FIELDS)}


def test_an_arm_reports_every_field_the_schema_names():
    """steady_state and overlap on made-up tensorboard scalars: the fields the dry run promises,
    the window after the warm-up updates, and the bound from the sync arm's phase times."""
    from tests.benchmarks import async_sync

    def scalars(step_s, idle_s, period):
        steps = range(1, 11)
        return {"time/learner_step_s": [(u, 100 + u * period, step_s) for u in steps],
                "time/learner_idle_s": [(u, 100 + u * period, idle_s) for u in steps],
                "time/publish_s": [(u, 100 + u * period, 0.01) for u in steps],
                "rollout/env_steps": [(u, 100 + u * period, 50.0 * u) for u in steps],
                "rollout/policy_lag_mean": [(u, 100 + u * period, 1.0) for u in steps],
                "rollout/policy_lag_max": [(u, 100 + u * period, 2.0) for u in steps]}

    sync = async_sync.steady_state(scalars(2.0, 6.0, 8.0), samples_per_update=40)
    asyn = async_sync.steady_state(scalars(2.1, 0.1, 6.0), samples_per_update=40)
    extra = {"cpu", "gpu", "startup_s", "shutdown_s"}                # train_run adds these around the window
    assert set(sync) | extra == set(async_sync.ARM_FIELDS)
    assert sync["updates"] == 7 and sync["samples_per_s"] == 7 * 40 / (7 * 8.0) and sync["updates_per_s"] == 1 / 8
    o = async_sync.overlap(sync, asyn, two_busy_cores=0.9)
    assert set(o) == set(async_sync.OVERLAP_FIELDS)
    assert o["bound"] == 8.0 / 6.0 and abs(o["speedup"] - 8.0 / 6.0) < 1e-12 and abs(o["fraction_of_bound"] - 1) < 1e-12
