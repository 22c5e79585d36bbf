"""What every benchmark reports through: figures with their goal, one table, one JSON file.

A benchmark module exposes `run(quick) -> dict` (raw results, JSON-ready) and
`figures(results) -> list[Figure]` (the numbers worth a line in the table, each with the goal of
issue #9 where it has one, and whether it is met), and optionally `add_arguments(parser) -> [dest]`
(its own flags, passed to `run` by name). `main(module)` gives a module its command line:

    python -m tests.benchmarks.<name> [--quick] [--out bench_results/<name>.json]

The JSON holds the environment (hardware, load, versions, commit), the figures and the raw results.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Figure:
    bench: str                    # which benchmark (first column)
    name: str                     # what is measured
    value: float | None           # None: not measured (see note)
    unit: str = ""                # "x", "%", "s", "ms", "/s", "MB" ... or "" for a plain number
    goal: str = ""                # the goal as text ("<= 1.5"), empty when there is none
    met: bool | None = None       # None: no goal, or not decidable here
    note: str = ""


def at_least(value, threshold) -> bool | None:
    return None if value is None else value >= threshold


def at_most(value, threshold) -> bool | None:
    return None if value is None else value <= threshold


def format_value(value, unit: str) -> str:
    if value is None:
        return "n/a"
    if unit == "%":
        pct = 100 * value
        return f"{pct:.0f} %" if abs(pct) >= 10 else f"{pct:.2g} %"
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "ms":
        return f"{value * 1e3:.1f} ms"               # values are seconds; shown in ms
    if unit == "s":
        return f"{value:.2f} s"
    if unit == "MB":                                  # values are bytes
        mb = value / 2**20
        return f"{mb:.0f} MB" if mb >= 100 else f"{mb:.1f} MB"
    if abs(value) >= 100 or float(value).is_integer():
        text = f"{value:,.0f}"
    else:
        text = f"{value:.2f}"
    return f"{text} {unit}".strip()


def print_table(figures: list[Figure], title: str = "") -> None:
    rows = [(f.bench, f.name, format_value(f.value, f.unit), f.goal or "-",
             {True: "yes", False: "NO", None: "-"}[f.met], f.note) for f in figures]
    header = ("benchmark", "figure", "value", "goal", "met", "note")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(5)]
    line = lambda r: "  ".join(c.ljust(w) if i < 2 or i == 3 else c.rjust(w)   # noqa: E731
                               for i, (c, w) in enumerate(zip(r[:5], widths))) + (f"  {r[5]}" if r[5] else "")
    if title:
        print(title)
    print(line(header))
    print("-" * (sum(widths) + 2 * 5 + 4))
    for r in rows:
        print(line(r))


def environment() -> dict:
    """Hardware, load, library versions and the commit: what a figure needs to be compared."""
    import numpy
    import torch
    import zmq
    versions = {"python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
                "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version()}
    for name in ("deepspeed", "transformers", "mani_skill", "sapien"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:                      # absent or broken: recorded, not fatal
            versions[name] = None
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"hardware": {"cpu": _cpu_model(), "cores": os.cpu_count(), "memory_gb": round(mem_gb, 1),
                         "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                         "platform": platform.platform()},
            "load_average": os.getloadavg(), "versions": versions, "commit": _commit(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def write_json(path: str | os.PathLike, payload: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str))


def main(module) -> None:
    """The command line of one benchmark module: run it, print its table, write its JSON."""
    spec = getattr(module, "__spec__", None)          # run with -m, the module is __main__
    name = (spec.name if spec else module.__name__).rsplit(".", 1)[-1]
    parser = argparse.ArgumentParser(description=(module.__doc__ or name).splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs")
    parser.add_argument("--out", default=f"bench_results/{name}.json", help="JSON output path")
    own = module.add_arguments(parser) if hasattr(module, "add_arguments") else []   # a module's own flags
    args = parser.parse_args()
    env = environment()
    kwargs = {key: getattr(args, key) for key in own} | out_dir_kwargs(module, Path(args.out).parent)
    with CpuMeter() as cpu:
        results = module.run(args.quick, **kwargs)
    figs = module.figures(results)
    print_table(figs, title=f"{name} ({env['hardware']['cores']} cores, {env['hardware']['cpu']})")
    print(cpu_line({name: cpu.result}))
    write_json(args.out, {"environment": env, "quick": args.quick, "cpu": cpu.result,
                          "figures": [asdict(f) for f in figs], "results": results})
    print(f"wrote {args.out}")


def out_dir_kwargs(module, out_dir: Path) -> dict:
    """{"out_dir": out_dir} for a module whose run() caches stages (they go beside its output), else {}."""
    return {"out_dir": out_dir} if "out_dir" in inspect.signature(module.run).parameters else {}


def cpu_line(cpu: dict[str, dict]) -> str:
    """One line: wall time of each benchmark and the cores other work took meanwhile."""
    parts = []
    for name, c in cpu.items():
        other = "?" if c["other_cores"] is None else f"{c['other_cores']:.1f}"
        parts.append(f"{name} {c['wall_s']:.0f} s (others {other} cores)")
    return "wall time: " + "; ".join(parts)


class CpuMeter:
    """Cores busy on the whole machine during a block (/proc/stat) and how many of them were ours
    (this process + its finished children): the difference is other work on a shared machine,
    which slows any figure measured meanwhile. `.result` after the block."""

    def __enter__(self):
        self.t0, self.busy0, self.ours0 = time.perf_counter(), _machine_busy_s(), _our_cpu_s()
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self.t0
        busy1, ours = _machine_busy_s(), (_our_cpu_s() - self.ours0) / wall
        machine = None if busy1 is None or self.busy0 is None else (busy1 - self.busy0) / wall
        self.result = {"wall_s": wall, "our_cores": ours, "machine_cores_busy": machine,
                       "other_cores": None if machine is None else max(0.0, machine - ours)}
        return False


def best_of(n: int, fn) -> float:
    """Fastest of n timed calls (seconds): the least disturbed by other work on the machine."""
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _machine_busy_s() -> float | None:
    try:
        fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _our_cpu_s() -> float:
    import resource
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _commit() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (head + ("+dirty" if dirty else "")) or None
    except Exception:
        return None
