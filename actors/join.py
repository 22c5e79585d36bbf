"""Joining a learner: what an actor and an evaluator both do before their own loop.

    joined = join(endpoint, actor_id, tcfg, stop)   # hello -> welcome, policy, weight subscriber
    joined.cfg, joined.policy, joined.weights, joined.welcome["rollout"], ...
    joined.close()                                   # bye, sockets closed

The welcome carries the learner's config (this node keeps its own envs, device and keys), the
policy directory (read from the learner's path when this node sees it, else its files fetched
once) and the weights endpoint; and this actor's token, which its other requests and segments
carry (`joined.client.token`, renewed when it rejoins a restarted learner).
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from asyncvla.common import transport
from asyncvla.common.config import Config, from_dict
from asyncvla.common.transport.control import policy_file_parts
from asyncvla.common.policy import VLAPolicy, load_policy


@dataclass
class Joined:
    client: transport.LearnerClient
    welcome: dict
    cfg: Config
    policy: VLAPolicy
    weights: transport.WeightSubscriber

    def close(self) -> None:
        self.weights.close()
        self.client.close()


def join(learner: str, actor_id: str, tcfg, stop, num_envs: int | None = None,
         device: str | None = None, timeout: float | None = None, join_secret: str | None = None,
         defer_bye: bool = False) -> Joined | None:
    """Join the learner at `learner` (its control endpoint), with the run's `join_secret` where it
    has no CURVE keys; None if `stop` or the end of training came first (`defer_bye`: see
    LearnerClient). Without a welcome within
    `timeout` seconds (None: keep trying), raises TransportError saying what to check."""
    client = transport.LearnerClient(learner, actor_id, tcfg, num_envs=num_envs or 0, join_secret=join_secret,
                                     defer_bye=defer_bye)
    try:
        welcome = client.join(timeout=timeout, stop=stop)
        if welcome is None:
            if timeout is not None and not stop.is_set() and not client.finished:
                raise transport.TransportError(client.no_answer(timeout))
            client.close()
            return None
        cfg: Config = from_dict(welcome["config"])
        # This node's settings over the learner's: envs, device, and keys (a property of the node).
        cfg.actor.num_envs = num_envs or cfg.actor.num_envs
        cfg.actor.device = device or cfg.actor.device
        cfg.transport.keys_dir = tcfg.keys_dir
        policy_dir, tmp = _policy_dir(welcome["policy"], client)
        try:
            policy = load_policy(policy_dir, device=cfg.actor.device)
        finally:
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
        weights = transport.WeightSubscriber(welcome["weights_endpoint"], cfg.transport, actor_id=actor_id,
                                             token=lambda: client.token)
    except BaseException:
        client.close()
        raise
    return Joined(client, welcome, cfg, policy, weights)


def _policy_dir(spec: dict, client) -> tuple[str, str | None]:
    """The policy directory: the learner's path if readable here, else its files fetched once
    (returned with the temporary folder to delete once loaded). `fetch_policy_files` refuses
    names that would land outside the folder."""
    path = spec.get("path")
    if path and (Path(path) / "policy.json").exists():
        return path, None
    files = client.fetch_policy_files()
    tmp = tempfile.mkdtemp(prefix="asyncvla-policy-")
    try:
        for name, data in files.items():
            target = Path(tmp, *policy_file_parts(name))
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "xb") as f:        # x: never through a file or link already there
                f.write(data)
    except OSError as e:                         # e.g. both "a" and "a/b"
        shutil.rmtree(tmp, ignore_errors=True)
        raise transport.TransportError(f"cannot write the learner's policy files: {e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp, tmp
