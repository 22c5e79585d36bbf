"""A learner with no data says so: one line per interval while no segment arrives; rank 0 keeps
the list of registered actors where the launcher can read it (`Roster`), and, with
learner.min_actors, waits for that many to join before its first update (`wait_for_actors`).

An actor that stops sending (it hung, was stopped, lost its network, or every actor refuses the
weights it is served) leaves the learner waiting in `Inbox.fill` without a word. This watch,
called from the inbox's watchdog, logs once per `learner.starvation_timeout_s` of silence, naming
the actors this rank last heard from and how long ago, and on rank 0 how many are registered.
"""

from __future__ import annotations

import logging
import time

from asyncvla.common.transport.control import EVALUATOR_PREFIX
from asyncvla.common.rundir import write_actors
from asyncvla.common.transport.sockets import printable

log = logging.getLogger("asyncvla.learner")
MAX_NAMED = 5                  # actors named in one line (the most recently heard first)


class StarvationWatch:
    def __init__(self, timeout_s: float, rank: int, registry=None, clock=time.monotonic):
        """`timeout_s` 0 turns the watch off; `registry()` (rank 0) gives the control server's
        counts (`alive`: actors registered now)."""
        self.timeout_s, self.rank, self.registry, self.clock = timeout_s, rank, registry, clock
        self.last_segment = self.next_line = clock()
        self.heard: dict[str, float] = {}        # actor id -> when its last segment arrived
        self.next_line += timeout_s
        self.lines = 0                           # lines logged (for tests)

    def restart(self) -> None:
        """Count the silence from now: the learner was not yet waiting for data (learner.min_actors)."""
        self.last_segment = self.clock()
        self.next_line = self.last_segment + self.timeout_s

    def fed(self, actor_id: str) -> None:
        now = self.clock()
        self.heard.pop(actor_id, None)           # (re-inserted last: the dict stays oldest-first)
        self.heard[actor_id] = self.last_segment = now
        self.next_line = now + self.timeout_s

    def check(self) -> str | None:
        """Log and return the line when one is due, else None."""
        now = self.clock()
        if not self.timeout_s or now < self.next_line:
            return None
        self.next_line = now + self.timeout_s
        line = self.describe(now)
        log.warning("%s", line)
        self.lines += 1
        return line

    def describe(self, now: float) -> str:
        silent = now - self.last_segment
        if self.heard:
            recent = list(self.heard.items())[::-1][:MAX_NAMED]
            heard = "last heard from " + ", ".join(f"{printable(a)} ({now - t:.0f} s ago)" for a, t in recent)
            heard += f" and {len(self.heard) - MAX_NAMED} more" if len(self.heard) > MAX_NAMED else ""
        else:
            heard = "no actor has sent one yet"
        registered = "" if self.registry is None else f"; {self.registry()['alive']} actor(s) registered"
        return (f"rank {self.rank}: no segment for {silent:.0f} s (learner.starvation_timeout_s="
                f"{self.timeout_s:g}); {heard}{registered}; training waits for data")


class Roster:
    """Rank 0 keeps RUN/actors.json to the actor ids registered now (rewritten when they change):
    a launcher whose local actors have all ended reads it to tell whether remote actors still feed
    the learner, or whether the run must stop."""

    def __init__(self, run_dir, actor_ids):
        self.run_dir, self.actor_ids = run_dir, actor_ids
        self.written: list[str] | None = None

    def update(self) -> None:
        ids = self.actor_ids()
        if ids == self.written:
            return
        try:
            write_actors(self.run_dir, ids)
        except OSError as e:
            if self.written is None:      # (once: the launcher then counts no remote actor)
                log.warning("the list of registered actors was not written: %s", e)
        self.written = ids


def wait_for_actors(wanted: int, actor_ids, stop, repeat_s: float = 30.0, poll_s: float = 0.2,
                    clock=time.monotonic) -> int:
    """Block until `actor_ids()` (the ids registered now) holds `wanted` actors, the evaluator not
    counted, or `stop` is set; say so when waiting starts and every `repeat_s`. Returns how many
    had joined. Without it a fleet's first host to join trains the learner alone, and a budget
    short enough can be spent before the others join: they then wait for a learner that is gone."""
    def joined() -> list[str]:
        return [a for a in actor_ids() if not a.startswith(EVALUATOR_PREFIX)]
    ids, started = joined(), clock()
    if len(ids) >= wanted:
        return len(ids)
    log.info("waiting for %d actors to join before the first update (learner.min_actors); %d so far", wanted, len(ids))
    next_line = started + repeat_s
    while len(ids) < wanted and not stop.is_set():
        if clock() >= next_line:
            log.info("still waiting for actors: %d of learner.min_actors=%d joined after %.0f s%s", len(ids), wanted,
                     clock() - started, (": " + ", ".join(printable(a) for a in ids[:MAX_NAMED])) if ids else "")
            next_line += repeat_s
        stop.wait(poll_s)
        ids = joined()
    if len(ids) >= wanted:
        log.info("%d actors joined after %.0f s; training starts", len(ids), clock() - started)
    return len(ids)
