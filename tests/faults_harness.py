"""The fault suite: a real run under attack, and a table of what happened.

    result = run_suite(out_dir, QUICK)       # tests/test_faults.py; FULL: tests/benchmarks/faults.py
    print_table(result.rows)

The run is `asyncvla train configs/pixel_task.yaml` with a small backbone on loopback: a DeepSpeed
ZeRO-3 learner (`Sizes.ranks` ranks), `Sizes.actors` local actors and the evaluator, without CURVE
keys (so that any peer reaches the decoders; a hello must carry the run's join secret, which the
attacks below hold unless they say otherwise: a buggy script of the run's owner), its checkpoints on a small tmpfs where one can be
mounted (for the disk-full attack). The attacks, each a function taking its size and returning a
Row (fault, count tried, outcome, problems, the learner's segment accounting over the attack, its
RSS), in the order run_suite runs them:

  fuzz <port>      messages to the control, weights and segment ports: random bytes, flipped
                   and truncated headers, deep nesting, huge shapes, many frames, wrong types,
                   valid-looking messages with out-of-range values; on the segment port also
                   segments of a registered fuzz actor that are stale, from a future version,
                   valid (trained on), repeated (same seq), claiming env_steps = 2**63 - 1, and
                   valid ones without its token
  no secret        hellos without the run's join secret, or with another: each refused, counted
  hello flood      hellos with fresh actor ids (each registers an actor, who then times out)
  spoofing         heartbeats, byes, get_policy_files and get_weights for the live actors' ids
                   without their token
  actor SIGTERM    exit 143, restarted by the launcher; while its id is free a bare peer takes it
                   and lets it go, keeping the token of that registration
  id hijack        from another connection: hellos under the live actors' ids claiming their host
                   and pid, each refused (id_taken); heartbeats and byes with the token local-0's
                   id had while the bare peer held it, each refused (stale_token: that
                   registration ended when the restarted actor took the id over)
  squatter         SIGKILL local-1 and at once hold its id from a peer; the launcher's one restart
                   says hello again until the squatter is gone, then joins: no restart wasted
  lying segments   of the registered fuzz actor: seq = 2**63 - 1, ep_length = 2**62, ep_return =
                   float32's largest; dropped as bad_counter / bad_reward, the stream unmoved
  disk full        ballast fills the checkpoints' tmpfs until a save fails; then it goes
  actor churn      SIGKILL a random local actor every `churn_every_s` for `churn_s`
  starving         every actor stopped until the learner names the ones it last heard from
  evaluator SIGKILL  reaped and restarted once by the launcher; the new one joins
  launcher SIGINT  exit 130 with a final checkpoint; --resume continues from its step
  learner SIGKILL  the ranks killed, every other time during a save (a tag without its marker),
                   else at a random moment; each time --resume continues from the newest complete
                   checkpoint
  launcher SIGKILL no process of the run left after 5 s
  escaping names   a fake learner serving policy files whose names try to leave the actor's folder
  resumptions      of copies of the run holding two of its checkpoints: with another policy shape
                   (exit 2, one line naming the key and both values); from the older one, then
                   Ctrl-C (exit 130, the launcher names it, never the newer); from a newest one
                   whose EMA holds a NaN (exit non-zero, one line naming the file and the older one)
  start-up Ctrl-C  SIGINT while a learner rank is starting: exit 130, one line
  huge flow chains a short run with the flow head; a peer's segments with chains times 2e30 are
                   refused on receipt (out_of_range), and the run ends by its budget (exit 0)
  careless         configs and disks, each a short run of its own: nan/inf values, learner.lr=1e6,
                   a checkpoint folder that cannot be written, a final save that fails

A Row's problems (the suite passes when every row has none): a learner, actor or evaluator that
died unless killed or sent SIGTERM here, a traceback in a log, an exit code other than promised, a
run that stopped making progress (hang), an unauthorised action (a spoofed request answered as if
from the actor, a registry change by one, weights or policy files served to a peer without a
token, a file written outside the actor's folder), an accounting record where acked != trained +
dropped + buffered, and learner RSS above the bound.
The learner's accounting comes from RUN/accounting/rank_<r>.json (learner/metrics.py), written at
each checkpoint (every `save_interval` updates here) and at the end.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import numpy as np
import zmq

from asyncvla.common.transport import protocol as P
from asyncvla.common.signals import descendants, process_start_time, python_module
from asyncvla.common.transport.segment_channel import ack_count
from asyncvla.launch.train import STARTING_S
from tests.support.paths import PIXEL, REPO
from tests.support.ports import run_ports
from tests.support.runs import SMALL, SMALL_BACKBONE, start, train_pixel_task
from tests.support.wire import header_of

CONFIG = str(PIXEL)
LEARNER_MODULE = "asyncvla.learner.main"
EVALUATOR_MODULE = "asyncvla.launch.evaluator"
BATCH = 4                    # learner.batch_trajectories: one segment of 4 envs per update and rank
SAVE_INTERVAL = 5
STOP_GRACE_S = 60.0
PROGRESS_S = 120.0           # a run that saves no new checkpoint for this long hangs
STARVING_S = 3.0             # learner.starvation_timeout_s: short, so that starving costs seconds
TAG_RE = re.compile(r"^step_(\d{8,})$")


@dataclass(frozen=True)
class Sizes:
    """How much of each attack: QUICK for `make test`, FULL for `make bench`."""
    fuzz_per_port: int = 10_000
    hellos: int = 2_000
    outsiders: int = 200         # hellos without the run's join secret
    spoofs: int = 400            # of each kind (heartbeat, bye, get_policy_files, get_weights)
    valid_segments: int = 20     # of the segment fuzz: valid segments of a registered fuzz actor
    lies: int = 5                # rounds of segments lying about their seq and episode stats (4 each)
    churn_s: float = 30.0
    churn_every_s: float = 10.0
    learner_kills: int = 1       # the 1st, 3rd, ... during a save, the others at random moments
    ranks: int = 1
    actors: int = 2
    rss_bound_mb: float = 100.0  # learner RSS (any rank) may exceed its level before the attacks by this
    seed: int = 0


QUICK = Sizes()
FULL = Sizes(hellos=10_000, spoofs=2_500, valid_segments=200, lies=50, churn_s=180.0, learner_kills=4, ranks=2)


# ---------------------------------------------------------------------------------- the table
@dataclass
class Accounts:
    """The learner's segment accounting summed over its ranks (learner/ingest.py Inbox.accounting)."""
    step: int
    acked: int
    trained: int
    buffered: int
    dropped: dict                # stale, future_version, invalid
    invalid: dict                # the invalid ones by the receiver's reason
    columns_trained: int
    balanced: bool               # every rank's acked == trained + dropped + buffered
    nonfinite_steps: int = 0     # optimizer steps skipped as non-finite (the ranks agree: the most of any)
    saves_failed: int = 0        # checkpoints that could not be written (likewise)
    seq_gaps: int = 0            # segments missing from the actors' sequences (outside the balance)
    records: list = field(default_factory=list, repr=False)

    @classmethod
    def of(cls, records: list[dict]) -> "Accounts":
        dropped, invalid = {}, {}
        for r in records:
            for k, v in r["dropped"].items():
                dropped[k] = dropped.get(k, 0) + v
            for k, v in r["invalid"].items():
                invalid[k] = invalid.get(k, 0) + v
        return cls(step=min(r["step"] for r in records), acked=sum(r["acked"] for r in records),
                   trained=sum(r["trained"] for r in records), buffered=sum(r["buffered"] for r in records),
                   dropped=dropped, invalid=invalid,
                   columns_trained=sum(r["columns"]["trained"] for r in records),
                   balanced=all(_balanced(r) for r in records),
                   nonfinite_steps=max(r.get("nonfinite_steps", 0) for r in records),
                   saves_failed=max(r.get("checkpoint_failures", 0) for r in records),
                   seq_gaps=sum(r.get("seq_gaps", 0) for r in records), records=records)

    def minus(self, before: "Accounts | None") -> "Accounts":
        """What changed since `before` (the same learner processes), else all of it."""
        if before is None or {r["pid"] for r in before.records} != {r["pid"] for r in self.records}:
            return self
        sub = lambda a, b: {k: a.get(k, 0) - b.get(k, 0) for k in a if a.get(k, 0) - b.get(k, 0)}  # noqa: E731
        return Accounts(self.step, self.acked - before.acked, self.trained - before.trained,
                        self.buffered - before.buffered, sub(self.dropped, before.dropped),
                        sub(self.invalid, before.invalid), self.columns_trained - before.columns_trained,
                        self.balanced and before.balanced, self.nonfinite_steps - before.nonfinite_steps,
                        self.saves_failed - before.saves_failed, self.seq_gaps - before.seq_gaps, self.records)

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    def dropped_text(self, top: int = 4) -> str:
        parts = [f"{k} {v}" for k, v in self.dropped.items() if k != "invalid" and v]
        if self.dropped.get("invalid"):
            reasons = sorted(self.invalid.items(), key=lambda kv: -kv[1])
            shown = ", ".join(f"{k} {v}" for k, v in reasons[:top])
            more = f", +{len(reasons) - top} reasons" if len(reasons) > top else ""
            parts.insert(0, f"invalid {self.dropped['invalid']} ({shown}{more})")
        return "; ".join(parts) or "0"


def _balanced(record: dict) -> bool:
    return record["acked"] == record["trained"] + sum(record["dropped"].values()) + record["buffered"]


@dataclass
class Row:
    fault: str
    tried: int = 0
    outcome: str = ""
    problems: list = field(default_factory=list)
    unauthorised: int = 0
    accounts: Accounts | None = None
    rss_mb: float | None = None         # the learner's RSS, most of any rank, during the attack
    exit_code: int | None = None        # of the command the attack ended, where it ended one
    skipped: str = ""                   # why the attack could not run here
    seconds: float = 0.0
    detail: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        a = self.accounts
        return {"fault": self.fault, "tried": self.tried, "outcome": self.outcome, "problems": self.problems,
                "unauthorised": self.unauthorised, "rss_mb": self.rss_mb, "exit_code": self.exit_code,
                "skipped": self.skipped,
                "seconds": round(self.seconds, 1), "detail": self.detail,
                "accounts": None if a is None else {
                    "acked": a.acked, "trained": a.trained, "buffered": a.buffered, "dropped": a.dropped,
                    "invalid": a.invalid, "balanced": a.balanced, "nonfinite_steps": a.nonfinite_steps,
                    "saves_failed": a.saves_failed, "seq_gaps": a.seq_gaps}}


