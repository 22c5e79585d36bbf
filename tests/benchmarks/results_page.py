"""docs/results.md and the README's Results block, generated from what `make bench` wrote.

    python -m tests.benchmarks.results_page [--bench-dir bench_results/] [--readme README.md] [--docs docs/]

Reads BENCH/bench.json (the performance table of every benchmark, with the machine and commit) and,
per learning benchmark, BENCH/learning_TAG.md + .json + .png (TAG `model`: the pixel task at the
modelled cost; `maniskill`: PushCube at the simulator's own cost; `heads`: the action heads, and
`gaussian`: the Gaussian head against the parallel one, these two on the page only). Writes
docs/results.md (the full page: machine, commit, date, every figure, the learning tables and plots).
A section whose inputs are missing keeps its text from the page as it was, so a benchmark run
alone updates only its own section. The README's text between
`<!-- results:start -->` and `<!-- results:end -->` becomes the short form: each learning
section's tables and plot, linking to the page. `make bench` calls it last, so the figures a
reader sees are the latest measured, never hand-copied.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from tests.benchmarks.report import ROOT, Figure, format_value

START, END = "<!-- results:start -->", "<!-- results:end -->"
PERFORMANCE = "Performance"
# tag -> (the page's heading, the README's name for it or None: on the page only, what the benchmark is)
LEARNING = {
    "model": ("Learning over seeds", "The pixel task at seed 002's modelled cost",
              "The learning benchmark, `--profile model` (`python -m tests.benchmarks.learning`): the "
              "pixel task with env.sim_latency_ms giving sync seed 002's rollout : training ratio."),
    "maniskill": ("Learning on ManiSkill", "ManiSkill PushCube at the simulator's own cost",
                  "The learning benchmark, `--task maniskill` (`python -m tests.benchmarks.learning "
                  "--task maniskill`): `make train`'s PushCube config from its own warm start, nothing "
                  "modelled, the learner and the actors on disjoint cores in both arms."),
    "heads": ("Learning with each action head", None,
              "The learning benchmark, `--task heads` (`python -m tests.benchmarks.learning --task heads`): "
              "asynchronous RL on the pixel task for the same wall-clock budget from each head's own SFT "
              "warm start, the token (parallel) head against the flow head with Flow-SDE and Flow-Noise."),
    "gaussian": ("Learning with the Gaussian head", None,
                 "The learning benchmark, `--task gaussian` (`python -m tests.benchmarks.learning --task "
                 "gaussian`): asynchronous RL on the pixel task for the same wall-clock budget, the Gaussian "
                 "head against the parallel token head, each from its own warm start of the same number of "
                 "SFT steps (600)."),
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
    heading, _, what = LEARNING[tag]
    return "\n".join([f"## {heading}", "", f"{what} Measured on {machine_line(env)}. {SUMMARY}", "",
                      learning_md.strip(), "", f"![success vs wall time and env steps](learning_{tag}.png)"])


def sections(page: str) -> dict[str, str]:
    """A page's `## ` sections by heading, each with its heading line."""
    out = {}
    for part in re.split(r"(?m)^(?=## )", page):
        if part.startswith("## "):
            out[part.splitlines()[0][3:].strip()] = part.strip()
    return out


def readme_part(tag: str, section: str) -> str:
    """The README's short form of a learning section: its name, machine, headline table (the
    section's first) and plot."""
    lines = section.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(first, len(lines)) if not lines[i].startswith("|")), len(lines))
    measured = re.search(r"[Mm]easured on (.+?)\.(?:\s|$)", section)
    return "\n".join([f"**{LEARNING[tag][1]}**, measured on {measured.group(1) if measured else '?'}:", "",
                      *lines[first:end], "",
                      f"![success vs wall time and env steps, mean over seeds with 95 % bands]"
                      f"(docs/learning_{tag}.png)"])


def render(bench: dict | None, learning: dict[str, tuple[str, dict]], old_page: str = "") -> tuple[str, str]:
    """(docs/results.md, the README block) from bench.json and {tag: (learning md, machine)};
    a section without inputs is kept from old_page."""
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
    short = []
    for tag, (heading, _, _) in LEARNING.items():
        section = learning_section(tag, *learning[tag]) if tag in learning else old.get(heading)
        if section is not None:
            page += [section, ""]
            if LEARNING[tag][1] is not None:
                short += [readme_part(tag, section), ""]
    short.append("Every figure of `make bench`: [docs/results.md](docs/results.md)." if len(short) else
                 "Not measured yet: `make bench` writes [docs/results.md](docs/results.md) and this table.")
    return "\n".join(page).rstrip() + "\n", "\n".join(short)


def replace_block(text: str, block: str) -> str:
    if START not in text or END not in text:
        raise ValueError(f"the README has no {START} ... {END} block to replace")
    head, rest = text.split(START, 1)
    return f"{head}{START}\n{block}\n{END}{rest.split(END, 1)[1]}"


def write(bench_dir: Path, readme: Path, docs: Path) -> None:
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
    page, short = render(bench, learning, page_path.read_text() if page_path.exists() else "")
    page_path.write_text(page)
    readme.write_text(replace_block(readme.read_text(), short))
    print(f"wrote {page_path} and the Results block of {readme}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bench-dir", default=str(ROOT / "bench_results"))
    p.add_argument("--readme", default=str(ROOT / "README.md"))
    p.add_argument("--docs", default=str(ROOT / "docs"))
    a = p.parse_args()
    write(Path(a.bench_dir), Path(a.readme), Path(a.docs))


if __name__ == "__main__":
    main()
