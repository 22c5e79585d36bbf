"""The learning benchmark's report and the results page, on made-up runs: which threshold is
compared, each seed's figures, the ratio to sync, and that a benchmark run alone rewrites only its
own section of docs/results.md and the README. Pure functions, well under a second."""

from __future__ import annotations

import numpy as np

from tests.benchmarks import learning, results_page


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
    return {"thresholds": [0.5, 0.4, 0.3, 0.2, 0.1], "sft": {"success": 0.1}, "runs": runs, "seeds": [0, 1, 2],
            "calibration": None, "profile": "plain", "tag": "maniskill", "env_id": "PushCube-v1", "episodes": 64}


def test_summary_compares_at_the_highest_threshold_every_run_reaches():
    results = _results()
    s = learning.summarize(results)
    assert s["threshold"] == 0.4                     # 0.5 is reached by no run; 0.1 is the warm start's
    assert s["arms"]["sync"]["wall_s"][0] == np.mean([300, 310, 320])
    r = s["ratios"]["async"]
    assert r["threshold"] == 0.4 and abs(r["wall_s"][0] - 160 / 310) < 1e-9 and r["wall_s"][1] <= r["wall_s"][0] <= r["wall_s"][2]
    assert s["sync_rollout_to_train"] == [1.25] * 3  # measured, not modelled: reported for every profile

    results["summary"] = s
    md = learning.markdown(results)
    assert "| sync | 310 [300, 320] | 300, 310, 320 | 31 [30, 32] | 40 % [40, 40] | 30 | 5.0 / 4.0 |" in md
    assert "| async | 40% | 0.52 [" in md
    names = [f.name for f in learning.figures(results)]
    assert "sync: rollout / train time" in names and "async / sync: time to 40%" in names


def test_results_page_keeps_the_sections_a_run_did_not_make():
    old_page = ("# Results\n\n## Performance\n\nold performance table\n\n## Learning over seeds\n\nThe pixel "
                "task; measured on 2 cores, A CPU, 8 GB; commit abc; today. Means.\n\n| a | b |\n|---|---|\n"
                "| sync | 1 |\n\n![plot](learning_model.png)\n")
    md = "| arm | x |\n|---|---|\n| async | 2 |\n"
    env = {"hardware": {"cores": 2, "cpu": "B CPU", "memory_gb": 16}, "commit": "def", "time": "now"}
    page, short = results_page.render(None, {"maniskill": (md, env)}, old_page)
    assert "old performance table" in page and "| sync | 1 |" in page     # kept: no new inputs for them
    assert "## Learning on ManiSkill" in page and "| async | 2 |" in page and "commit def" in page
    assert "measured on 2 cores, A CPU, 8 GB; commit abc; today:" in short   # each part names its machine
    assert "| sync | 1 |" in short and "| async | 2 |" in short
    assert "(docs/learning_model.png)" in short and "(docs/learning_maniskill.png)" in short
    again, short_again = results_page.render(None, {}, page)               # nothing new: nothing changes
    assert again == page and short_again == short