def print_table(rows: list[Row], title: str = "") -> None:
    """One line of figures per fault (messages sent; the learner's accounting over the attack:
    segments acked, trained, buffered, optimizer steps skipped as non-finite, saves failed; the exit
    code of a command the attack ended; the learner's RSS; drops by reason), its outcome below."""
    header = ("fault", "sent", "acked", "trained", "buffered", "non-finite", "saves failed", "exit", "RSS MB",
              "dropped (by reason)")
    lines = []
    for r in rows:
        a = r.accounts
        figures = ("-",) * 5 if a is None else (f"{a.acked:,}", f"{a.trained:,}", f"{a.buffered:,}",
                                                str(a.nonfinite_steps), str(a.saves_failed))
        outcome = f"SKIPPED: {r.skipped}" if r.skipped else r.outcome
        if r.problems:
            outcome += f"  PROBLEMS: {'; '.join(r.problems)}"
        lines.append(((r.fault, f"{r.tried:,}", *figures, "-" if r.exit_code is None else str(r.exit_code),
                       "-" if r.rss_mb is None else f"{r.rss_mb:.0f}", "-" if a is None else a.dropped_text()),
                      outcome))
    widths = [max(len(x[i]) for x in [c for c, _ in lines] + [header]) for i in range(len(header))]
    fmt = lambda cells: "  ".join(c.ljust(w) if i in (0, len(header) - 1) else c.rjust(w)   # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    if title:
        print(title)
    print(fmt(header))
    print("-" * min(120, sum(widths) + 2 * (len(widths) - 1)))
    for cells, outcome in lines:
        print(fmt(cells))
        print(f"    {outcome}")


# ------------------------------------------------------------------------------------ the run
def suite_overrides(out: Path, name: str, ports: dict, sizes: Sizes) -> list[str]:
    """A small, fast run that would go on for hours: 1 segment of 4 envs x 4 steps per update
    and rank, a checkpoint every SAVE_INTERVAL updates (only the newest kept, so that a full disk
    fails a save: see checkpoint.make_room), an evaluator that joins and idles, a learner that
    says within STARVING_S when no segment comes."""
    return [f"logging.output_dir={out}", f"logging.experiment_name={name}", "logging.progress=false",
            "learner.max_steps=1000000", f"learner.batch_trajectories={BATCH * sizes.ranks}",
            "learner.micro_batch_size=16", "actor.num_envs=4", "actor.rollout_length=4",
            "algorithm.num_minibatches=1", "algorithm.update_epochs=1", *SMALL_BACKBONE,
            f"checkpoint.save_interval={SAVE_INTERVAL}", "checkpoint.keep_last=1",
            f"launch.num_local_actors={sizes.actors}", f"launch.num_learner_ranks={sizes.ranks}",
            "launch.max_actor_restarts=100000", "eval.eval_interval=1000000", "eval.num_episodes=2",
            "transport.max_message_mb=8", f"learner.starvation_timeout_s={STARVING_S:g}",
            *(f"{k}={v}" for k, v in ports.items())]


class Run:
    """One `asyncvla train` (or `--resume`: of this run, or of the checkpoint `resume` names) in its
    own session, its output in `log`. A watcher thread records every process below the launcher
    (so that none escapes the end-of-run checks) and each learner rank's RSS."""

    def __init__(self, out: Path, name: str, overrides: list[str], ports: dict, ranks: int,
                 resume: bool | Path = False, label: str = ""):
        self.dir, self.ranks, self.ports = out / name, ranks, ports
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log = out / f"{name}-{label or 'train'}.log"
        self.sigterms = 0                        # actors sent SIGTERM here (each exits 143)
        cmd = [sys.executable, "-m", "asyncvla.launch.cli", "train", CONFIG, *overrides]
        if resume:
            cmd += ["--resume", str(self.dir if resume is True else resume)]
        self.proc = start(cmd, self.log)
        self.procs: dict[int, tuple] = {}        # pid -> (start time, module, cmdline)
        self.rss: list[tuple[float, int, int]] = []   # (time, learner pid, RSS bytes)
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._watcher, daemon=True)
        self._watch.start()

    # -- processes
    def _watcher(self) -> None:
        while not self._stop.is_set():
            for pid in descendants(self.proc.pid):
                t = process_start_time(pid)       # read again each time: a child seen between fork
                if t is not None:                 # and exec still shows its parent's command line
                    self.procs[pid] = (t, python_module(pid), _cmdline(pid))
            for pid in self.learners():
                rss = _rss(pid)
                if rss is not None:
                    self.rss.append((time.time(), pid, rss))
            self._stop.wait(0.25)

    def alive(self) -> dict[int, tuple]:
        return {p: v for p, v in list(self.procs.items()) if process_start_time(p) == v[0]}

    def learners(self) -> list[int]:
        return [p for p, v in self.alive().items() if v[1] == LEARNER_MODULE]

    def actors(self) -> list[int]:
        return [p for p, v in self.alive().items() if v[1] == "asyncvla.launch.cli" and " actor " in v[2]]

    def actor(self, index: int) -> int | None:
        return next((p for p in self.actors() if f" --actor-id local-{index} " in self.procs[p][2] + " "), None)

    def evaluators(self) -> list[int]:
        return [p for p, v in self.alive().items() if v[1] == EVALUATOR_MODULE]

    def evaluator_ids(self) -> list[str]:
        host = socket.gethostname()
        return [f"evaluator-{host}-{p}" for p in self.evaluators()]

    def close(self) -> None:
        """Stop whatever is left of the run (SIGKILL to every process seen); then note any checkpoint
        the launcher named that is not the one its learner recorded (`last_words`)."""
        ended = self.proc.poll() is not None
        if not ended:
            _kill(self.proc.pid)
        for p in self.alive():
            _kill(p)
        self.proc.wait()
        self._stop.set()
        self._watch.join()
        self.last_words = named_as_recorded(self.dir, self.text()) if ended else []

    # -- progress
    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def step(self) -> int:
        """The newest complete checkpoint's step (0 before the first)."""
        return max((int(m.group(1)) for d in _scan(self.dir / "checkpoints") if (m := TAG_RE.match(d.name))
                    and os.path.exists(os.path.join(d.path, "COMPLETE.json"))), default=0)

    def wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.time() + timeout
        while not predicate():
            if self.proc.poll() is not None:
                raise Hang(f"the run ended (code {self.proc.returncode}) while waiting for {what}")
            if time.time() > deadline:
                raise Hang(f"no {what} within {timeout:.0f} s")
            time.sleep(0.2)

    def wait_step(self, step: int, timeout: float = PROGRESS_S) -> int:
        self.wait(lambda: self.step() >= step, timeout, f"checkpoint of step {step}")
        return self.step()

    def accounts(self, newer_than: int = -1, timeout: float = PROGRESS_S, current: bool = True) -> Accounts:
        """The accounting every rank wrote at one step > newer_than (by the learner processes
        running now when `current`, else whatever was written last)."""
        deadline = time.time() + timeout
        while True:
            recs = _read_accounting(self.dir, self.ranks)
            pids = set(self.learners()) if current else None
            if recs and len({r["step"] for r in recs}) == 1 and recs[0]["step"] > newer_than and \
                    (pids is None or {r["pid"] for r in recs} <= pids):
                return Accounts.of(recs)
            if not current or time.time() > deadline:
                if recs and not current:
                    return Accounts.of(recs)
                raise Hang(f"no segment accounting after step {newer_than} within {timeout:.0f} s")
            if self.proc.poll() is not None:
                raise Hang(f"the run ended (code {self.proc.returncode}) before writing its accounting")
            time.sleep(0.2)

    def rss_mb(self, since: float, until: float | None = None) -> float | None:
        """The most RSS any learner rank had between the two times, MB."""
        until = until or time.time()
        values = [rss for t, _, rss in list(self.rss) if since <= t <= until]
        return max(values) / 2**20 if values else None

    def crashes(self) -> list[str]:
        """Tracebacks in the log, and local actors or evaluators that exited other than by our
        SIGKILL, by the SIGTERMs sent here (143 each) or with 0."""
        text = self.text()
        out = [f"{n} traceback(s) in {self.log.name}" for n in [text.count("Traceback (most recent call last)")] if n]
        terms = 0
        for who, code in re.findall(r"asyncvla: (actor \d+|the evaluator) exited with (-?\d+)", text):
            terms += int(code) == 128 + signal.SIGTERM
            if int(code) != -signal.SIGKILL and not (int(code) == 128 + signal.SIGTERM and terms <= self.sigterms):
                out.append(f"{who} exited with {code}")
        return out


def named_as_recorded(run_dir: Path, text: str) -> list[str]:
    """Each checkpoint the launcher's own lines name that is not the one its learner recorded in
    RUN/learner_end.json (a run whose learner left no record, killed, is not checked)."""
    from asyncvla.common.rundir import read_end
    end = read_end(run_dir)
    if end is None or not end["checkpoint"]:
        return []
    recorded = Path(end["checkpoint"]).resolve()
    named = {m for ln in text.splitlines() if ln.startswith("asyncvla: ")
             for m in re.findall(r"(/\S*step_\d{8,})", ln)}
    return [f"the launcher named {n}, the learner recorded {recorded}" for n in sorted(named)
            if Path(n).resolve() != recorded]


class Hang(AssertionError):
    """The run did not get somewhere it must within its time."""


def _read_accounting(run_dir: Path, ranks: int) -> list[dict]:
    recs = []
    for r in range(ranks):
        try:
            recs.append(json.loads((run_dir / "accounting" / f"rank_{r}.json").read_text()))
        except (OSError, ValueError):
            return []
    return recs


def _scan(path: Path) -> list:
    try:
        return list(os.scandir(path))
    except OSError:
        return []


