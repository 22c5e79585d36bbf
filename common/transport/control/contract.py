"""What the control channel's two ends agree on: their timings, the welcome's keys, and the
names policy files may have."""

from __future__ import annotations

import math

from asyncvla.common.transport.protocol import ValidationError

BACKOFF_MIN_S = 0.1
ID_WAIT_S = 60.0              # a first hello refused as id_taken is said again for this long
POLL_MS = 50
WELCOME_KEYS = {"config": dict, "segment_endpoints": list, "weights_endpoint": str,
                "weight_version": int, "policy": dict, "rollout": dict, "token": str}
NO_ANSWER_WARN_S = 5.0        # an actor waiting this long for its welcome says why it may be
NO_ANSWER_REPEAT_S = 30.0     # ... and again this often while it keeps trying
# Actors and the evaluator that `asyncvla train` starts come up beside a learner that takes tens
# of seconds to start (DeepSpeed on a CPU): their first warning waits longer.
LAUNCHED_WARN_S = 120.0
MAX_PATH_PARTS = 8            # policy files lie at most this deep in the policy directory
# At the end of training an evaluator answers "shutdown" only once its weight subscriber holds the
# last version (the weights travel on their own channel, which closes after the byes). It waits
# at most BYE_HOLD_MAX_S; the learner waits a little longer for a client that still heartbeats.
BYE_HOLD_MAX_S = 30.0
BYE_HOLD_BEAT_S = 0.5         # ... heartbeating this often while it holds its bye
BYE_WAIT_MAX_S = BYE_HOLD_MAX_S + 10.0
# An evaluator joins like an actor, under an id that starts so; it sends no segment, and counts
# neither among the actors a learner waits for (learner.min_actors) nor among a run's remote ones.
EVALUATOR_PREFIX = "evaluator-"



def check_welcome(meta: dict) -> None:
    """Raise ValidationError("bad_welcome") unless the welcome holds what a client acts on."""
    for key, typ in WELCOME_KEYS.items():
        if not isinstance(meta.get(key), typ) or isinstance(meta.get(key), bool):
            raise ValidationError("bad_welcome", f"welcome '{key}' must be a {typ.__name__}")
    if not all(isinstance(e, str) for e in meta["segment_endpoints"]) or not meta["segment_endpoints"]:
        raise ValidationError("bad_welcome", "welcome 'segment_endpoints' must be a non-empty list "
                                             "of strings")
    for key in ("heartbeat_interval_s", "heartbeat_timeout_s"):      # the client thread times with them
        value = meta.get(key, 1.0)
        if type(value) not in (int, float) or not 0 < value < math.inf:
            raise ValidationError("bad_welcome", f"welcome '{key}' must be a positive number")


def policy_file_parts(name: str) -> list[str]:
    """The parts of a policy file's name as the learner sent it: a relative path of plain names
    (the policy directory holds backbone/ and adapter/), so that the file lands inside the actor's
    folder. Raises ValueError saying what is wrong: an absolute path, an empty part, '.' or '..',
    a backslash, NUL or another control character, a part over 255 bytes, or too deep a path."""
    parts = name.split("/")
    if len(parts) > MAX_PATH_PARTS:
        raise ValueError(f"more than {MAX_PATH_PARTS} levels deep")
    for part in parts:
        if part in ("", ".", ".."):
            raise ValueError("not a relative path of plain names (an absolute path, an empty part, "
                             "'.' or '..')")
        if "\\" in part or not part.isprintable():
            raise ValueError("a backslash, NUL or other control character")
        if len(part.encode()) > 255:
            raise ValueError("a part longer than 255 bytes")
    return parts
