"""Control channel: actors join learner rank 0, which tells them everything they need.

    contract.py   what both ends agree on: time-outs, the welcome's keys, policy file names
    server.py     the learner's ControlServer and its Registry of live actors
    client.py     the actor's LearnerClient, a small state machine (ClientState)


    actor  -> hello {actor_id, host, pid, num_envs}   learner -> welcome {...welcome_fn(hello)...,
                                                                heartbeat_interval_s, heartbeat_timeout_s,
                                                                token}
    actor  -> heartbeat {actor_id, token}  (every interval)   learner -> heartbeat  (or "rejoin" if
                                                                it does not know the actor, e.g. after
                                                                a restart)
    actor  -> get_policy_files {actor_id, token}      learner -> policy_files (one frame per file)
    actor  -> bye {actor_id, token}                   learner -> shutdown (at the end of training;
                                                                the actor answers bye: an evaluator
                                                                once it holds the last weights, and
                                                                it heartbeats until then)

The learner's ControlServer keeps a `Registry` of live actors (joins, leaves, time-outs), each
held by the connection it joined on until that connection is gone, and bound to the CURVE key it
joined with; the token in the welcome admits the actor to the other requests and channels
(common/transport/auth.py). The actor's LearnerClient re-sends hello with back-off when the learner goes
silent for heartbeat_timeout_s and rejoins when it is back (a restarted learner has new ROUTER
identities and an empty registry; its "rejoin" answer to a heartbeat makes the actor say hello
again). Until the first welcome it warns every so often, with what to check.
"""

from .client import ClientState, LearnerClient
from .contract import (BYE_HOLD_MAX_S, EVALUATOR_PREFIX, ID_WAIT_S, LAUNCHED_WARN_S, NO_ANSWER_WARN_S,
                       policy_file_parts)
from .server import ControlServer, Registry

__all__ = ["BYE_HOLD_MAX_S", "EVALUATOR_PREFIX", "ID_WAIT_S", "LAUNCHED_WARN_S", "NO_ANSWER_WARN_S", "ClientState",
           "ControlServer", "LearnerClient", "Registry", "policy_file_parts"]
