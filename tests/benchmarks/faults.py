"""The fault suite in full: a real `asyncvla train` (2 learner ranks, 2 local actors, the evaluator)
under every attack of the reliability issue, and the table of what happened.

    python -m tests.benchmarks.faults [--quick] [--out bench_results/faults.json]

Full (tests/faults_harness.py FULL, ~12 minutes on 2 cores): 10^4 fuzz messages per port, 10^4
fake hellos, 10^4 spoofed requests, an actor SIGTERM, hellos, heartbeats and byes under a live
actor's id, 50 rounds of segments lying about their seq and episode stats, a full disk during a
save, 3 minutes of actor churn (a SIGKILL every 10 s), a starving learner, an evaluator SIGKILL,
Ctrl-C and --resume, 4 learner SIGKILLs (2 during a save) each followed by --resume, a launcher
SIGKILL, a fake learner serving escaping file names; resumptions with another policy shape, from
an older checkpoint then Ctrl-C, from one with a NaN in its EMA; Ctrl-C during start-up; then
careless configs and disks: nan/inf config values, a diverging run (learner.lr=1e6), a checkpoint
folder that cannot be written, a final save that fails. --quick runs the suite of `make test`
(tests/test_faults.py, 1 rank, 5 rounds of lies, 30 s of churn, 1 learner kill; ~6 minutes).

The figures: crashes, hangs, unauthorised actions and unaccounted segments (each goal 0), the
learner's RSS growth under attack against its bound, the processes left 5 s after the launcher's
SIGKILL, the fuzz messages per port, the exit codes of every command an attack ended (a stop is
never a finish: 130 for Ctrl-C, 143 for an actor's SIGTERM, 2 for a config refused), lying
counters dropped, non-finite steps skipped and saves failed. The JSON holds every row of the
table (messages sent, drops by reason, non-finite steps, saves failed, exit code).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from tests import faults_harness as H
from tests.benchmarks import report


def run(quick: bool) -> dict:
    out = Path(tempfile.mkdtemp(prefix="asyncvla-faults-"))
    try:
        result = H.run_suite(out, H.QUICK if quick else H.FULL)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    print()
    H.print_table(result.rows, title=f"fault suite{' (quick)' if quick else ''}: {result.seconds / 60:.1f} min")
    print()
    return result.as_dict()


def figures(results: dict) -> list[report.Figure]:
    rows = results["rows"]
    problems = [p for r in rows for p in r["problems"]]
    hangs = [p for p in problems if "hang" in p.lower()]
    crashes = next((r for r in rows if r["fault"].startswith("crashes")), {"problems": ["no crash check"]})
    unaccounted = sum(abs(a["acked"] - a["trained"] - sum(a["dropped"].values()) - a["buffered"])
                      for r in rows if (a := r["accounts"]) is not None)
    left = next((r for r in rows if r["fault"] == "launcher SIGKILL"), None)
    fuzzed = [r["tried"] for r in rows if r["fault"].startswith("fuzz ")]
    rss = results["rss"]
    growth = rss.get("growth_mb")
    disk = next((r for r in rows if r["fault"].startswith("disk full")), {"skipped": "not run", "problems": []})
    return [
        report.Figure("faults", "problems found (all attacks)", len(problems), goal="0", met=not problems,
                      note="; ".join(problems)[:200]),
        report.Figure("faults", "learner or actor crashes", len(crashes["problems"]), goal="0",
                      met=not crashes["problems"]),
        report.Figure("faults", "hangs", len(hangs), goal="0", met=not hangs),
        report.Figure("faults", "unauthorised actions", sum(r["unauthorised"] for r in rows), goal="0",
                      met=sum(r["unauthorised"] for r in rows) == 0),
        report.Figure("faults", "segments acked but not trained/dropped/buffered", unaccounted, goal="0",
                      met=unaccounted == 0),
        report.Figure("faults", "learner RSS growth under attack", None if growth is None else growth * 2**20, "MB",
                      goal=f"<= {rss['bound_mb']:.0f} MB", met=report.at_most(growth, rss["bound_mb"]),
                      note=f"before {rss.get('before_mb') or 0:.0f} MB"),
        report.Figure("faults", "processes left 5 s after launcher SIGKILL",
                      None if left is None else len(left["problems"]), goal="0",
                      met=None if left is None else not left["problems"]),
        report.Figure("faults", "failed save, then the next one succeeds", None if disk["skipped"] else
                      int(not disk["problems"]), goal="1", met=None if disk["skipped"] else not disk["problems"],
                      note=disk["skipped"]),
        *careless_figures(rows),
        report.Figure("faults", "fuzz messages per port (least)", min(fuzzed) if fuzzed else None,
                      goal=">= 10,000", met=report.at_least(min(fuzzed) if fuzzed else None, 10_000)),
    ]


def careless_figures(rows: list[dict]) -> list[report.Figure]:
    """Exit codes and counts of the stops, resumptions, careless configs and disks, and the lying
    counters (tests/faults_harness.py)."""
    by = {r["fault"]: r for r in rows}
    out = []
    for fault, goal in (("launcher SIGINT", 130), ("Ctrl-C during start-up", 130),
                        ("resume from an older tag, then Ctrl-C", 130), ("actor SIGTERM", 143),
                        ("resume with another shape", 2), ("NaN in a saved EMA", "!= 0"),
                        ("config: nan/inf values", 2), ("diverging run (learner.lr=1e6)", "!= 0"),
                        ("checkpoint folder not writable", "!= 0"), ("final save fails", "!= 0")):
        r = by.get(fault)
        code = None if r is None else r["exit_code"]
        met = None if code is None else (code == goal if isinstance(goal, int) else code != 0)
        out.append(report.Figure("faults", f"{fault}: exit code", code, goal=f"= {goal}" if isinstance(goal, int)
                                 else goal, met=met and not r["problems"], note="; ".join(r["problems"])[:200]
                                 if r else "not run"))
    lies = (by.get("lying episode stats and seq") or {}).get("accounts") or {}
    dropped = sum((lies.get("invalid") or {}).get(k, 0) for k in ("bad_counter", "bad_reward"))
    sent = (by.get("lying episode stats and seq") or {}).get("tried")
    out.append(report.Figure("faults", "lying seq / episode stats dropped (bad_counter, bad_reward)",
                             dropped if lies else None, goal=f"= {sent} sent", met=dropped == sent if lies else None))
    diverged = (by.get("diverging run (learner.lr=1e6)") or {}).get("accounts") or {}
    out.append(report.Figure("faults", "diverging run: non-finite steps skipped before the stop",
                             diverged.get("nonfinite_steps"), goal="= 2 (learner.max_nonfinite_steps)",
                             met=diverged.get("nonfinite_steps") == 2 if diverged else None))
    failed = sum(((r.get("accounts") or {}).get("saves_failed", 0)) for r in rows
                 if r["fault"] in ("disk full during a save", "final save fails"))
    out.append(report.Figure("faults", "failed saves counted (disk full, final save)", failed, goal=">= 2",
                             met=failed >= 2))
    return out


if __name__ == "__main__":
    report.main(sys.modules[__name__])
