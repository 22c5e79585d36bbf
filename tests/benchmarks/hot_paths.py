"""Where the time goes: py-spy profiles of the two hot paths, the learner update and the actor loop.

    python -m tests.benchmarks.hot_paths [--seconds 20] [--out bench_results/profiles/]

Each hot path runs in its own process on the benchmark workload (workload.py), built and warmed
up first; then `py-spy record --pid` samples it (100 Hz, --nonblocking) for --seconds:

  learner  the learner's `update` (V-trace targets + PPO) in a loop on a 1-rank ZeRO-3 engine, 1 thread
  actor    `rollout.collect_segment` on the pixel env in a loop: policy act + env step, 1 thread

Writes OUT/<name>.txt (collapsed stacks: load into speedscope.app, or flamegraph.pl for an SVG)
and prints, per profile, the share of samples spent inside the functions that matter (inclusive)
and the top functions by own time. Not part of `make bench` (py-spy needs ptrace rights).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from tests.benchmarks import workload

# Inclusive shares worth reading, per hot path: (label, regex searched in the whole stack, frames
# joined by ";"). Unindented labels split the loop; "(rest)" is what none of them covers.
WATCH = {
    "learner": [
        ("V-trace targets: no-grad forward over T+1 steps", r"compute_targets \("),
        ("PPO epochs", r"ppo_epochs \("),
        ("  forward", r"ppo_epochs .*;DeepSpeedEngine\.forward \("),
        ("  backward", r"ppo_epochs .*;DeepSpeedEngine\.backward \("),
        ("  optimizer step", r"ppo_epochs .*;DeepSpeedEngine\.step \("),
        ("  in all: vision tower", r"Idefics3VisionTransformer\.forward \("),
        ("  in all: language model", r"LlamaModel\.forward \("),
        ("  in all: ZeRO-3 linear (the matmuls: LinearFunctionForZeroStage3)", r"LinearFunctionForZeroStage3\."),
        ("  in all: ZeRO-3 module hooks (parameter fetch / release)", r"DeepSpeedZeRoOffload\."),
        ("  in all: LoRA adapters", r"peft/tuners/lora/"),
    ],
    "actor": [
        ("policy act()", r"VLAPolicy\.act \("),
        ("  vision tower + prompt embedding (_prompt)", r"VLAPolicy\.act .*;VLAPolicy\._prompt \("),
        ("  prefill + token-by-token decoding (_sample)", r"VLAPolicy\._sample \("),
        ("  teacher-forced re-scoring of the sampled tokens (_score)", r"VLAPolicy\.act .*;VLAPolicy\._score \("),
        ("env step_chunk", r"\.step_chunk \("),
    ],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="sampling time per profile")
    parser.add_argument("--out", default="bench_results/profiles/", help="directory for the profiles")
    parser.add_argument("--target", choices=list(WATCH), help=argparse.SUPPRESS)   # the profiled process
    args = parser.parse_args()
    if args.target:
        return hot_loop(args.target)
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in WATCH:
        stacks = record(pyspy, name, args.seconds, out / f"{name}.txt")
        print(summary(name, stacks))
    return 0


def record(pyspy: str, name: str, seconds: float, path: Path) -> Counter:
    """Start the hot loop of `name`, wait until it is warm, sample it; returns the collapsed stacks."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.benchmarks.hot_paths", "--target", name],
                            stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:                         # setup output ends with READY
            if line.strip() == "READY":
                break
        else:
            raise RuntimeError(f"the {name} hot loop exited before it was ready ({proc.wait()})")
        threading.Thread(target=proc.stdout.read, daemon=True).start()    # never let its pipe fill
        subprocess.run([pyspy, "record", "--pid", str(proc.pid), "--duration", str(int(seconds)),
                        "--rate", "100", "--nonblocking", "--format", "raw", "--output", str(path)],
                       check=True, stdout=subprocess.DEVNULL)
    finally:
        proc.terminate()
        proc.wait(30)
    stacks = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        stacks[stack] += int(count)
    return stacks


def summary(name: str, stacks: Counter, top: int = 10) -> str:
    total = sum(stacks.values()) or 1
    lines, covered = [f"\n{name}: {total} samples"], set()
    for label, pattern in WATCH[name]:
        rx = re.compile(pattern)
        hits = {s for s in stacks if rx.search(s)}
        if not label.startswith(" "):
            covered |= hits
        lines.append(f"  {100 * sum(stacks[s] for s in hits) / total:5.1f} %  {label}")
    rest = sum(c for s, c in stacks.items() if s not in covered)
    lines.append(f"  {100 * rest / total:5.1f} %  (rest)")
    own = Counter()
    for s, c in stacks.items():
        own[re.sub(r":\d+\)$", ")", s.split(";")[-1])] += c        # by function, not by line
    lines.append(f"  top {top} functions by own time:")
    lines += [f"  {100 * c / total:5.1f} %  {f or '(no Python frame)'}" for f, c in own.most_common(top)]
    return "\n".join(lines)


def hot_loop(name: str) -> int:
    """The profiled process: build, warm up, print READY, then run the hot path until terminated."""
    import torch
    torch.set_num_threads(workload.LEARNER_THREADS)
    cfg = workload.config()
    if name == "learner":
        from asyncvla.learner.update import update
        from tests.benchmarks.learner_scaling import build_learner
        engine, batch, device = build_learner(cfg, 1, 0)
        step = lambda: update(engine, batch, cfg, device)          # noqa: E731
    else:
        from tests.benchmarks.actor_scaling import make_actor
        step, _ = make_actor(cfg, 0)
    step()
    print("READY", flush=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        step()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
