"""`make bench`: the system's performance figures side by side with their baselines, in one run.

    python -m tests.benchmarks.run_all [--quick] [--out bench_results/] [--only NAME[,NAME]]

Runs the benchmarks below in turn (each module's docstring says what it measures and why),
prints ONE table of figures with the goals of issue #9 and whether each is met, and writes
OUT/bench.json: the environment (hardware, load, versions, commit), each benchmark's wall time
and the CPU other work took meanwhile, the figures and every raw result. A benchmark that fails
is reported in the table and the JSON, the others still run, and the exit status is 1. With the
default --out, docs/results.md is regenerated from it last
(tests/benchmarks/results_page.py). Full mode takes the learning benchmark's time (4 arms x 5
seeds on the modelled cost profile, each run until it reaches its target, ~2.5 hours: see its docstring;
`python -m tests.benchmarks.learning --profile plain` runs the plain one) plus ~32 minutes, 12 of
them the fault suite (faults: every attack of the reliability issue on a real run, its table
printed as it ends) and 1.5 SmolVLA's act() at its published size (smolvla_act); --quick ~56, ~30
of them learning. Benchmarks are not tests: nothing here asserts a timing.

Three component benchmarks are not part of the default run (their figures are inputs of the
ones above, not goals): --only env_throughput,policy_throughput,eval_throughput runs them.
"""

from __future__ import annotations

import argparse
import importlib
import time
import traceback
from dataclasses import asdict
from pathlib import Path

from tests.benchmarks import report, results_page

DEFAULT = ("async_sync", "weight_publish", "transport", "actor_scaling", "learner_scaling", "smolvla_act", "learning",
           "multinode", "faults")
EXTRA = ("env_throughput", "policy_throughput", "eval_throughput")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs (~25 minutes on 2 cores)")
    parser.add_argument("--out", default="bench_results/", help="directory of bench.json")
    parser.add_argument("--only", help=f"comma-separated subset of {', '.join(DEFAULT + EXTRA)}")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(DEFAULT)
    unknown = [n for n in names if n not in DEFAULT + EXTRA]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {list(DEFAULT + EXTRA)}")

    env = report.environment()
    t0 = time.perf_counter()
    figures, results, cpu = [], {}, {}
    for name in names:
        print(f"[bench] {name} ...", flush=True)
        module = importlib.import_module(f"tests.benchmarks.{name}")
        with report.CpuMeter() as meter:
            try:
                results[name] = module.run(args.quick, **report.out_dir_kwargs(module, Path(args.out)))
                figures += module.figures(results[name])
            except Exception as e:
                results[name] = {"error": traceback.format_exc()}
                figures.append(report.Figure(name, "FAILED", None, note=f"{type(e).__name__}: {e}"[:200]))
                print(results[name]["error"], flush=True)
        cpu[name] = meter.result
    wall = time.perf_counter() - t0

    hw = env["hardware"]
    print()
    report.print_table(figures, title=f"asyncvla benchmarks{' (--quick)' if args.quick else ''}: "
                                      f"{hw['cores']} cores, {hw['cpu']}, {hw['memory_gb']} GB"
                                      + (f", {hw['gpu']}" if hw["gpu"] else "") + f"; commit {env['commit']}")
    print(report.cpu_line(cpu))
    out = Path(args.out) / "bench.json"
    report.write_json(out, {"environment": env, "quick": args.quick, "wall_s": wall, "cpu": cpu,
                            "figures": [asdict(f) for f in figures], "results": results})
    print(f"total {wall / 60:.1f} min; wrote {out}")
    if Path(args.out).resolve() == (report.ROOT / "bench_results").resolve():   # the default: the docs follow
        results_page.write(Path(args.out), report.ROOT / "docs")
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
