"""docs/results.md, generated from what `make bench` wrote.

    python -m tests.benchmarks.results_page [--bench-dir bench_results/] [--docs docs/]

Reads BENCH/bench.json (the performance table of every benchmark, with the machine and commit) and,
per learning benchmark, BENCH/learning_TAG.md + .json + .png (TAG `model`: the pixel task at the
modelled cost; `maniskill`: PushCube at the simulator's own cost; `heads`: the action heads, and
`gaussian`: the Gaussian head against the parallel one; `advantages`: GAE against V-trace). Writes docs/results.md (the full page:
machine, commit, date, every figure, the learning tables and plots). A section whose inputs are
missing keeps its text from the page as it was, so a benchmark run alone updates only its own
section. `make bench` calls it last, so the figures a reader sees are the latest measured, never
hand-copied.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from tests.benchmarks.report import ROOT, Figure, format_value

PERFORMANCE = "Performance"
# tag -> (the page's heading, what the benchmark is)
LEARNING = {
    "model": ("Learning over seeds",
              "The learning benchmark, `--profile model` (`python -m tests.benchmarks.learning`): the "
              "pixel task with env.sim_latency_ms giving sync seed 002's rollout : training ratio."),
    "maniskill": ("Learning on ManiSkill",
                  "The learning benchmark, `--task maniskill` (`python -m tests.benchmarks.learning "
                  "--task maniskill`): `make train`'s PushCube config from its own warm start, nothing "
                  "modelled, the learner and the actors on disjoint cores in both arms."),
    "heads": ("Learning with each action head",
              "The learning benchmark, `--task heads` (`python -m tests.benchmarks.learning --task heads`): "
              "asynchronous RL on the pixel task for the same wall-clock budget from each head's own SFT "
              "warm start, the token (parallel) head against the flow head with Flow-SDE and Flow-Noise."),
    "gaussian": ("Learning with the Gaussian head",
                 "The learning benchmark, `--task gaussian` (`python -m tests.benchmarks.learning --task "
                 "gaussian`): asynchronous RL on the pixel task for the same wall-clock budget, the Gaussian "
                 "head against the parallel token head, each from its own warm start of the same number of "
                 "SFT steps (600)."),
    "advantages": ("Learning with each advantage estimator",
                   "The learning benchmark, `--task advantages` (`python -m tests.benchmarks.learning --task "
                   "advantages`): asynchronous RL on the pixel task for the same wall-clock budget from the "
                   "token head's warm start, GAE (`algorithm.adv_type=gae`) against V-trace."),
}
SUMMARY = ("Means over seeds with 95 % bootstrap intervals; each async arm against sync (the ratio of "
           "the means, stratified bootstrap) at each threshold every run of the pair reaches; lag is how "
           "many updates old the data trained on was; wait / train is the learner's time waiting for "
           "data (in sync mode: weight sync + rollout) and training, per update.")


def machine_line(env: dict) -> str:
    hw = env.get("hardware", {})
    gpu = f", {hw['gpu']}" if hw.get("gpu") else ""
    return (f"{hw.get('cores', '?')} cores, {hw.get('cpu', '?')}, {hw.get('memory_gb', '?')} GB{gpu}; "
            f"commit {env.get('commit') or '?'}; {env.get('time', '?')}")


def performance_table(figures: list[dict]) -> str:
    rows = ["| benchmark | figure | value | goal | met | note |", "|---|---|---|---|---|---|"]
    for f in figures:
        f = Figure(**f)
        met = {True: "yes", False: "**no**", None: "-"}[f.met]
        note = f.note.replace("|", "/")
        rows.append(f"| {f.bench} | {f.name} | {format_value(f.value, f.unit)} | {f.goal or '-'} | {met} | {note} |")
    return "\n".join(rows)


def performance_section(bench: dict) -> str:
    return "\n".join([f"## {PERFORMANCE}", "", f"Measured on {machine_line(bench['environment'])}"
                      + (" (`--quick`)" if bench.get("quick") else "") + ".", "",
                      performance_table(bench["figures"])])


def learning_section(tag: str, learning_md: str, env: dict) -> str:
    heading, what = LEARNING[tag]
    return "\n".join([f"## {heading}", "", f"{what} Measured on {machine_line(env)}. {SUMMARY}", "",
                      learning_md.strip(), "", f"![success vs wall time and env steps](learning_{tag}.png)"])


def sections(page: str) -> dict[str, str]:
    """A page's `## ` sections by heading, each with its heading line."""
    out = {}
    for part in re.split(r"(?m)^(?=## )", page):
        if part.startswith("## "):
            out[part.splitlines()[0][3:].strip()] = part.strip()
    return out


def render(bench: dict | None, learning: dict[str, tuple[str, dict]], old_page: str = "") -> str:
    """docs/results.md from bench.json and {tag: (learning md, machine)}; a section without inputs
    is kept from old_page."""
    old = sections(old_page)
    page = ["# Results", "",
            "Generated by `make bench` (`tests/benchmarks/results_page.py`) from `bench_results/`: "
            "the latest measured figures. How they were measured, and the runs before them, are in "
            "[Benchmarks](benchmarks.md).", ""]
    if bench is not None:
        page += [performance_section(bench), ""]
    else:
        page += [old.get(PERFORMANCE) or f"## {PERFORMANCE}\n\nNot measured yet: `make bench` writes "
                 "`bench_results/bench.json`.", ""]
    for tag, (heading, _) in LEARNING.items():
        section = learning_section(tag, *learning[tag]) if tag in learning else old.get(heading)
        if section is not None:
            page += [section, ""]
    return "\n".join(page).rstrip() + "\n"


def write(bench_dir: Path, docs: Path) -> None:
    bench_json = bench_dir / "bench.json"
    bench = json.loads(bench_json.read_text()) if bench_json.exists() else None
    learning = {}
    for tag in LEARNING:
        md, js, png = (bench_dir / f"learning_{tag}.{ext}" for ext in ("md", "json", "png"))
        if not md.exists():
            continue
        out = json.loads(js.read_text()) if js.exists() else {}
        # run alone, the learning benchmark records its machine; within `make bench`, bench.json does
        env = out.get("environment") or (bench or {}).get("environment") or {}
        if out.get("quick") or (bench or {}).get("quick"):
            env = {**env, "time": f"{env.get('time', '?')} (`--quick`: short runs)"}
        learning[tag] = (md.read_text(), env)
        if png.exists():
            shutil.copyfile(png, docs / png.name)
    page_path = docs / "results.md"
    page_path.write_text(render(bench, learning, page_path.read_text() if page_path.exists() else ""))
    print(f"wrote {page_path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bench-dir", default=str(ROOT / "bench_results"))
    p.add_argument("--docs", default=str(ROOT / "docs"))
    a = p.parse_args()
    write(Path(a.bench_dir), Path(a.docs))


if __name__ == "__main__":
    main()