def _cmdline(pid: int) -> str:
    try:
        return " " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _kill(pid: int, sig=signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _log_lines_after(run: Run, mark: int, pattern: str) -> list[re.Match]:
    return list(re.finditer(pattern, run.text()[mark:]))


# ------------------------------------------------------------------------------------ sockets
class Peer:
    """A bare DEALER connected to `endpoints` (what any peer can run); replies are counted by kind."""

    def __init__(self, endpoints, **options):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        for k, v in options.items():
            self.sock.setsockopt(getattr(zmq, k), v)
        for ep in [endpoints] if isinstance(endpoints, str) else endpoints:
            self.sock.connect(ep)
        self.replies: dict[str, int] = {}
        self.last: dict[str, P.Message] = {}

    def send(self, frames, timeout_ms: int = -1) -> bool:
        self.sock.sndtimeo = timeout_ms
        try:
            self.sock.send_multipart(frames, copy=False)
            return True
        except zmq.Again:
            return False

    def drain(self, wait_ms: int = 0) -> None:
        """Read every reply there is (waiting up to wait_ms for the first)."""
        while self.sock.poll(wait_ms):
            wait_ms = 0
            frames = self.sock.recv_multipart(copy=False)
            if len(frames) == 1 and ack_count(frames[0]):          # an ack: segments taken
                kind, n = "ack", ack_count(frames[0])
            else:
                n = 1
                try:
                    msg = P.decode(frames, P.Limits.for_kind("control", 64))
                    kind = msg.kind
                    self.last[kind] = msg
                except P.ValidationError:
                    kind = "undecodable"
            self.replies[kind] = self.replies.get(kind, 0) + n

    def settle(self, quiet_s: float = 1.0, timeout_s: float = 30.0) -> None:
        """Read replies until none came for quiet_s."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            before = sum(self.replies.values())
            self.drain(int(quiet_s * 1000))
            if sum(self.replies.values()) == before:
                return

    def ask(self, kind: str, meta: dict, timeout_s: float = 10.0) -> P.Message | None:
        self.last.clear()
        self.send(P.encode_control(kind, meta))
        deadline = time.time() + timeout_s
        while time.time() < deadline and not self.last:
            self.drain(100)
        return next(iter(self.last.values()), None)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def endpoints(run: Run) -> dict:
    p = run.ports
    return {"control": f"tcp://127.0.0.1:{p['transport.control_port']}",
            "weights": f"tcp://127.0.0.1:{p['transport.weights_port']}",
            "segment": [f"tcp://127.0.0.1:{p['transport.segment_port'] + r}" for r in range(run.ranks)]}


def secret(run_dir: Path) -> dict:
    """The hello meta that carries the run's join secret (what a process that reads RUN can send)."""
    from asyncvla.common.transport.auth import read_join_secret
    return {"join_secret": read_join_secret(run_dir)}


class Registration:
    """A peer that said hello as `actor_id` with the run's join secret and stays registered, as an
    actor does, by heartbeats (a LearnerClient): a token is good only while its registration lasts
    (common/transport/auth.py). `token` is the newest welcome's; `close()` says bye."""

    def __init__(self, run: Run, actor_id: str):
        from asyncvla.common import transport
        from asyncvla.common.config import TransportConfig
        self.client = transport.LearnerClient(endpoints(run)["control"], actor_id, TransportConfig(), host="fuzz",
                                              pid=1, num_envs=1, join_secret=secret(run.dir)["join_secret"])
        self.welcome = self.client.join(timeout=30)
        if self.welcome is None:
            self.client.close()
            raise Hang(f"no welcome for {actor_id!r}")

    @property
    def token(self) -> str:
        return self.client.token

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None


def register(run: Run, actor_id: str) -> Registration:
    return Registration(run, actor_id)


# ----------------------------------------------------------------------------------- the fuzz
DEEP_MARK = msgpack.packb("\x00deep\x00")
HOSTILE = ("random_bytes", "flipped_header", "truncated", "deep_nesting", "huge_shape", "many_frames",
           "bad_types", "out_of_range")
ODD_VALUES = [None, True, False, 1.5, float("nan"), "x", "", [1], {"a": 1}, b"\x00", 2**64 - 1, -2**63,
              2**63, "é" * 300]


def _deep(rng) -> bytes:
    depth = int(rng.choice([17, 64, 600, 5000, 50_000]))     # msgpack's own stack gives out at 1024
    return b"\x91" * (depth - 1) + b"\x90"


def _pack(header, deep: bytes | None = None) -> bytes:
    """Header bytes (its layout a list, packed as the codec packs it); `deep` replaces DEEP_MARK,
    in the layout's bytes or in the header's."""
    layout = msgpack.packb(header["layout"], use_bin_type=True)
    if deep is not None and DEEP_MARK in layout:
        layout, deep = layout.replace(DEEP_MARK, deep, 1), None
    packed = msgpack.packb({**header, "layout": layout}, use_bin_type=True)
    return packed if deep is None else packed.replace(DEEP_MARK, deep, 1)


def hostile(rng, category: str, header: dict, frames: list, out_of_range) -> list:
    """One message of a hostile `category` made from a valid (header, array frames)."""
    packed = _pack(header)
    if category == "random_bytes":
        return [rng.bytes(int(rng.integers(0, 2000))) for _ in range(int(rng.integers(1, 5)))]
    if category == "flipped_header":
        h = bytearray(packed)
        for _ in range(int(rng.integers(1, 4))):
            h[int(rng.integers(len(h)))] ^= int(rng.integers(1, 256))
        return [bytes(h), *frames]
    if category == "truncated":
        if frames and rng.random() < 0.5:
            k = int(rng.integers(len(frames)))
            return [packed, *frames[:k], bytes(memoryview(frames[k])[:max(0, len(frames[k]) - 3)]), *frames[k + 1:]]
        return [packed[:int(rng.integers(len(packed)))], *frames]
    if category == "deep_nesting":
        where = rng.integers(3)
        h = dict(header, meta="\x00deep\x00") if where == 0 else \
            dict(header, layout=[*header["layout"], "\x00deep\x00"]) if where == 1 else \
            dict(header, meta={**header["meta"], "x": "\x00deep\x00"})
        return [_pack(h, _deep(rng)), *frames]
    if category == "huge_shape":
        shape = [[1 << 62, 1 << 62, 0], [2**40 + 1], [2**63 - 1], [2**64 - 1], [-1], [1.5], list(range(1, 10)),
                 "x", [2**31] * 4][int(rng.integers(9))]
        layout = [list(a) for a in header["layout"]] or [["f", "uint8", []]]
        layout[int(rng.integers(len(layout)))][2] = shape
        return [_pack(dict(header, layout=layout)), *(frames or [b""])]
    if category == "many_frames":
        n = int(rng.integers(1, 400))
        return [packed, *frames, *([rng.bytes(int(rng.integers(0, 64)))] * n)]
    if category == "bad_types":
        h = dict(header, meta=dict(header["meta"]))
        choice = rng.integers(5)
        if choice == 0 and h["meta"]:
            h["meta"][str(rng.choice(list(h["meta"])))] = ODD_VALUES[int(rng.integers(len(ODD_VALUES)))]
        elif choice == 1:
            h["type"] = ODD_VALUES[int(rng.integers(len(ODD_VALUES)))]
        elif choice == 2:
            h["v"] = ODD_VALUES[int(rng.integers(len(ODD_VALUES)))]
        elif choice == 3:
            return [msgpack.packb(ODD_VALUES[int(rng.integers(len(ODD_VALUES)))]), *frames]
        else:
            return [msgpack.packb({1: 2, "type": header["type"]}), *frames]      # a non-string key
        return [_pack(h), *frames]
    return out_of_range(rng)


# Per port: valid-looking messages with out-of-range values (some of them acceptable: a hello with
# an odd pid or num_envs registers an actor like any hello).
def control_fuzz(count: int, rng, real_ids: list[str]):
    kinds = {"hello": {"actor_id": "fuzz-0", "host": "fuzz", "pid": 1, "num_envs": 4},
             "heartbeat": {"actor_id": "local-0", "token": "0" * 64},
             "bye": {"actor_id": "local-0", "token": "0" * 64},
             "get_policy_files": {"actor_id": "local-0", "token": "0" * 64}}

    def out_of_range(rng):
        kind = str(rng.choice(["hello", "heartbeat", "bye", "get_policy_files", "welcome", "shutdown",
                               "policy_files", "get_weights", "no_weights", "error", "rejoin"]))
        meta = dict(kinds.get(kind, {}))
        if kind == "hello":
            meta.update(actor_id=f"fuzz-{int(rng.integers(1 << 30))}", pid=int(rng.choice([-1, 0, 2**63 - 1])),
                        num_envs=int(rng.choice([-5, 0, 10**12, 2**63 - 1])))
            if rng.random() < 0.3:
                meta[str(rng.choice(["actor_id", "host"]))] = str(rng.choice(["", "h" * 257, "\x00\n\r\x1b[31m"]))
        elif meta:
            meta["actor_id"] = str(rng.choice([*real_ids, "", "a" * 257, "x\n"]))
            meta["token"] = str(rng.choice(["", "0" * 64, "f" * 63, "é"]))
        return P.encode(kind, meta)

    return _fuzz_stream(count, rng, kinds, out_of_range, HOSTILE)


def weights_fuzz(count: int, rng, real_ids: list[str]):
    kinds = {"get_weights": {"newer_than": -1, "wait_ms": 0, "actor_id": "local-0", "token": "0" * 64}}

    def out_of_range(rng):
        meta = {"newer_than": int(rng.choice([-2**63, -1, 2**63 - 1])), "wait_ms": int(rng.choice([-1, 0, 2**62])),
                "actor_id": str(rng.choice([*real_ids, "", "a" * 257])), "token": str(rng.choice(["", "0" * 64]))}
        return P.encode(str(rng.choice(["get_weights", "weights", "hello"])), meta)

    return _fuzz_stream(count, rng, kinds, out_of_range, HOSTILE)


def _fuzz_stream(count: int, rng, kinds: dict, out_of_range, categories):
    names = list(kinds)
    for i in range(count):
        category = categories[i % len(categories)]
        kind = names[int(rng.integers(len(names)))]
        yield category, hostile(rng, category, {"type": kind, "v": P.SCHEMA_VERSION, "meta": kinds[kind], "layout": []}, [],
                                out_of_range)


class SegmentMaker:
    """Segments the run's learner accepts (its spec from the config and the policy's action ids),
    by a fuzz actor that registered like any actor."""

    def __init__(self, run: Run, registration: Registration):
        from asyncvla.common.config import from_dict
        from asyncvla.common.policy.action_tokenizer import ActionTokenizer
        from asyncvla.common.policy.heads import make_head
        from tests.support.segments import make_segment
        cfg = from_dict(registration.welcome["config"])
        policy = json.loads((run.dir / "policy_init" / "policy.json").read_text())
        vocab = policy["action_tokens"]["vocab_size"]
        tokenizer = ActionTokenizer(n_bins=policy["action_tokens"]["n_bins"], vocab_size=vocab)
        self.spec = P.SegmentSpec.for_policy(cfg, make_head(cfg.policy), tokenizer)
        self.first, self.vocab, self.registration, self._make = tokenizer.first_id, vocab, registration, make_segment

    @property
    def token(self) -> str:
        return self.registration.token

    def segment(self, rng, version: int, B: int | None = None, seq: int = 0, episodes: int | None = None) -> P.Segment:
        B = B or int(rng.integers(1, 5))
        seg = self._make(self.spec, B=B, seq=seq, actor_id="fuzz-actor", truncations=int(rng.integers(0, 2)),
                         episodes=int(rng.integers(0, 3)) if episodes is None else episodes, rng=rng)
        seg.meta.update(policy_version=max(0, version), token=self.token)
        return seg


SEGMENT_KINDS = ("valid", "stale", "future_version", "unregistered", "repeat", "huge_counter")


def segment_fuzz(count: int, rng, maker: SegmentMaker, version_fn, categories=(*HOSTILE, *SEGMENT_KINDS[1:4]),
                    first_seq: int = 0):
    """(category, frames) for the segment port. Besides the hostile kinds: segments of the
    registered fuzz actor that are valid (trained on, or dropped stale when the learner moved on
    meanwhile), stale (version 0), from a future version, valid ones without its token, a valid one
    sent twice (the second copy a repeat: the same seq), and one claiming env_steps = 2**63 - 1
    (it used to end the run at once); its i-th message has seq first_seq + i."""
    bases = [maker.segment(rng, 0, B=b) for b in (1, 2, 4)]
    base_frames = [[f if isinstance(f, bytes) else np.ascontiguousarray(f).tobytes() for f in P.encode_segment(b)]
                   for b in bases]
    values = {"behavior_logp": [np.nan, np.inf, 5.0], "rewards": [np.nan, -np.inf, 1e5, -3e38],
              "action_tokens": [-1, maker.first - 1, maker.vocab, 2**62], "instruction": [-1, maker.vocab],
              "terminated": [2], "instruction_mask": [255], "ep_length": [-1], "final_index": [10**6]}
    odd_meta = {"policy_version": -1, "seq": -1, "env_steps": -1, "num_steps": 99, "num_envs": 1000,
                "actor_id": "", "extra": 1}

    def out_of_range(rng):
        seg = bases[int(rng.integers(len(bases)))]
        arrays = dict(seg.arrays)
        meta = {**seg.meta, "policy_version": version_fn(), "token": maker.token if rng.random() < 0.5 else "0" * 64}
        name = str(rng.choice([*values, "meta", "dtype"]))
        if name == "meta":
            key = str(rng.choice(list(odd_meta)))
            meta[key] = odd_meta[key]
        elif name == "dtype":
            arrays["rewards"] = arrays["rewards"].astype(np.float16)
        else:
            if arrays[name].size == 0:
                name = "rewards"
            a = arrays[name].copy()
            a.reshape(-1)[int(rng.integers(a.size))] = rng.choice(values[name])
            arrays[name] = a
        return P.encode(P.SEGMENT, meta, arrays)

    for i in range(count):
        category = categories[i % len(categories)]
        if category in SEGMENT_KINDS:
            version = {"stale": 0, "future_version": version_fn() + 10**6}.get(category, version_fn())
            seg = maker.segment(rng, version, seq=first_seq + i)
            if category == "unregistered":
                seg.meta["token"] = str(rng.choice(["0" * 64, "x"]))
            elif category == "huge_counter":
                seg.meta["env_steps"] = 2**63 - 1
            frames = P.encode_segment(seg)
            if category == "repeat":
                yield "valid", frames
            yield category, frames
            continue
        k = int(rng.integers(len(bases)))
        header = header_of(base_frames[k][0])
        yield category, hostile(rng, category, header, base_frames[k][1:], out_of_range)


class VersionProbe:
    """The weight version the learner serves now, asked as the registered fuzz actor."""

    def __init__(self, run: Run, registration: Registration):
        self.peer, self.registration, self.version = Peer(endpoints(run)["weights"]), registration, 0

    def __call__(self) -> int:
        return self.version

    def refresh(self) -> None:
        reply = self.peer.ask("get_weights", {"newer_than": 2**62, "wait_ms": 0, "actor_id": "fuzz-actor",
                                              "token": self.registration.token}, timeout_s=5)
        if reply is not None and reply.kind == "no_weights":
            self.version = reply.meta["version"]

    def close(self) -> None:
        self.peer.close()


def fuzz(run: Run, port: str, count: int, rng, maker: SegmentMaker | None = None,
         real_ids: list[str] = (), valid: int = 0, timeout_s: float = 300.0) -> Row:
    """`count` hostile messages to one port of the learner from one bare peer, and a few frames over
    the port's cap from another (ZeroMQ drops that connection). Problems: an answer that grants
    something (weights, policy files, a heartbeat's answer), a learner that died or stopped.

    A rank reads its segment port only while it waits for data, so the hostile segments are
    sent while the local actors are paused (SIGSTOP, for the seconds the sending takes): the
    learner then reads them as fast as it can. `valid` segments of the registered fuzz actor
    follow with the actors running again: the learner trains on them (or drops them stale) beside
    the actors' own; among them repeats (dropped as duplicate) and ones claiming a huge env_steps
    (refused as bad_counter)."""
    row = Row(f"fuzz {port} port")
    eps = endpoints(run)
    probe = VersionProbe(run, maker.registration) if maker is not None else None
    if port == "control":
        stream = control_fuzz(count, rng, list(real_ids))
    elif port == "weights":
        stream = weights_fuzz(count, rng, list(real_ids))
    else:
        probe.refresh()
        stream = segment_fuzz(count - valid, rng, maker, probe)
    before = run.accounts(newer_than=-1)
    t0 = time.time()
    peer = Peer(eps[port])
    sent: dict[str, int] = {}
    paused = run.actors() if port == "segment" else []
    try:
        _signal_groups(paused, signal.SIGSTOP)
        _send_all(peer, stream, sent, probe, t0 + timeout_s)
        big = Peer(eps[port])
        cap = P.REQUEST_MAX_BYTES if port != "segment" else 8 << 20
        for _ in range(3):
            big.send([bytes(cap + 1)])
        sent["over_the_frame_cap"] = 3
        time.sleep(0.5)
        big.close()
        # Go on once all is sent: a rank that got its batch meanwhile (an actor's last segment)
        # waits in a collective for the others and reads no more until the actors feed them.
        _signal_groups(paused, signal.SIGCONT)
        paused, t_hostile = [], time.time() - t0
        if port == "segment":
            _wait_acks(peer, sum(sent.values()) - 3, t0 + timeout_s)
        if valid:
            _send_all(peer, segment_fuzz(valid, rng, maker, probe, categories=("valid", "repeat", "huge_counter"),
                                              first_seq=count),
                      sent, probe, t0 + timeout_s)
            _wait_acks(peer, sum(sent.values()) - 3, t0 + timeout_s)
        peer.settle(timeout_s=60)
    finally:
        _signal_groups(paused, signal.SIGCONT)
        peer.close()
        if probe is not None:
            probe.close()
    row.seconds = time.time() - t0
    row.tried = sum(sent.values())
    after = run.accounts(newer_than=run.step())
    row.accounts = after.minus(before)
    row.rss_mb = run.rss_mb(t0)
    granted = {k: v for k, v in peer.replies.items() if k in ("weights", "policy_files", "heartbeat")}
    row.unauthorised = sum(granted.values())
    if granted:
        row.problems.append(f"granted to a peer without a token: {granted}")
    row.problems += _liveness(run)
    replies = ", ".join(f"{k} {v}" for k, v in sorted(peer.replies.items()))
    row.outcome = f"{row.seconds:.0f} s; answers: {replies or 'none'}; learner alive, training"
    row.detail = {"sent": sent, "replies": peer.replies}
    if port == "segment":
        row.detail["hostile_s"] = round(t_hostile, 1)
        acks = peer.replies.get("ack", 0)
        if row.accounts.acked < acks:
            row.problems.append(f"the fuzz peer got {acks} acks, the learner counts {row.accounts.acked} acked")
    return row


def _send_all(peer: Peer, stream, sent: dict, probe, deadline: float) -> None:
    for i, (category, frames) in enumerate(stream):
        while not peer.send(frames, timeout_ms=1000):
            peer.drain()
            if time.time() > deadline:
                raise Hang("the port took no message for too long")
        sent[category] = sent.get(category, 0) + 1
        if i % 50 == 0:
            peer.drain()
            if probe is not None and i % 200 == 0:
                probe.refresh()


def _wait_acks(peer: Peer, n: int, deadline: float) -> None:
    while peer.replies.get("ack", 0) < n:
        if time.time() > deadline:
            raise Hang(f"{peer.replies.get('ack', 0)} of {n} segments taken (acked)")
        peer.drain(200)


def _signal_groups(pids: list[int], sig) -> None:
    for pid in pids:
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _liveness(run: Run) -> list[str]:
    """Problems if the learner is gone or saves no new checkpoint within PROGRESS_S."""
    if run.proc.poll() is not None:
        return [f"the run ended (code {run.proc.returncode})"]
    if len(run.learners()) != run.ranks:
        return [f"{run.ranks - len(run.learners())} learner rank(s) gone"]
    step = run.step()
    try:
        run.wait_step(step + 1)
    except Hang as e:
        return [f"hang: {e}"]
    return []


LIES = ("seq 2**63-1", "ep_length 2**62", "ep_return float32 max")


def lying_segments(run: Run, maker: SegmentMaker, rounds: int, rng, first_seq: int) -> Row:
    """Segments of the registered fuzz actor, valid but for one counter they lie about, `rounds`
    times each: seq = 2**63 - 1 (a stream that took it would drop its next seqs as repeats, and
    count 2**63 missing), an ended episode of 2**62 steps, one with a return of float32's largest
    value (either would own the episode metrics of an update). Each round: a valid segment, the
    three lies, the next valid one (seqs from `first_seq`, where the segment fuzz left the
    stream). Problems: the lies not dropped exactly as bad_counter (seq, length) and bad_reward
    (return), a duplicate (the stream moved), more seq gaps than the two lies with a seq of their
    own per round leave."""
    row = Row("lying episode stats and seq")
    probe = VersionProbe(run, maker.registration)
    before, t0 = run.accounts(), time.time()
    peer = Peer(endpoints(run)["segment"])
    sent: dict[str, int] = {}
    try:
        probe.refresh()
        _send_all(peer, _lies(maker, rounds, rng, probe, first_seq), sent, probe, t0 + PROGRESS_S)
        _wait_acks(peer, sum(sent.values()), t0 + PROGRESS_S)
    finally:
        peer.close()
        probe.close()
    row.seconds, row.tried = time.time() - t0, rounds * len(LIES)
    row.accounts = a = run.accounts(newer_than=run.step()).minus(before)
    row.rss_mb = run.rss_mb(t0)
    want = {"bad_counter": 2 * rounds, "bad_reward": rounds}
    if a.invalid != want:
        row.problems.append(f"invalid {a.invalid}, expected {want}")
    if a.dropped.get("duplicate"):
        row.problems.append(f"{a.dropped['duplicate']} duplicate(s): a lying seq moved the stream")
    if a.seq_gaps > 2 * rounds + 2:         # (+2: the fuzz may have left the stream a seq or two back)
        row.problems.append(f"{a.seq_gaps} seq gaps counted, at most {2 * rounds + 2} expected")
    row.problems += _liveness(run)
    row.outcome = (f"{', '.join(LIES)}: {rounds} each, among {sent.get('valid', 0)} valid; bad_counter "
                   f"{a.invalid.get('bad_counter', 0)}, bad_reward {a.invalid.get('bad_reward', 0)}, "
                   f"duplicate {a.dropped.get('duplicate', 0)}; seq gaps {a.seq_gaps}")
    row.detail = {"sent": sent, "invalid": a.invalid, "seq_gaps": a.seq_gaps}
    return row


def _lies(maker: SegmentMaker, rounds: int, rng, version_fn, seq: int):
    """(category, frames): per round a valid segment, the three LIES, a valid one. Valid episodes
    last 1 step and return 0 (within any env's limit and max_abs_reward)."""
    def segment(seq: int, length: int = 1, ret: float = 0.0) -> list:
        seg = maker.segment(rng, version_fn(), B=2, seq=seq, episodes=1)
        seg.arrays["ep_length"][:] = length
        seg.arrays["ep_return"][:] = ret
        return P.encode_segment(seg)

    for _ in range(rounds):
        yield "valid", segment(seq)
        yield LIES[0], segment(2**63 - 1)
        yield LIES[1], segment(seq + 1, length=2**62)
        yield LIES[2], segment(seq + 2, ret=float(np.finfo(np.float32).max))
        yield "valid", segment(seq + 3)
        seq += 4


# ----------------------------------------------------------------------- the control channel
def hello_flood(run: Run, count: int, peers: int = 4) -> Row:
    """Hellos with fresh actor ids from a few bare peers: each is welcomed (without CURVE anyone
    may join) and registers an actor that then times out. Problems: the learner stops, or a real
    actor times out or has to rejoin meanwhile."""
    row = Row("hello flood")
    ep, key = endpoints(run)["control"], secret(run.dir)
    before, mark, t0 = run.accounts(), len(run.text()), time.time()
    flood = [Peer(ep) for _ in range(peers)]
    try:
        for i in range(count):
            meta = {"actor_id": f"flood-{i}", "host": "flood", "pid": i, "num_envs": 0, **key}
            while not flood[i % peers].send(P.encode_control("hello", meta), timeout_ms=1000):
                flood[i % peers].drain()
            if i % 100 == 0:
                for p in flood:
                    p.drain()
        for p in flood:
            p.settle(timeout_s=120)
    finally:
        for p in flood:
            p.close()
    row.seconds, row.tried = time.time() - t0, count
    welcomed = sum(p.replies.get("welcome", 0) for p in flood)
    row.accounts = run.accounts(newer_than=run.step()).minus(before)
    row.rss_mb = run.rss_mb(t0)
    row.problems += _real_actors_undisturbed(run, mark) + _liveness(run)
    row.outcome = f"{row.seconds:.0f} s; {welcomed} welcomed (each a registered actor, timed out later)"
    row.detail = {"welcomed": welcomed, "registry": row.accounts.records[0].get("control", {}).get("registry")}
    return row


def no_secret(run: Run, count: int) -> Row:
    """Hellos from a local process that cannot read the run directory: without the join secret,
    or with a made-up one, under fresh ids and under the live actors' ids. Each must be refused
    with an error saying why, and counted (no_join_secret, wrong_join_secret). Problems: a
    welcome, a refusal not counted, a real actor disturbed."""
    row = Row("hello without the join secret")
    ep = endpoints(run)["control"]
    before, mark, t0 = run.accounts(), len(run.text()), time.time()
    peer = Peer(ep)
    ids = [f"local-{i}" for i in range(len(run.actors()))]
    try:
        for i in range(count):
            meta = {"actor_id": ids[i % len(ids)] if i % 4 == 0 and ids else f"outsider-{i}", "host": "outsider",
                    "pid": i, "num_envs": 1}
            if i % 2:
                meta["join_secret"] = f"{i:064x}"             # a made-up secret
            while not peer.send(P.encode_control("hello", meta), timeout_ms=1000):
                peer.drain()
            if i % 50 == 0:
                peer.drain()
        peer.settle(timeout_s=60)
    finally:
        peer.close()
    row.seconds, row.tried = time.time() - t0, count
    after = run.accounts(newer_than=run.step())
    row.accounts = after.minus(before)
    refused = {k: _control(after)["invalid"].get(k, 0) - _control(before)["invalid"].get(k, 0)
               for k in ("no_join_secret", "wrong_join_secret")}
    row.unauthorised = peer.replies.get("welcome", 0)
    if row.unauthorised:
        row.problems.append(f"unauthorised: {row.unauthorised} welcomed without the join secret")
    if sum(refused.values()) != count or peer.replies.get("error", 0) != count:
        row.problems.append(f"{refused} counted and {peer.replies.get('error', 0)} errors answered for {count} hellos")
    said = (peer.last.get("error").meta if "error" in peer.last else {}).get("message", "")
    if "join secret" not in said:
        row.problems.append(f"the refusal does not say why: {said!r}")
    row.problems += _real_actors_undisturbed(run, mark) + _liveness(run)
    row.outcome = (f"{count} hellos ({count // 2} without a secret, {count - count // 2} with a made-up one; "
                   f"a quarter under live ids): {refused['no_join_secret']} + {refused['wrong_join_secret']} refused "
                   f"(no_join_secret, wrong_join_secret), {row.unauthorised} welcomed")
    row.detail = {"refused": refused, "replies": peer.replies}
    return row


def squatter(run: Run, index: int = 1, hold_s: float = 3.0) -> Row:
    """SIGKILL local actor `index` and at once take its id from a bare peer holding the join
    secret (a process that reads RUN), heartbeating as the holder. The launcher restarts the actor
    once; its hello is refused (id_taken) while the squatter holds the id, and it says hello again
    instead of exiting, until the squatter's connection is gone (`hold_s` after the restart's first
    refusal): then it joins and sends. Problems: more than one restart (a wasted one), an exit
    other than the kill, no refusal seen, no join after the squatter left."""
    row = Row("squatter on a killed actor's id", tried=1)
    before, mark, t0 = run.accounts(), len(run.text()), time.time()
    pid = run.actor(index)
    if pid is None:
        row.problems.append(f"no local actor {index} running")
        return row
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        _kill(pid)
    actor_id = f"local-{index}"
    peer = Peer(endpoints(run)["control"])
    refused = re.compile(rf"actor_id '{actor_id}' is live in another connection; saying hello again")
    held = False
    try:
        deadline = time.time() + 30
        while not held and time.time() < deadline:      # taken once the learner sees the old connection gone
            peer.last.clear()
            peer.send(P.encode_control("hello", {"actor_id": actor_id, "host": "squatter", "pid": os.getpid(),
                                                 "num_envs": 0, **secret(run.dir)}), timeout_ms=1000)
            peer.drain(200)
            held = "welcome" in peer.last
        if not held:
            row.problems.append(f"the squatter never got {actor_id}")
            return row
        token = peer.last["welcome"].meta["token"]
        deadline, seen_at = time.time() + PROGRESS_S, None
        while time.time() < deadline and (seen_at is None or time.time() < seen_at + hold_s):
            peer.send(P.encode_control("heartbeat", {"actor_id": actor_id, "token": token}), timeout_ms=1000)
            peer.drain(500)
            if seen_at is None and refused.search(run.text()[mark:]):
                seen_at = time.time()
        if seen_at is None:
            row.problems.append("the restarted actor never met the squatter (no refusal logged)")
    finally:
        peer.close()
    restarts = re.compile(rf"asyncvla: actor {index} exited with (-?\d+)(?: \(\w+\))?; restart")
    joined = re.compile(rf"actor {actor_id}: first segment sent")
    try:
        run.wait(lambda: joined.search(run.text()[mark:]), PROGRESS_S, "the restarted actor's first segment")
    except Hang as e:
        row.problems.append(str(e))
    codes = [int(c) for c in restarts.findall(run.text()[mark:])]
    if codes != [-signal.SIGKILL]:
        row.problems.append(f"restarts of actor {index}: exit codes {codes} (one, the kill's, expected)")
    row.seconds = time.time() - t0
    row.accounts = run.accounts(newer_than=run.step()).minus(before)
    row.problems += _liveness(run)
    row.outcome = (f"{len(codes)} restart(s) (exit codes {codes}); refused while the squatter held the id, it said "
                   f"hello again and joined {row.seconds:.0f} s after the kill")
    return row


def id_hijack(run: Run, token: str | None, rounds: int = 5) -> Row:
    """A bare peer on the same machine speaks for the live local actors (no keys: any local process
    can claim any id, host and pid): hellos copying each one's host and pid from the run's log
    ("actor local-0 joined (HOST pid N)"), each refused while the real actor is connected
    (id_taken); and for local-0, whose token it kept from holding that id while it was free
    (`actor_sigterm`), heartbeats and byes with that token, each refused as the token of a
    registration that has ended (stale_token). Problems: a welcome, a heartbeat answered or an
    actor removed by a bye (unauthorised), fewer refusals than requests of either kind, a real
    actor that left, was dropped or had to rejoin."""
    row = Row("hello under a live actor's id")
    ep = endpoints(run)["control"]
    before, mark, t0 = run.accounts(), len(run.text()), time.time()
    claims = {f"local-{i}": _claimed(run, i) for i in range(len(run.actors()))}
    peer = Peer(ep)
    sent = {"hello": 0, "heartbeat": 0, "bye": 0}
    try:
        for _ in range(rounds):
            for actor_id, (host, pid) in claims.items():
                peer.send(P.encode_control("hello", {"actor_id": actor_id, "host": host, "pid": pid, "num_envs": 4,
                                                     **secret(run.dir)}), timeout_ms=1000)
                sent["hello"] += 1
            for kind in ("heartbeat", "bye") if token is not None else ():
                peer.send(P.encode_control(kind, {"actor_id": "local-0", "token": token}), timeout_ms=1000)
                sent[kind] += 1
        peer.settle(timeout_s=60)
    finally:
        peer.close()
    row.seconds, row.tried = time.time() - t0, sum(sent.values())
    after = run.accounts(newer_than=run.step())
    row.accounts = after.minus(before)
    taken = _control(after)["invalid"].get("id_taken", 0) - _control(before)["invalid"].get("id_taken", 0)
    stale = _control(after)["invalid"].get("stale_token", 0) - _control(before)["invalid"].get("stale_token", 0)
    removed = _registry(after)["left_total"] - _registry(before)["left_total"]
    granted = {"welcome": peer.replies.get("welcome", 0), "heartbeat answered": peer.replies.get("heartbeat", 0),
               "removed by a bye": removed}
    row.unauthorised = sum(granted.values())
    if row.unauthorised:
        row.problems.append(f"unauthorised: {granted}")
    if taken != sent["hello"]:
        row.problems.append(f"{taken} counted id_taken of {sent['hello']} hellos")
    if stale != sent["heartbeat"] + sent["bye"]:
        row.problems.append(f"{stale} counted stale_token of {sent['heartbeat'] + sent['bye']} heartbeats and byes")
    if token is None:
        row.problems.append("no token of local-0 (actor SIGTERM): heartbeats and byes not sent")
    row.problems += _real_actors_undisturbed(run, mark) + _liveness(run)
    shown = ", ".join(f"{i} as {h} pid {p}" for i, (h, p) in claims.items())
    row.outcome = (f"{sent['hello']} hellos ({shown}): {taken} refused (id_taken); {sent['heartbeat']} heartbeats "
                   f"and {sent['bye']} byes with local-0's old token: {stale} refused (stale_token); "
                   f"{row.unauthorised} accepted")
    row.detail = {"refused": taken + stale, "sent": sent, "replies": peer.replies, "claimed": claims}
    return row


def _claimed(run: Run, index: int) -> tuple[str, int]:
    """The host and pid local actor `index` said hello with, as the run's log has it (the last
    "joined" or "replaced" line), else this host and its process's pid (its log line folded)."""
    found = re.findall(rf"actor local-{index} (?:joined|replaced) \((.+?) pid (\d+)\)", run.text())
    pid = run.actor(index)
    if found and int(found[-1][1]) == pid:
        return found[-1][0], pid
    return socket.gethostname(), pid or 0


def _take_free_id(run: Run, actor_id: str, timeout_s: float = 30.0) -> str | None:
    """Say hello as `actor_id` until welcomed (refused while its holder is connected), then let it
    go; the welcome's token, or None."""
    peer = Peer(endpoints(run)["control"])
    deadline = time.time() + timeout_s
    try:
        while time.time() < deadline:
            peer.last.clear()
            peer.send(P.encode_control("hello", {"actor_id": actor_id, "host": socket.gethostname(),
                                                 "pid": os.getpid(), "num_envs": 0, **secret(run.dir)}),
                      timeout_ms=1000)
            peer.drain(200)
            if "welcome" in peer.last:
                return peer.last["welcome"].meta["token"]
    finally:
        peer.close()
    return None


def spoofing(run: Run, count: int, rng, other_token: str) -> Row:
    """heartbeat, bye, get_policy_files (control) and get_weights (weights) for the ids of the
    live actors and the evaluator, without their token: none, empty, made up, or another actor's.
    Problems (unauthorised actions): a heartbeat answered as the actor's, policy files or weights
    served, an actor that left the registry or had to rejoin."""
    row = Row("spoofed heartbeats/byes")
    eps = endpoints(run)
    ids = sorted({f"local-{i}" for i in range(len(run.actors()))} | set(run.evaluator_ids()))
    tokens = [None, "", "0" * 64, other_token, "é" * 10]
    before, mark, t0 = run.accounts(), len(run.text()), time.time()
    control, weights = Peer(eps["control"]), Peer(eps["weights"])
    try:
        for i in range(count):
            token = tokens[int(rng.integers(len(tokens)))]
            meta = {"actor_id": ids[i % len(ids)], **({} if token is None else {"token": token})}
            for kind in ("heartbeat", "bye", "get_policy_files"):
                while not control.send(P.encode(kind, meta), timeout_ms=1000):
                    control.drain()
            while not weights.send(P.encode("get_weights", {"newer_than": -1, "wait_ms": 0, **meta}), timeout_ms=1000):
                weights.drain()
            if i % 50 == 0:
                control.drain()
                weights.drain()
        control.settle()
        weights.settle()
    finally:
        control.close()
        weights.close()
    row.seconds, row.tried = time.time() - t0, 4 * count
    after = run.accounts(newer_than=run.step())
    row.accounts = after.minus(before)
    row.rss_mb = run.rss_mb(t0)
    granted = {f"control {k}": v for k, v in control.replies.items() if k in ("heartbeat", "policy_files")}
    granted.update({f"weights {k}": v for k, v in weights.replies.items() if k == "weights"})
    left = _registry(after)["left_total"] - _registry(before)["left_total"]
    if left:
        granted["actors removed from the registry"] = left
    row.unauthorised = sum(granted.values())
    if granted:
        row.problems.append(f"unauthorised: {granted}")
    row.problems += _real_actors_undisturbed(run, mark) + _liveness(run)
    answers = {**{f"control {k}": v for k, v in control.replies.items()},
               **{f"weights {k}": v for k, v in weights.replies.items()}}
    row.outcome = (f"ids {', '.join(i[:24] for i in ids)}; answers: "
                   f"{', '.join(f'{k} {v}' for k, v in sorted(answers.items())) or 'none'}; 0 accepted")
    row.detail = {"answers": answers, "control_invalid_after": after.records[0].get("control", {}).get("invalid")}
    return row


def _registry(accounts: Accounts) -> dict:
    return _control(accounts)["registry"]


def _control(accounts: Accounts) -> dict:
    """Rank 0's control server figures: requests refused by reason, the actor registry."""
    control = accounts.records[0].get("control", {})
    return {"invalid": control.get("invalid", {}), "registry": control.get("registry", {"left_total": 0})}


def _real_actors_undisturbed(run: Run, mark: int) -> list[str]:
    text = run.text()[mark:]
    out = []
    gone = re.findall(r"actor ((?:local|evaluator)-\S+) (?:\([^)]*\) timed out|left)", text)
    if gone:
        out.append(f"real actors dropped from the registry: {sorted(set(gone))}")
    if "rejoined the learner" in text:
        out.append("a real actor had to rejoin")
    return out


# -------------------------------------------------------------------------------- the disk
def mount_small_disk(path: Path, size_mb: int = 32) -> tuple[Path | None, str | None]:
    """A small tmpfs (else an ext4 loop device) mounted at `path`, or None and why there is none."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return None, "mounting a small disk (tmpfs or loop device) needs root"
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode == 0:
        return path, None
    why = [f"tmpfs: {r.stderr.strip()}"]
    image = path.parent / f".{path.name}.img"
    try:
        with open(image, "wb") as f:
            f.truncate(size_mb << 20)
        for cmd in (["mkfs.ext4", "-q", "-F", str(image)], ["mount", "-o", "loop", str(image), str(path)]):
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                why.append(f"loop device: {r.stderr.strip() or cmd[0]}")
                return None, "; ".join(why)
    except OSError as e:
        why.append(f"loop device: {e}")
        return None, "; ".join(why)
    return path, None


def unmount(path: Path | None) -> None:
    if path is not None:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def disk_full(run: Run, no_disk: str | None, timeout_s: float = PROGRESS_S) -> Row:
    """Ballast fills the checkpoints' small disk (and takes back any room freed) until a save
    fails; then it goes. Problems: the run stops, or the next save does not succeed."""
    row = Row("disk full during a save")
    if no_disk:
        row.skipped = no_disk
        return row
    root = run.dir / "checkpoints"
    before, mark, t0 = run.accounts(), len(run.text()), time.time()
    stop, ballast = threading.Event(), []

    def fill():
        chunk = bytes(256 << 10)
        while not stop.is_set():
            path = root / f"ballast-{len(ballast)}"
            ballast.append(path)
            try:
                with open(path, "wb") as f:
                    while not stop.is_set():
                        f.write(chunk)
                        f.flush()
            except OSError:           # full: keep it full
                stop.wait(0.02)
    filler = threading.Thread(target=fill, daemon=True)
    filler.start()
    try:
        run.wait(lambda: "NOT saved" in run.text()[mark:], timeout_s, "failed save")
    except Hang as e:
        row.problems.append(str(e))
    finally:
        stop.set()
        filler.join()
        for p in ballast:
            p.unlink(missing_ok=True)
    failed = re.search(r"checkpoint \S*step_(\d+) NOT saved \((.*?)\); deleted", run.text()[mark:])
    row.tried = 1
    if failed:
        step = int(failed.group(1))
        try:
            saved = run.wait_step(step + 1)
            row.outcome = (f"the save of step {step} failed ({failed.group(2)[:80]}); with the ballast gone "
                           f"the next one, step {saved}, is complete; the run went on")
        except Hang as e:
            row.problems.append(f"no save after the failed one: {e}")
    row.seconds = time.time() - t0
    row.accounts = run.accounts(newer_than=run.step()).minus(before)
    row.rss_mb = run.rss_mb(t0)
    row.problems += _liveness(run)
    return row


# -------------------------------------------------------------------------------- processes
def actor_churn(run: Run, duration_s: float, every_s: float, rng: random.Random) -> Row:
    """SIGKILL a random local actor (its process group) every `every_s` for `duration_s`; the
    launcher restarts each. Problems: the learner stops training or dies, a kill not followed by
    a restart."""
    row = Row("actor churn (SIGKILL)")
    before, mark, t0, step0 = run.accounts(), len(run.text()), time.time(), run.step()
    kills = 0
    while kills < int(duration_s // every_s):
        time.sleep(max(0.0, t0 + (kills + 1) * every_s - time.time()))
        if run.proc.poll() is not None:
            break
        actors = run.actors()
        if actors:
            pid = rng.choice(actors)
            try:
                os.killpg(pid, signal.SIGKILL)        # an actor leads its own session (and group)
            except (ProcessLookupError, PermissionError):
                _kill(pid)
            kills += 1
    restarts = lambda: len(_log_lines_after(run, mark, r"actor \d+ exited with -9 \(SIGKILL\); restart"))   # noqa: E731
    try:
        run.wait(lambda: restarts() >= kills and not _restarting(run, mark), 60, f"{kills} actor restarts, all sending")
    except Hang as e:
        row.problems.append(str(e))
    step1 = run.step()
    if step1 <= step0:
        row.problems.append(f"hang: no update saved during the churn (step {step0})")
    row.tried, row.seconds = kills, time.time() - t0
    row.accounts = run.accounts(newer_than=run.step()).minus(before)
    row.rss_mb = run.rss_mb(t0)
    row.problems += _liveness(run)
    row.outcome = (f"{kills} kills in {duration_s:.0f} s, {restarts()} restarts by the launcher; "
                   f"{step1 - step0} updates meanwhile")
    return row


def _restarting(run: Run, mark: int) -> set[str]:
    """Local actors restarted since `mark` that have not sent a segment yet."""
    pending = set()
    for m in re.finditer(r"asyncvla: actor (\d+) exited with -?\d+(?: \(\w+\))?; restart|actor local-(\d+): first segment sent",
                         run.text()[mark:]):
        if m.group(1) is not None:
            pending.add(m.group(1))
        else:
            pending.discard(m.group(2))
    return pending


def actor_sigterm(run: Run, index: int = 0) -> tuple[Row, str | None]:
    """SIGTERM to local actor `index` (what `kill` or a scheduler sends): it says bye and exits 143,
    the launcher restarts it ("actor 0 exited with 143 (SIGTERM); restart k/N") and training goes
    on. While its id is free a bare peer takes it (without keys any peer may) and lets it go at
    once: the restart takes it over. Returns the row and the token the peer was given, whose
    registration the restart's takeover ends, for `id_hijack`. Problems: another
    exit code, no restart, an actor that does not send again, training that stops."""
    row = Row("actor SIGTERM", tried=1)
    before, mark, t0, step0 = run.accounts(), len(run.text()), time.time(), run.step()
    pid = run.actor(index)
    if pid is None:
        row.problems.append(f"no local actor {index} running")
        return row, None
    _kill(pid, signal.SIGTERM)
    run.sigterms += 1
    token = _take_free_id(run, f"local-{index}")
    restart = re.compile(rf"asyncvla: actor {index} exited with (-?\d+)(?: \(\w+\))?; restart (\d+)/")
    try:
        run.wait(lambda: restart.search(run.text()[mark:]) and not _restarting(run, mark), PROGRESS_S,
                 "the actor's restart, sending")
    except Hang as e:
        row.problems.append(str(e))
    got = restart.search(run.text()[mark:])
    row.exit_code = code = int(got.group(1)) if got else None
    if code != 128 + signal.SIGTERM:
        row.problems.append(f"actor {index} exited with {code}, not 143")
    row.seconds = time.time() - t0
    row.problems += _liveness(run)
    row.accounts = run.accounts(newer_than=run.step()).minus(before)
    row.rss_mb = run.rss_mb(t0)
    row.outcome = (f"actor {index} exited with {code}; restart {got.group(2) if got else '-'} by the launcher, "
                   f"sending again after {row.seconds:.0f} s (its id held by a bare peer meanwhile: "
                   f"{'taken and let go' if token else 'never free'}); {run.step() - step0} updates meanwhile")
    return row, token


def evaluator_sigkill(run: Run) -> Row:
    """SIGKILL the evaluator: the launcher reaps it (no zombie), says so and starts another ("the
    evaluator exited with -9 (SIGKILL); restarting it (1/1)"), which joins the learner under its
    own id; nothing of the killed one is left; training goes on."""
    row = Row("evaluator SIGKILL", tried=1)
    before, mark, t0 = run.accounts(), len(run.text()), time.time()
    old = run.evaluators()
    if not old:
        row.problems.append("no evaluator running")
        return row
    tree = [old[0], *descendants(old[0])]
    _kill(old[0])
    said = "the evaluator exited with -9 (SIGKILL); restarting it (1/1)"
    joined = re.compile(r"actor evaluator-\S+-(\d+) (?:joined|replaced)")
    try:
        run.wait(lambda: said in run.text()[mark:], 30, "the launcher's restart line")
        run.wait(lambda: any(int(m.group(1)) not in tree for m in joined.finditer(run.text()[mark:])),
                 PROGRESS_S, "the new evaluator's join")
    except Hang as e:
        row.problems.append(str(e))
    time.sleep(1.0)
    left = [p for p in tree if os.path.exists(f"/proc/{p}")]
    zombies = [p for p in left if _state(p) == "Z"]
    if zombies:
        row.problems.append(f"zombie(s) left: {zombies}")
    elif left:
        row.problems.append(f"{len(left)} process(es) of the killed evaluator left")
    new = [p for p in run.evaluators() if p not in tree]
    row.seconds = time.time() - t0
    row.problems += _liveness(run)
    row.accounts = run.accounts(newer_than=run.step()).minus(before)
    row.outcome = (f"pid {old[0]} killed; the launcher restarted it (1/1): pid {new[0] if new else '-'} joined "
                   f"after {row.seconds:.0f} s; {len(zombies)} zombies, {len(left)} processes of the old one left")
    return row


def _state(pid: int) -> str:
    """A process's state letter (R, S, Z, ...), '' when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def learner_starving(run: Run) -> Row:
    """Every local actor stopped (SIGSTOP) until the learner says it starves, within a few
    learner.starvation_timeout_s: "rank 0: no segment for N s (learner.starvation_timeout_s=S);
    last heard from local-..."; then they go on, and so does training. Problems: no such line, or
    one that names no actor."""
    row = Row("learner starving", tried=1)
    before, mark, t0 = run.accounts(), len(run.text()), time.time()
    line = re.compile(r"rank 0: no segment for (\d+) s \(learner\.starvation_timeout_s=[\d.]+\); ([^;\n]*)")
    paused = run.actors()
    try:
        _signal_groups(paused, signal.SIGSTOP)
        run.wait(lambda: line.search(run.text()[mark:]), 3 * STARVING_S + 10, "the starvation line")
    except Hang as e:
        row.problems.append(str(e))
    finally:
        _signal_groups(paused, signal.SIGCONT)
    said = line.search(run.text()[mark:])
    if said and "last heard from local-" not in said.group(2):
        row.problems.append(f"the line names no local actor: {said.group(0)!r}")
    row.seconds = time.time() - t0
    row.problems += _liveness(run)
    row.accounts = run.accounts(newer_than=run.step()).minus(before)
    row.outcome = (f"{len(paused)} actors stopped; the learner said after {said.group(1)} s: "
                   f"\"{said.group(2)[:90]}\"; training went on" if said else f"{len(paused)} actors stopped")
    return row


def launcher_sigint(run: Run, start_step: int) -> tuple[Row, int | None]:
    """SIGINT to `asyncvla train`: exit 130 within the grace period, a final checkpoint, every rank's
    final accounting balanced and covering every trained column, no process left. Returns the
    row and the final checkpoint's step (which --resume must continue from)."""
    row = Row("launcher SIGINT", tried=1)
    t0 = time.time()
    run.proc.send_signal(signal.SIGINT)
    try:
        code = run.proc.wait(timeout=STOP_GRACE_S + 30)
    except subprocess.TimeoutExpired:
        row.problems.append(f"hang: still running {STOP_GRACE_S + 30:.0f} s after SIGINT")
        return row, None
    row.seconds = took = time.time() - t0
    text = run.text()
    final = re.search(r"final checkpoint (\S+?);", text)
    step = int(TAG_RE.match(Path(final.group(1)).name).group(1)) if final else None
    if code != 130:                         # stopped, not finished
        row.problems.append(f"exit code {code}")
    if step is None or not (run.dir / "checkpoints" / f"step_{step:08d}" / "COMPLETE.json").exists():
        row.problems.append("no complete final checkpoint named")
    time.sleep(1.0)
    if run.alive():
        row.problems.append(f"left running: {sorted({v[1] for v in run.alive().values()})}")
    row.accounts = acc = run.accounts(current=False)
    row.problems += _final_accounting(acc, step, start_step, run.ranks)
    row.exit_code = code
    row.outcome = f"exit {code} after {took:.1f} s, final checkpoint step {step}"
    return row, step


def _final_accounting(acc: Accounts, step: int | None, start_step: int, ranks: int) -> list[str]:
    out = []
    if not acc.balanced:
        out.append("accounting: acked != trained + dropped + buffered")
    if step is not None and acc.step != step:
        out.append(f"accounting written at step {acc.step}, the run ended at {step}")
    elif acc.columns_trained != (acc.step - start_step) * BATCH * ranks:
        out.append(f"accounting: {acc.columns_trained} columns trained in {acc.step - start_step} updates "
                   f"of {BATCH * ranks}")
    return out


def resume(out: Path, name: str, overrides: list[str], ports: dict, ranks: int, expect_step: int,
           label: str) -> tuple[Run, list[str]]:
    """`asyncvla train ... --resume RUN`; problems unless it resumes at `expect_step` and trains on."""
    run = Run(out, name, overrides, ports, ranks, resume=True, label=label)
    problems = []
    try:
        run.wait(lambda: "resumed from" in run.text(), PROGRESS_S + 60, "resume")
        got = re.search(r"resumed from \S+ at step (\d+)", run.text())
        if int(got.group(1)) != expect_step:
            problems.append(f"resumed at step {got.group(1)}, the newest complete checkpoint is {expect_step}")
        run.wait_step(expect_step + 1)
    except Hang as e:
        problems.append(str(e))
    return run, problems


def learner_kill(run: Run, during_save: bool, rng: random.Random) -> tuple[Row, int | None, str]:
    """SIGKILL every learner rank, during a save (as soon as a new tag folder without its marker
    appears) or at a random moment. Returns the row, the newest complete checkpoint's step (what
    --resume must continue from) and where the kill landed."""
    from asyncvla.learner.checkpoint import find_latest

    row = Row("learner SIGKILL", tried=1)
    root, base, t0 = run.dir / "checkpoints", run.step(), time.time()
    caught = None
    if during_save:
        deadline = time.time() + PROGRESS_S
        while caught is None and time.time() < deadline and run.proc.poll() is None:
            for d in _scan(root):
                m = TAG_RE.match(d.name)
                if m and int(m.group(1)) > base and not os.path.exists(os.path.join(d.path, "COMPLETE.json")):
                    caught = Path(d.path)
                    break
            else:
                time.sleep(0.001)
    else:
        time.sleep(rng.uniform(0.2, 3.0))
    ranks = run.learners()
    for pid in ranks:
        _kill(pid)
    where = f"at step ~{run.step()}"
    if caught is not None:
        where = (f"during the save of {caught.name} (left without its marker)" if not (caught / "COMPLETE.json").exists()
                 else f"just after the save of {caught.name}")
    try:
        code = run.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        row.problems.append("hang: the launcher still runs 60 s after its learner was killed")
        code = None
    if not ranks:
        row.problems.append("no learner rank to kill")
    row.seconds = time.time() - t0
    acc = run.accounts(current=False)
    row.accounts = acc if {r["pid"] for r in acc.records} <= set(ranks) else None   # None: killed before its first
    if row.accounts is not None and not row.accounts.balanced:
        row.problems.append("accounting: acked != trained + dropped + buffered")
    newest = find_latest(run.dir)
    newest_step = int(TAG_RE.match(newest.name).group(1)) if newest is not None else None
    row.exit_code = code
    row.outcome = f"killed {where}; launcher exit {code}; newest complete checkpoint step {newest_step}"
    return row, newest_step, where


def launcher_sigkill(run: Run, within_s: float = 5.0) -> Row:
    """SIGKILL `asyncvla train`: within `within_s` no process of the run may be left."""
    row = Row("launcher SIGKILL", tried=1)
    procs = run.alive()
    modules = sorted({v[1] or "?" for v in procs.values()})
    t0 = time.time()
    _kill(run.proc.pid)
    row.exit_code = run.proc.wait()
    while run.alive() and time.time() - t0 < within_s:
        time.sleep(0.05)
    left = run.alive()
    took = time.time() - t0
    if left:
        row.problems.append(f"left after {within_s:.0f} s: {sorted({v[1] for v in left.values()})}")
    row.seconds = took
    row.accounts = run.accounts(current=False)
    row.outcome = f"{len(procs)} processes ({', '.join(m.rsplit('.', 1)[-1] for m in modules)}); " + \
        (f"none left after {took:.1f} s" if not left else f"{len(left)} left")
    return row


# ----------------------------------------------------------------------- starting and resuming
def side_overrides(out: Path, name: str, ports: dict, ranks: int) -> list[str]:
    """The suite's run without actors or evaluator: a learner that starts (or resumes) and waits."""
    return [*suite_overrides(out, name, ports, Sizes(ranks=ranks, actors=0)), "eval.eval_interval=0"]


def huge_flow_chains(out: Path, count: int = 12, updates: int = 60) -> Row:
    """A short run with the flow head (1 local actor) and a peer holding the join secret that sends
    `count` segments whose chains are finite but times 2e30 (the probe that once ended such a run:
    every update after them non-finite). Each must be refused on receipt as out_of_range and
    counted; the run trains on and ends by its budget, exit 0, with no optimizer step skipped."""
    row, t0 = Row("huge flow chains (flow head)", tried=count), time.time()
    ports = run_ports()
    overrides = [*suite_overrides(out, "flow_chains", ports, Sizes(actors=1)), "eval.eval_interval=0",
                 "policy.action_head=flow", f"learner.max_steps={updates}", "learner.max_nonfinite_steps=2"]
    run = Run(out, "flow_chains", overrides, ports, 1, label="train")
    peer = registration = None
    try:
        run.wait_step(SAVE_INTERVAL, timeout=300)
        registration = register(run, "fuzz-actor")
        maker = SegmentMaker(run, registration)
        probe = VersionProbe(run, registration)
        probe.refresh()
        peer = Peer(endpoints(run)["segment"])
        rng = np.random.default_rng(1)
        for i in range(count):
            seg = maker.segment(rng, probe(), B=2, seq=i)
            seg.arrays["flow_chain"] = seg.arrays["flow_chain"] * np.float32(2e30)
            while not peer.send(P.encode_segment(seg), timeout_ms=1000):
                peer.drain()
        _wait_acks(peer, count, time.time() + PROGRESS_S)
        row.exit_code = run.proc.wait(timeout=PROGRESS_S + 60)
    except (Hang, subprocess.TimeoutExpired) as e:
        row.problems.append(f"hang: {e}")
    finally:
        if peer is not None:
            peer.close()
        if registration is not None:
            registration.close()
        run.close()
    row.seconds = time.time() - t0
    try:
        row.accounts = run.accounts(current=False)
    except Hang as e:
        row.problems.append(f"no final accounting: {e}")
        return row
    refused = row.accounts.records[0]["invalid"].get("out_of_range", 0)
    if row.exit_code != 0 or "finished by its budget" not in run.text():
        row.problems.append(f"exit {row.exit_code}, not 0 by its budget")
    if refused != count:
        row.problems.append(f"{refused} of {count} refused as out_of_range")
    if row.accounts.nonfinite_steps:
        row.problems.append(f"{row.accounts.nonfinite_steps} optimizer steps skipped as non-finite")
    if "'flow_chain' holds" not in run.text():
        row.problems.append("the refusal was not logged naming the field")
    row.problems += run.last_words + run.crashes()
    row.outcome = (f"{count} segments with chains x 2e30: {refused} refused on receipt (out_of_range, naming "
                   f"'flow_chain'); 0 steps skipped; exit {row.exit_code} by its budget ({updates} updates)")
    return row


def startup_ctrl_c(out: Path, ranks: int) -> Row:
    """Ctrl-C (SIGINT to `asyncvla train`) as soon as a learner rank process exists, still
    importing: a rank is asked to stop only once it catches the signal, so the run ends as any
    stopped run does, exit 130 with one line ("stopped by SIGINT before the first update: no
    checkpoint to resume from"); no traceback, nothing left."""
    row, t0 = Row("Ctrl-C during start-up", tried=1), time.time()
    ports = run_ports()
    run = Run(out, "startup", side_overrides(out, "startup", ports, ranks), ports, ranks, label="ctrl-c")
    left = {}
    try:
        run.wait(run.learners, PROGRESS_S, "a learner rank process")
        t_int = time.time()
        run.proc.send_signal(signal.SIGINT)
        # (the grace counts from the moment the last rank is asked, once it catches the signal,
        # up to the launcher's STARTING_S after the stop: three other runs start beside this one)
        row.exit_code = run.proc.wait(timeout=STARTING_S + STOP_GRACE_S + 30)
        row.seconds = time.time() - t0
        time.sleep(1.0)
        left = run.alive()
    except (Hang, subprocess.TimeoutExpired) as e:
        row.problems.append(f"hang: {e}")
        return row
    finally:
        run.close()
    want = "asyncvla: stopped by SIGINT before the first update: no checkpoint to resume from"
    said = [ln for ln in run.text().splitlines() if ln.startswith("asyncvla: stopped")]
    row.problems += _one_stop(run, row.exit_code, said, [want]) + _stopped_accounts(run, row) + \
        ([f"left running: {sorted({v[1] for v in left.values()})}"] if left else [])
    row.outcome = (f"SIGINT {t_int - t0:.0f} s after the launch, a rank starting; exit {row.exit_code} "
                   f"{time.time() - t_int:.0f} s later: \"{want[len('asyncvla: '):]}\"")
    return row


def _stopped_accounts(run: Run, row: Row) -> list[str]:
    """The final accounting of a learner stopped before its first update, into `row`: balanced,
    nothing trained."""
    try:
        row.accounts = run.accounts(current=False)
    except Hang as e:
        return [f"no final accounting: {e}"]
    if not row.accounts.balanced or row.accounts.trained:
        return [f"accounting: {row.accounts.acked} acked, {row.accounts.trained} trained, balanced "
                f"{row.accounts.balanced}"]
    return []


def _one_stop(run: Run, code: int | None, said: list[str], want: list[str]) -> list[str]:
    out = [] if code == 130 else [f"exit code {code}, not 130"]
    if said != want:
        out.append(f"stop lines {said}, expected {want}")
    if "Traceback" in run.text():
        out.append("a traceback in the log")
    return out


def keep_checkpoint(run: Run, store: Path) -> Path | None:
    """A copy of the run's newest complete checkpoint in `store`, or None (the run may prune the
    tag while it is copied: the copy must pass its completion marker's check)."""
    from asyncvla.learner.checkpoint import check_complete

    for _ in range(5):
        step = run.step()
        if not step:
            return None
        src = run.dir / "checkpoints" / f"step_{step:08d}"
        dst = store / src.name
        shutil.rmtree(dst, ignore_errors=True)
        try:
            shutil.copytree(src, dst)
        except (OSError, shutil.Error):
            continue
        if check_complete(dst) is None:
            return dst
    return None


def run_copy(src: Path, dest: Path, tags: list[Path]) -> Path:
    """A run directory with what `src` was started with (its configs, policy_init) and copies of
    the checkpoints `tags`, oldest first (each keeps its save time: its completion marker)."""
    skip = {"checkpoints", "accounting", "tb", "eval", "learner_end.json"}
    shutil.copytree(src, dest, ignore=lambda d, names: [n for n in names if Path(d) == src and n in skip])
    for tag in tags:
        shutil.copytree(tag, dest / "checkpoints" / tag.name)
    return dest


def resume_other_shape(out: Path, run_dir: Path, ranks: int) -> Row:
    """--resume with policy.backbone.text_hidden_size doubled (a key that sets the policy's shape):
    refused before any rank starts, exit 2, one line naming the key and both values."""
    row, t0 = Row("resume with another shape", tried=1), time.time()
    key = "policy.backbone.text_hidden_size"
    old = int(next(o for o in SMALL_BACKBONE if o.startswith(f"{key}=")).split("=")[1])
    ports = run_ports()
    overrides = [o for o in side_overrides(out, "shape", ports, ranks) if not o.startswith(f"{key}=")]
    r = subprocess.run([sys.executable, "-m", "asyncvla.launch.cli", "train", CONFIG, *overrides, f"{key}={2 * old}",
                        "--resume", str(run_dir)], capture_output=True, text=True, timeout=120, cwd=REPO)
    row.exit_code, row.seconds = r.returncode, time.time() - t0
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    want = f"{key}={old} (this config: {2 * old})"
    if r.returncode != 2 or len(lines) != 1 or want not in lines[0]:
        row.problems.append(f"exit {r.returncode}, not one line naming {want!r}: {r.stderr[-300:]!r}")
    row.outcome = f"exit {r.returncode} in {row.seconds:.0f} s, one line: \"... trained with {want} ...\""
    return row


def older_tag_ctrl_c(out: Path, src: Path, older: Path, newer: Path, ranks: int) -> Row:
    """--resume RUN/checkpoints/step_E, the older of two complete checkpoints (step_F is newer),
    then Ctrl-C before the first update: exit 130, and the launcher names step_E, where the run's
    branch now stands, never step_F, which is kept aside (checkpoints/abandoned/): a later
    `--resume RUN` continues step_E."""
    from asyncvla.learner.checkpoint import find_latest

    row, t0 = Row("resume from an older tag, then Ctrl-C", tried=1), time.time()
    run_dir = run_copy(src, out / "older", [older, newer])
    resume_at = run_dir / "checkpoints" / older.name
    ports = run_ports()
    run = Run(out, "older", side_overrides(out, "older", ports, ranks), ports, ranks, resume=resume_at, label="resume")
    try:
        run.wait(lambda: "resumed from" in run.text(), PROGRESS_S + 60, "resume")
        run.proc.send_signal(signal.SIGINT)
        row.exit_code = run.proc.wait(timeout=STOP_GRACE_S + 30)
    except (Hang, subprocess.TimeoutExpired) as e:
        row.problems.append(f"hang: {e}")
    finally:
        run.close()
    row.seconds, text, step = time.time() - t0, run.text(), _tag_step(older)
    resumed = re.search(r"resumed from \S+ at step (\d+)", text)
    if resumed is None or int(resumed.group(1)) != step:
        row.problems.append(f"resumed at {resumed and resumed.group(1)}, not step {step}")
    said = [ln for ln in text.splitlines() if ln.startswith("asyncvla: stopped")]
    want = [f"asyncvla: stopped by SIGINT at update {step}; final checkpoint {resume_at}; it holds step {step}; "
            f"to continue, run the same command with --resume {run_dir}"]
    row.problems += _one_stop(run, row.exit_code, said, want) + _stopped_accounts(run, row)
    named = [ln for ln in text.splitlines() if ln.startswith("asyncvla:") and newer.name in ln]
    if named:
        row.problems.append(f"the launcher named the newer {newer.name}: {named[0]!r}")
    row.problems += run.last_words
    latest, aside = find_latest(run_dir), list((run_dir / "checkpoints" / "abandoned").glob(f"*/{newer.name}"))
    if latest != resume_at or not aside:
        row.problems.append(f"--resume RUN would continue {latest}; {newer.name} kept aside: {bool(aside)}")
    row.outcome = (f"resumed at step {step} ({older.name}; {newer.name} newer, now in checkpoints/abandoned), SIGINT: "
                   f"exit {row.exit_code}, the launcher named {older.name} (step {step})"
                   + (f" and {newer.name} {len(named)} times" if named else f", never {newer.name}"))
    return row


def nan_in_saved_ema(out: Path, src: Path, older: Path, newer: Path, ranks: int) -> Row:
    """The newer of two complete checkpoints with one float of its EMA weights set to NaN (a file
    whose size its marker vouches for: only its values are wrong): --resume stops before anything
    is resumed or served, exit non-zero, in one line naming the file and the newest earlier
    complete checkpoint."""
    row, t0 = Row("NaN in a saved EMA", tried=1), time.time()
    run_dir = run_copy(src, out / "nan_ema", [older, newer])
    path, tensor = poison_ema(run_dir / "checkpoints" / newer.name)
    ports = run_ports()
    run = Run(out, "nan_ema", side_overrides(out, "nan_ema", ports, ranks), ports, ranks, resume=True,
              label="resume")
    try:
        row.exit_code = run.proc.wait(timeout=PROGRESS_S + 60)
    except subprocess.TimeoutExpired:
        row.problems.append(f"hang: still running {PROGRESS_S + 60:.0f} s after the start")
    finally:
        run.close()
    row.seconds, text = time.time() - t0, run.text()
    lines = sorted({ln for ln in text.splitlines() if "holds NaN or inf" in ln})     # (one per rank)
    earlier = f"checkpoint.resume={run_dir / 'checkpoints' / older.name}"
    if row.exit_code in (0, None):
        row.problems.append(f"exit {row.exit_code}")
    if len(lines) != 1 or str(path) not in lines[0] or earlier not in lines[0]:
        row.problems.append(f"not one line naming {path.name} and {earlier}: {lines or text[-300:]!r}")
    if "resumed from" in text:
        row.problems.append("the run resumed from it (and served its weights)")
    if "Traceback" in text:
        row.problems.append("a traceback in the log")
    # The launcher's last words repeat the learner's advice: the earlier checkpoint, named to resume.
    advice = f"--resume {run_dir / 'checkpoints' / older.name}"
    last = [ln for ln in text.splitlines() if ln.startswith("asyncvla: the learner exited")]
    if len(last) != 1 or advice not in last[0] or newer.name in last[0]:
        row.problems.append(f"the launcher's last words {last} do not say {advice!r}")
    row.problems += run.last_words
    row.outcome = (f"EMA '{tensor}' NaN in {newer.name}/{path.name}: exit {row.exit_code}, one line naming the file "
                   f"and {older.name} to resume instead, which the launcher repeats ({advice.split('/')[-1]}); "
                   "nothing resumed or served")
    return row


def poison_ema(tag_dir: Path) -> tuple[Path, str]:
    """Set one float of the EMA weights in `tag_dir`'s rank-0 model-states file to NaN (re-saved
    with torch) and update its size in the completion marker. Returns the file and the tensor."""
    import torch

    from asyncvla.learner.checkpoint import CLIENT_KEY, MARKER, load_file

    path = sorted(tag_dir.glob("*mp_rank_00_model_states.pt"))[0]
    state = load_file(path)
    shadow = state[CLIENT_KEY]["ema"]["shadow"]
    name = next(k for k, v in shadow.items() if v.is_floating_point() and v.numel())
    shadow[name][(0,) * shadow[name].dim()] = float("nan")
    torch.save(state, path)
    marker = json.loads((tag_dir / MARKER).read_text())
    marker["files"][path.name] = path.stat().st_size
    (tag_dir / MARKER).write_text(json.dumps(marker))
    return path, name


def _tag_step(tag_dir: Path) -> int:
    return int(TAG_RE.match(tag_dir.name).group(1))


# ------------------------------------------------------------------------------ the actor side
ESCAPING_NAMES = ["../x", "a/../../x", "../../../../../../../../tmp/escaped", "/ABS/x", "a//b", "./x", "a/",
                  "a\\b", "..\\..\\x", "C:\\x", "x\x00y", "x\ny", "a/./b", "/".join("d" * 9), "y" * 256,
                  "a\u202eb", "\x1b[31mx", ".", ".."]
# (an empty name never reaches the check: the actor's decoder drops a reply with an unnamed array,
# and the actor asks again until fetch_policy_files times out)


def escaping_names(out: Path) -> Row:
    """A fake learner (a bare ROUTER) welcomes an actor and serves policy files whose names try to
    leave the actor's folder: in-process joins for each name, a pair "a" + "a/b" (a file where a
    folder must go), and the real `asyncvla actor` once. Problems (unauthorised): any file written
    anywhere, a join that goes on."""
    from asyncvla.actors.join import join
    from asyncvla.common.transport.sockets import TransportError
    from tests.support.sockets import FakeLearner, tcfg

    row = Row("fake learner: escaping file names")
    root = out / "escape"
    work = root / "work"
    work.mkdir(parents=True)
    t0 = time.time()
    cases = [{"policy.json": b"{}", name.replace("/ABS", str(root / "abs")): b"owned"} for name in ESCAPING_NAMES]
    cases.append({"policy.json": b"{}", "a": b"owned", "a/b": b"owned"})
    refused, kept_going = 0, []
    before = tempfile.tempdir
    tempfile.tempdir = str(work)
    try:
        for files in cases:
            learner = FakeLearner(files)
            try:
                join(learner.endpoint, "victim", tcfg(), threading.Event(), timeout=30)
                kept_going.append(list(files))
            except TransportError as e:
                refused += "refusing its files" in str(e) or "cannot write the learner's policy files" in str(e)
            finally:
                learner.close()
    finally:
        tempfile.tempdir = before
    learner = FakeLearner({"policy.json": b"{}", "../../../escaped-by-actor": b"owned"})
    try:
        proc = subprocess.run([sys.executable, "-m", "asyncvla.launch.cli", "actor", "--learner", learner.endpoint,
                               "--join-timeout", "60"], cwd=REPO, capture_output=True, text=True, timeout=180,
                              env=dict(os.environ, TMPDIR=str(work), PYTHONUNBUFFERED="1"))
    finally:
        learner.close()
    row.exit_code = proc.returncode
    actor_refused = proc.returncode == 1 and "refusing its files" in proc.stderr
    written = [str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir()]
    row.tried, row.seconds = len(cases) + 1, time.time() - t0
    row.unauthorised = len(written) + len(kept_going)
    if written:
        row.problems.append(f"files written: {written[:5]}")
    if kept_going:
        row.problems.append(f"joined despite names {kept_going[:3]}")
    if not actor_refused:
        row.problems.append(f"asyncvla actor: exit {proc.returncode}, {proc.stderr[-300:]!r}")
    row.outcome = (f"{refused}/{len(cases)} joins refused the files, `asyncvla actor` exit {proc.returncode} "
                   f"(refused); {len(written)} files written")
    return row


# ------------------------------------------------------------------- careless configs and disks
NONFINITE_KEYS = ("learner.lr=inf", "learner.adam_eps=nan", "learner.max_abs_reward=-inf", "learner.value_lr=nan")


def nonfinite_config() -> Row:
    """`asyncvla train` with a float key set to nan or inf: one line naming the key, exit 2, before
    any rank starts (learner.lr=inf used to publish NaN weights from version 1 and stall)."""
    row = Row("config: nan/inf values", tried=len(NONFINITE_KEYS))
    t0, codes = time.time(), []
    for key in NONFINITE_KEYS:
        r = subprocess.run([sys.executable, "-m", "asyncvla.launch.cli", "train", CONFIG, key,
                            "logging.output_dir=/nonexistent"], capture_output=True, text=True, timeout=120, cwd=REPO)
        codes.append(r.returncode)
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        if r.returncode != 2 or len(lines) != 1 or f"{key} is not allowed" not in lines[0]:
            row.problems.append(f"{key}: exit {r.returncode}, {r.stderr[-200:]!r}")
    row.exit_code = max(codes, key=abs)
    row.seconds = time.time() - t0
    row.outcome = f"each refused in one line naming the key; exit codes {codes}"
    return row


def _short_run(out: Path, name: str, overrides: list[str]) -> tuple[subprocess.CompletedProcess, str, Accounts | None]:
    """A 1-actor `asyncvla train` on the pixel task (tests/support/runs.py SMALL, no evaluator) to
    its end: the process, its output, its final accounting (None when it wrote none)."""
    r = train_pixel_task(out, name, [*SMALL, "launch.num_local_actors=1", "eval.eval_interval=0", *SMALL_BACKBONE,
                                     *overrides], timeout=300)
    records = _read_accounting(out / name, 1)
    return r, r.stdout + r.stderr, Accounts.of(records) if records else None


def diverging_run(out: Path) -> Row:
    """learner.lr=1e6 blows the weights up in an update or two; later losses are non-finite. Those
    optimizer steps are skipped and counted; the second in a row stops the run with one line naming
    the update, exit non-zero; the launcher names the newest complete checkpoint by the step it
    holds, whose weights and EMA are finite, or says there is none (the first update already broke
    the weights: then nothing was saved)."""
    import torch

    from asyncvla.learner import checkpoint as ck
    from asyncvla.learner.export import consolidate

    row, t0 = Row("diverging run (learner.lr=1e6)", tried=1), time.time()
    r, text, row.accounts = _short_run(out, "diverge", [
        "learner.lr=1e6", "learner.value_lr=1e6", "learner.max_steps=30", "learner.max_nonfinite_steps=2",
        "checkpoint.save_interval=1"])
    row.exit_code, row.seconds = r.returncode, time.time() - t0
    stops = [line for line in text.splitlines() if "stopped: update" in line]
    if r.returncode == 0:
        row.problems.append("exit 0")
    if len(stops) != 1 or "2 optimizer steps in a row were non-finite" not in stops[0] \
            or "learner.max_nonfinite_steps=2" not in stops[0]:
        row.problems.append(f"not one stop line naming the update and the key: {stops or text[-300:]!r}")
        return row
    stopped_at = int(stops[0].split("stopped: update ")[1].split(":")[0])
    if stopped_at > 10:
        row.problems.append(f"stopped only at update {stopped_at}")
    if row.accounts is None or row.accounts.nonfinite_steps < 2:
        row.problems.append("the accounting does not count the skipped steps")
    row.problems += named_as_recorded(out / "diverge", text)
    latest = ck.find_latest(out / "diverge")
    if latest is None:
        if "no checkpoint to resume from" not in text or \
                list((out / "diverge" / "checkpoints").glob("step_*")):
            row.problems.append("no checkpoint, yet the launcher did not say so or one was started")
        row.outcome = f"stopped at update {stopped_at} in one line; the first update broke the weights: nothing saved"
        return row
    step = ck.read_marker(latest)["step"]
    if step >= stopped_at or f"newest complete checkpoint: {latest}; it holds step {step};" not in text:
        row.problems.append(f"the launcher did not name {latest.name} (step {step})")
    finite = all(torch.isfinite(w).all() for w in consolidate(latest).values() if w.is_floating_point()) and \
        all(torch.isfinite(w).all() for w in ck.read_client_state(latest)["ema"]["shadow"].values())
    if not finite:
        row.problems.append(f"{latest.name} holds non-finite weights")
    row.outcome = f"stopped at update {stopped_at} in one line; newest checkpoint step {step}, its weights finite"
    return row


def unwritable_checkpoints(out: Path) -> Row:
    """Where RUN/checkpoints cannot be made (a regular file is in its way: that fails as root too),
    `asyncvla train` refuses before any process starts: exit 2, one line naming the path and the
    keys to change, nothing written in RUN."""
    row, t0 = Row("checkpoint folder not writable", tried=1), time.time()
    blocked = out / "blocked"
    blocked.mkdir(parents=True, exist_ok=True)
    (blocked / "checkpoints").write_text("not a folder")
    r, text, _ = _short_run(out, "blocked", ["learner.max_steps=2"])
    row.exit_code, row.seconds = r.returncode, time.time() - t0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    if r.returncode != 2 or len(lines) != 1:
        row.problems.append(f"exit {r.returncode}, {len(lines)} lines: {r.stderr[-300:]!r}")
    for said in (f"{blocked / 'checkpoints'} is a file, not a directory", "logging.output_dir"):
        if said not in text:
            row.problems.append(f"did not say {said!r}")
    if sorted(p.name for p in blocked.iterdir()) != ["checkpoints"]:
        row.problems.append(f"written meanwhile: {sorted(p.name for p in blocked.iterdir())}")
    row.outcome = (f"exit {r.returncode} after {row.seconds:.1f} s, before any process started, one line naming the "
                   "path and the key; nothing written")
    return row


def final_save_fails(out: Path) -> Row:
    """A final checkpoint that cannot be written (a file where its folder must go) makes the run
    exit non-zero; the launcher names the newest complete checkpoint and the step it holds, not
    the step the run stopped at (it used to say "final checkpoint" of a step 42 updates back)."""
    row, t0 = Row("final save fails", tried=1), time.time()
    ckpts = out / "final" / "checkpoints"
    ckpts.mkdir(parents=True, exist_ok=True)
    (ckpts / "step_00000003").write_text("in the way of the final save")
    r, text, row.accounts = _short_run(out, "final", ["learner.max_steps=3", "checkpoint.save_interval=2"])
    row.exit_code, row.seconds = r.returncode, time.time() - t0
    if r.returncode == 0:
        row.problems.append("exit 0")
    for said in ("stopped: the final checkpoint (update 3) could not be written", "File exists",
                 f"newest complete checkpoint: {ckpts / 'step_00000002'}; it holds step 2;"):
        if said not in text:
            row.problems.append(f"did not say {said!r}")
    if "Parent directory" in text:
        row.problems.append("torch's guess ('Parent directory ...') instead of the system's reason")
    row.problems += named_as_recorded(out / "final", text)
    if row.accounts is None or row.accounts.saves_failed != 1:
        row.problems.append("the accounting does not count the failed save")
    row.outcome = "exit non-zero; the launcher named step_00000002 (step 2), the newest complete checkpoint"
    return row


# ---------------------------------------------------------------------------------- the suite
@dataclass
class SuiteResult:
    rows: list
    sizes: Sizes
    seconds: float
    rss: dict
    no_disk: str | None

    @property
    def problems(self) -> list[str]:
        return [f"{r.fault}: {p}" for r in self.rows for p in r.problems]

    def row(self, fault: str) -> Row:
        return next(r for r in self.rows if r.fault.startswith(fault))

    def as_dict(self) -> dict:
        return {"sizes": self.sizes.__dict__, "seconds": round(self.seconds, 1), "rss": self.rss,
                "no_disk": self.no_disk, "rows": [r.as_dict() for r in self.rows]}


_STARTED = [time.time()]


def _say(text: str) -> None:
    print(f"[faults {time.time() - _STARTED[0]:5.0f} s] {text}", flush=True)


def _guarded(rows: list, fault: str, fn, *args):
    """Run one attack; an exception becomes a problem in its row (the suite goes on)."""
    t0 = time.time()
    try:
        result = fn(*args)
    except Exception as e:             # noqa: BLE001  (reported, not hidden)
        row = Row(fault, problems=[f"{type(e).__name__}: {e}"], seconds=time.time() - t0)
        rows.append(row)
        _say(f"{fault}: {type(e).__name__}: {e}")
        return None
    row = result[0] if isinstance(result, tuple) else result
    rows.append(row)
    _say(f"{row.fault}: tried {row.tried}, {row.skipped or row.outcome}"
         + (f"; PROBLEMS {row.problems}" if row.problems else ""))
    return result


def run_suite(out: Path, sizes: Sizes) -> SuiteResult:
    """Every attack, in the order of the module docstring, on one run and its resumptions."""
    t_start = _STARTED[0] = time.time()
    rng, prng = np.random.default_rng(sizes.seed), random.Random(sizes.seed)
    name, ports = "faults", run_ports()
    overrides = suite_overrides(out, name, ports, sizes)
    disk, no_disk = mount_small_disk(out / name / "checkpoints")
    rows: list[Row] = []
    runs: list[Run] = []
    rss: dict = {"bound_mb": sizes.rss_bound_mb}
    escaped: list[Row] = []
    kept: list = []
    escape = threading.Thread(target=_guarded, args=(escaped, "fake learner: escaping file names", escaping_names, out))
    registration = None
    try:
        run = Run(out, name, overrides, ports, sizes.ranks, label="a")
        runs.append(run)
        run.wait_step(SAVE_INTERVAL, timeout=300)          # started: its first checkpoint and accounting
        _say(f"run started, step {run.step()}")
        t_attacks = time.time()
        rss["before_mb"] = run.rss_mb(t_attacks - 3)
        registration = register(run, "fuzz-actor")
        maker = SegmentMaker(run, registration)
        real_ids = [f"local-{i}" for i in range(sizes.actors)] + run.evaluator_ids()
        _guarded(rows, "fuzz control port", fuzz, run, "control", sizes.fuzz_per_port, rng, None, real_ids)
        _guarded(rows, "hello without the join secret", no_secret, run, sizes.outsiders)
        _guarded(rows, "hello flood", hello_flood, run, sizes.hellos)
        _guarded(rows, "spoofed heartbeats/byes", spoofing, run, sizes.spoofs, rng, registration.token)
        got = _guarded(rows, "actor SIGTERM", actor_sigterm, run)
        _guarded(rows, "hello under a live actor's id", id_hijack, run, got[1] if got else None)
        _guarded(rows, "squatter on a killed actor's id", squatter, run)
        _guarded(rows, "fuzz weights port", fuzz, run, "weights", sizes.fuzz_per_port, rng, None, real_ids)
        _guarded(rows, "fuzz segment port", fuzz, run, "segment", sizes.fuzz_per_port, rng, maker, (),
                 sizes.valid_segments)
        _guarded(rows, "lying episode stats and seq", lying_segments, run, maker, sizes.lies, rng,
                 sizes.fuzz_per_port + sizes.valid_segments)
        registration.close()                 # (its bye: the kills and resumptions below see no fuzz actor)
        rss["after_fuzz_mb"] = run.rss_mb(time.time() - 3)
        _guarded(rows, "disk full during a save", disk_full, run, no_disk)
        _guarded(rows, "actor churn (SIGKILL)", actor_churn, run, sizes.churn_s, sizes.churn_every_s, prng)
        kept.append(keep_checkpoint(run, out / "kept"))     # for the resumptions after the run
        _guarded(rows, "learner starving", learner_starving, run)
        _guarded(rows, "evaluator SIGKILL", evaluator_sigkill, run)
        rss["max_mb"] = run.rss_mb(t_attacks)
        rows.append(_memory_row(rss))
        got = _guarded(rows, "launcher SIGINT", launcher_sigint, run, 0)
        final = got[1] if got else None
        kept.append(keep_checkpoint(run, out / "kept"))

        expect = final if final is not None else run.step()
        escape.start()                 # (on its own: it needs no run, and a run starting leaves time)
        run, problems = resume(out, name, overrides, ports, sizes.ranks, expect, "resume-0")
        runs.append(run)
        _say(f"resumed at step {expect}")
        rows[-1 if got is None else rows.index(got[0])].problems.extend(problems)
        if got is not None and not problems:
            got[0].outcome += f"; --resume continued from step {expect}"
        kills = []
        for k in range(sizes.learner_kills):
            start_step = expect
            got = _guarded(kills, "learner SIGKILL", learner_kill, run, k % 2 == 0, prng)
            if got is None:
                break
            row, expect, where = got
            row.fault = "learner SIGKILL during a save" if k % 2 == 0 else "learner SIGKILL at a random moment"
            if row.accounts is not None:
                row.problems += _final_accounting(row.accounts, None, start_step, sizes.ranks)
            run, problems = resume(out, name, overrides, ports, sizes.ranks, expect, f"resume-{k + 1}")
            runs.append(run)
            _say(f"resumed at step {expect}")
            row.problems += problems
            if not problems:
                row.outcome += f"; --resume continued from step {expect}"
        rows += _merge(kills)
        _guarded(rows, "launcher SIGKILL", launcher_sigkill, run)
    finally:
        if registration is not None:
            registration.close()
        for r in runs:
            r.close()
        unmount(disk)
    if escape.ident is None:           # the run ended before it was started
        escape.start()
    escape.join()
    rows += escaped
    rows += resumptions(out, out / name, kept, sizes.ranks)
    careless = out / "careless"
    _guarded(rows, "config: nan/inf values", nonfinite_config)
    _guarded(rows, "diverging run (learner.lr=1e6)", diverging_run, careless)
    _guarded(rows, "checkpoint folder not writable", unwritable_checkpoints, careless)
    _guarded(rows, "final save fails", final_save_fails, careless)
    rows.append(_crash_row(runs))
    return SuiteResult(rows, sizes, time.time() - t_start, rss, no_disk)


def resumptions(out: Path, run_dir: Path, kept: list, ranks: int) -> list[Row]:
    """The resumptions of copies of the run (its configs and two checkpoints it saved, kept: the
    older from before the launcher's SIGINT, the newer its final one), and a run stopped while it
    starts."""
    rows: list[Row] = []
    faults = ("resume with another shape", "resume from an older tag, then Ctrl-C", "NaN in a saved EMA")
    if len(kept) != 2 or None in kept or kept[0] == kept[1]:
        rows = [Row(f, problems=[f"no two checkpoints of the run kept: {kept}"]) for f in faults]
        _guarded(rows, "Ctrl-C during start-up", startup_ctrl_c, out, ranks)
        return rows
    older, newer = kept
    _guarded(rows, faults[0], resume_other_shape, out, run_copy(run_dir, out / "shape", [newer]), ranks)
    _concurrently(rows, (faults[1], older_tag_ctrl_c, out, run_dir, older, newer, ranks),
                  (faults[2], nan_in_saved_ema, out, run_dir, older, newer, ranks),
                  ("Ctrl-C during start-up", startup_ctrl_c, out, ranks),
                  ("huge flow chains (flow head)", huge_flow_chains, out))
    return rows


def _concurrently(rows: list, *attacks) -> None:
    """Attacks (fault, fn, *args) on runs of their own, each in a thread: a run that starts spends
    most of its time in one process's imports and set-up. Their rows in the order given."""
    got: list[list[Row]] = [[] for _ in attacks]
    threads = [threading.Thread(target=_guarded, args=(g, *a)) for g, a in zip(got, attacks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for g in got:
        rows.extend(g)


def _merge(kills: list[Row]) -> list[Row]:
    """One row per kind of learner kill, however many times it was tried."""
    out: dict[str, Row] = {}
    for r in kills:
        if r.fault not in out:
            out[r.fault] = r
            continue
        m = out[r.fault]
        m.tried += r.tried
        m.problems += r.problems
        m.seconds += r.seconds
        m.outcome += f" | {r.outcome}"
        m.accounts = r.accounts
    return list(out.values())


def _memory_row(rss: dict) -> Row:
    row = Row("learner memory (RSS, any rank)", tried=1)
    before, peak = rss.get("before_mb"), rss.get("max_mb")
    row.rss_mb = peak
    if before is None or peak is None:
        row.problems.append("no RSS samples")
        return row
    rss["growth_mb"] = peak - before
    row.outcome = (f"{before:.0f} MB before the attacks, at most {peak:.0f} MB during them "
                   f"(+{peak - before:.0f} MB; bound +{rss['bound_mb']:.0f} MB)")
    if peak - before > rss["bound_mb"]:
        row.problems.append(f"RSS grew by {peak - before:.0f} MB > {rss['bound_mb']:.0f} MB")
    return row


def _crash_row(runs: list[Run]) -> Row:
    row = Row("crashes (every run)", tried=len(runs))
    for r in runs:
        row.problems += r.crashes() + getattr(r, "last_words", [])
    row.outcome = "0 learner or actor crashes" if not row.problems else f"{len(row.problems)} found"
    return row
