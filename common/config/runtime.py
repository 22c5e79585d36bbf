"""The sections of a run's processes: actor, transport, logging, checkpoint and eval."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from .fields import opt


@dataclass
class ActorConfig:
    num_envs: int = opt(2, "environments per actor process", ge=1)
    rollout_length: int = opt(16, "policy steps T per segment", ge=1)
    device: str = opt("cpu", "torch device of the actor's policy copy (cpu, cuda, cuda:1, ...)")
    backpressure: str = opt("block", "when the learner is slow: block the actor, or drop its oldest "
                            "unsent segment (counted)", choices=["block", "drop_oldest"])
    max_segments_in_flight: Optional[int] = opt(
        None, "block mode: segments sent but not yet taken by the learner, beyond which the actor "
        "waits before collecting another; each queued segment adds a version of policy lag "
        "(null: this actor's share of one update, as in --sync; 0: no limit)", ge=0)
    seed: int = opt(0, "base seed of the action sampler", ge=0)


@dataclass
class TransportConfig:
    bind_host: str = opt("127.0.0.1", "interface the learner binds; a public one needs CURVE keys "
                         "or allow_insecure_public_bind")
    advertise_host: Optional[str] = opt(None, "address actors should connect to (null: bind_host, or "
                                        "this host's name when binding 0.0.0.0)")
    control_port: int = opt(5555, "learner rank 0 control (ROUTER) port", ge=1, le=65535)
    weights_port: int = opt(5556, "learner rank 0 weight-server port", ge=1, le=65535)
    segment_port: int = opt(5560, "learner rank r pulls segments on segment_port + r",
                               ge=1, le=65535)
    send_hwm: int = opt(4, "segments queued per actor before backpressure", ge=1)
    recv_hwm: int = opt(8, "segments queued per learner rank before actors are pushed back", ge=1)
    max_message_mb: int = opt(512, "largest accepted message (all frames), MiB", ge=1)
    reuse_receive_buffers: bool = opt(True, "learner ranks keep freed memory mapped (glibc) so ZeroMQ reuses "
                                      "it for the next segments instead of faulting in fresh pages (up to "
                                      "~1 ms per 8 MB segment); a rank may then hold up to 256 MiB it freed")
    heartbeat_interval_s: float = opt(1.0, "seconds between heartbeats", gt=0.0)
    heartbeat_timeout_s: float = opt(10.0, "an actor (or the learner) silent this long is gone", gt=0.0)
    keys_dir: Optional[str] = opt(None, "CURVE keys directory made by `asyncvla keygen`; null: no "
                                  "encryption (loopback only unless allow_insecure_public_bind)")
    allow_insecure_public_bind: bool = opt(False, "allow binding a non-loopback interface without CURVE")
    linger_ms: int = opt(1000, "at close, wait at most this long for queued messages to leave", ge=0)
    reconnect_max_s: float = opt(5.0, "longest back-off between attempts to reach a learner that is gone",
                                 gt=0.0)


@dataclass
class LoggingConfig:
    output_dir: str = opt("runs", "root of run directories")
    experiment_name: str = opt("asyncvla", "run directory name under output_dir")
    progress: bool = opt(True, "show a console progress line")
    level: str = opt("INFO", "log level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    backends: List[str] = opt(["tensorboard"], "metric backends (common/trackers.py): tensorboard (RUN/tb), "
                              "wandb, swanlab (optional extras: pip install -e .[wandb] / .[swanlab])",
                              choices=["tensorboard", "wandb", "swanlab"])
    project: str = opt("asyncvla", "wandb / swanlab project")
    tracker_mode: str = opt("online", "wandb / swanlab: online (uploads; needs a key) or offline (local files "
                            "under the run directory, uploaded later with `wandb sync` / `swanlab sync`)",
                            choices=["online", "offline"])


@dataclass
class CheckpointConfig:
    save_interval: int = opt(50, "save a DeepSpeed checkpoint every this many updates (0: only at the end)",
                             ge=0)
    keep_last: int = opt(3, "keep this many most recent checkpoints", ge=1)
    resume: Optional[str] = opt(None, "a run directory (its latest complete checkpoint) or a checkpoint "
                                "directory to continue from")


@dataclass
class EvalConfig:
    eval_interval: int = opt(0, "evaluate every this many updates (0 disables)", ge=0)
    num_episodes: int = opt(8, "episodes per evaluation", ge=1)
    save_video: bool = opt(True, "write mp4 videos of evaluation episodes")
    greedy: bool = opt(True, "evaluate with the most likely action tokens")
    num_envs: int = opt(8, "envs stepped together, in rounds; the initial states depend on it, so compare "
                        "evaluations made with the same value (a ManiSkill CPU env is a process that "
                        "takes ~15 s of a core to start)", ge=1)
    final_eval_timeout_s: float = opt(300.0, "how long `asyncvla train` waits for the evaluation of "
                                      "the last step after the learner ends", ge=0.0)
