"""`asyncvla export` and `asyncvla eval` on real parts: a checkpoint written by 2 DeepSpeed ZeRO-3
ranks (gloo on CPU, tests/ds_worker.py `policy`: a tiny VLA trained a few updates with EMA
publishing, saved with learner/checkpoint/), the pixel task, mp4 files decoded with imageio, and
the CLI in a child process for the error cases."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import imageio.v2 as imageio
import numpy as np
import pytest
import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from asyncvla.actors.envs import make_env
from asyncvla.actors.envs import pixel_task as P
from asyncvla.actors.evaluate import evaluate_policy, round_seed, wilson_interval
from asyncvla.common.config import EnvConfig, from_dict, load_config
from asyncvla.common.policy import VLAPolicy
from asyncvla.launch import cli
from asyncvla.learner import checkpoint

from tests import ds_worker as W
from tests.support.engines import launch
from tests.support.paths import REPO


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A run directory with policy_init/ and one complete 2-rank ZeRO-3 checkpoint."""
    out = tmp_path_factory.mktemp("ds")
    recs = launch("policy", out, 2, timeout=300)
    assert recs[0]["partitioned"] and recs[1]["partitioned"]        # every tensor was sharded
    tag = Path(recs[0]["tag_dir"])
    assert checkpoint.read_marker(tag)["world_size"] == 2
    assert {f.name for f in tag.glob("zero_pp_rank_*_optim_states.pt")} == {
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)}
    return out / "policy" / "run", tag, recs[0]


def fixed_inputs(policy):
    """The ranks' training inputs (where the trained weights act differently from the initial
    ones) and a few unseen ones."""
    parts = [W.policy_batch(policy, r)[:3] for r in (0, 1)]
    image = np.random.default_rng(7).integers(0, 256, (4, 64, 64, 3), dtype=np.uint8)
    parts.append((image, *policy.tokenize(["move the white dot to the green square", "go left"] * 2)))
    return tuple(np.concatenate(column) for column in zip(*parts))


def greedy(policy, inputs):
    return policy.act(*inputs, greedy=True)


def test_export_of_a_two_rank_zero3_checkpoint_acts_like_the_learner(trained_run, tmp_path):
    run, tag, rec = trained_run
    # The learner's policy: the config's policy with every weight consolidated from both ranks.
    cfg = from_dict(checkpoint.read_client_state(tag)["config"])
    learner = VLAPolicy.build(cfg.policy)
    learner.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(str(tag.parent), tag=tag.name))
    for k, v in rec["trained"].items():                   # = what the live engine gathered
        torch.testing.assert_close(learner.trainable_state_dict()[k], v, rtol=0, atol=0)
    inputs = fixed_inputs(learner)
    ref = greedy(learner, inputs)
    init = greedy(VLAPolicy.from_pretrained(str(run / "policy_init")), inputs)
    assert (init.replay["action_tokens"] != ref.replay["action_tokens"]).any()   # training moved the greedy actions

    merged = tmp_path / "merged"
    assert cli.main(["export", str(run), "--out", str(merged), "--state-dict"]) == 0
    assert json.loads((merged / "export.json").read_text())["lora"] == "merged"
    assert not (merged / "adapter").exists()
    exported = VLAPolicy.from_pretrained(str(merged))
    assert not exported.cfg.is_lora
    out = greedy(exported, inputs)
    np.testing.assert_array_equal(out.replay["action_tokens"], ref.replay["action_tokens"])
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-4)
    np.testing.assert_allclose(out.values, ref.values, atol=1e-5)
    assert load_config(merged / "config.yaml").env.id == "PixelReach-v0"

    # The plain state dict: a policy built from the recorded config alone takes it as it is.
    pt = torch.load(merged / "policy_state_dict.pt", weights_only=False)
    deployed = VLAPolicy.build(from_dict({"policy": pt["policy"]["policy"]}).policy)
    deployed.load_state_dict(pt["state_dict"])
    np.testing.assert_array_equal(greedy(deployed, inputs).replay["action_tokens"], ref.replay["action_tokens"])

    # --keep-lora --weights ema: the base backbone + a peft adapter holding the published weights.
    adapter = tmp_path / "adapter"
    assert cli.main(["export", str(tag), "--out", str(adapter), "--keep-lora", "--weights", "ema"]) == 0
    ema = VLAPolicy.from_pretrained(str(adapter))
    assert ema.cfg.is_lora and (adapter / "adapter" / "adapter_model.safetensors").is_file()
    published = ema.trainable_state_dict()
    assert published.keys() == rec["ema"].keys()
    for k, v in rec["ema"].items():
        torch.testing.assert_close(published[k], v, rtol=0, atol=0)
    assert any(not torch.equal(rec["ema"][k], rec["trained"][k]) for k in rec["ema"])


def bc_fit_on_eval_states(policy, episodes: int, seed: int, steps: int = 200) -> None:
    """Behaviour cloning of the oracle (scripted_actions) on the very states the evaluation below
    visits: its fixed initial states, followed with the oracle's actions at bin centres (so a policy
    that reproduces the tokens replays those states exactly). A memorised policy, not a general one."""
    env = make_env(EnvConfig(id="PixelReach-v0", auto_reset=False), episodes, 64, 4, "chunk_level", seed,
                   action_dim=2, purpose="evaluate")
    obs = env.reset(seed=round_seed(seed, 0))
    texts = list(env.instructions)
    images, tokens, instr, active = [], [], [], np.ones(episodes, bool)
    while active.any():
        tok = policy.action_tokenizer.encode(P.scripted_actions(env, 4, 2).reshape(episodes, -1))
        idx = np.flatnonzero(active)
        images.append(obs["image"][idx])
        tokens.append(tok[idx])
        instr += [texts[i] for i in idx]
        step = env.step_chunk(policy.action_tokenizer.decode(tok).reshape(episodes, 4, 2))
        active[[e["env"] for e in step.episodes]] = False
        obs = step.obs
    images, tokens = np.concatenate(images), np.concatenate(tokens)
    ids, mask = policy.tokenize(instr)
    opt = torch.optim.Adam(policy.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = -policy.evaluate(images, ids, mask, None, {"action_tokens": tokens}).logprobs.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_eval_on_the_pixel_task_writes_summary_and_videos(tmp_path):
    """Random init vs the same network behaviour-cloned on the oracle's actions from the fixed
    initial states this evaluation uses. The clone only memorised those states, so this shows that
    evaluation starts both policies from the same states and tells the one that reaches the target
    from the one that does not, not that cloning generalises."""
    cfg = load_config(None, W.POLICY_OVERRIDES + ["policy.is_lora=false"])
    episodes, seed = 8, 0
    init = VLAPolicy.build(cfg.policy)
    init.save_pretrained(str(tmp_path / "init"))
    bc_fit_on_eval_states(init, episodes, seed)
    init.save_pretrained(str(tmp_path / "trained"))

    summaries = {}
    for name in ("init", "trained"):
        video, out = tmp_path / f"video_{name}", tmp_path / f"{name}.json"
        assert cli.main(["eval", str(tmp_path / name), "--env", "PixelReach-v0", "--episodes", str(episodes),
                         "--seed", str(seed), "--video", str(video), "--out", str(out)]) == 0
        summaries[name] = s = json.loads(out.read_text())
        assert s["num_episodes"] == len(s["episodes"]) == episodes and s["greedy"]
        wins = sum(e["success"] for e in s["episodes"])
        assert s["success_rate"] == wins / episodes and s["success_ci95"] == wilson_interval(wins, episodes)
        assert s["length_mean"] == pytest.approx(np.mean([e["length"] for e in s["episodes"]]))
        for e in s["episodes"]:           # the first frame, then one per action chunk of the episode
            reader = imageio.get_reader(str(video / e["video"]))
            assert reader.count_frames() == 1 + math.ceil(e["length"] / cfg.policy.num_action_chunks)
            assert reader.get_data(0).shape[1] >= 256
            reader.close()
    init_s, trained_s = summaries["init"], summaries["trained"]
    assert [e["instruction"] for e in init_s["episodes"]] == [e["instruction"] for e in trained_s["episodes"]]
    first = [imageio.get_reader(str(tmp_path / f"video_{n}" / "episode_0000.mp4")).get_data(0).astype(int)
             for n in summaries]
    assert np.abs(first[0] - first[1]).mean() < 1.0                 # the same initial scene
    assert trained_s["success_rate"] > init_s["success_rate"], (init_s, trained_s)
    assert trained_s["success_rate"] >= 0.75
    # A config that trains with ignore_terminations still evaluates episodes that end at success:
    # the same successes and lengths as the CLI's default env config above.
    trained = VLAPolicy.from_pretrained(str(tmp_path / "trained"))
    ignoring = evaluate_policy(trained, EnvConfig(id="PixelReach-v0", ignore_terminations=True), trained.cfg,
                               episodes, greedy=True, seed=seed)
    assert [(e["success"], e["length"]) for e in ignoring["episodes"]] == [
        (e["success"], e["length"]) for e in trained_s["episodes"]]


def test_eval_of_a_checkpoint_with_ema_weights(trained_run, tmp_path):
    run, tag, _ = trained_run
    out = tmp_path / "s.json"
    assert cli.main(["eval", str(run), "--episodes", "2", "--weights", "ema", "--sample", "--temperature", "0.25",
                     "--out", str(out)]) == 0
    s = json.loads(out.read_text())
    assert s["policy"] == {"kind": "checkpoint", "path": str(tag), "step": W.POLICY_UPDATES,
                           "version": W.POLICY_UPDATES, "weights": "ema"}
    assert s["env_id"] == "PixelReach-v0" and not s["greedy"] and s["num_episodes"] == 2
    assert s["temperature"] == 0.25                               # how this evaluation sampled
    assert cli.main(["eval", str(run), "--temperature", "0"]) == 2


def test_an_evaluator_that_joins_after_the_learner_finished_evaluates_its_final_checkpoint(trained_run, tmp_path):
    """launch/evaluator.py: no learner answers, and the end record says the run finished by its
    budget at the checkpoint: the evaluator evaluates that checkpoint's published (EMA) weights,
    as `asyncvla eval --weights ema` does, at its step; after a stop it evaluates nothing."""
    from asyncvla.common.rundir import write_end
    from tests.support.ports import free_ports

    run, tag, _ = trained_run
    finished, stopped = tmp_path / "finished", tmp_path / "stopped"
    for d in (finished, stopped):
        d.mkdir()
    write_end(finished, "budget", W.POLICY_UPDATES, tag, W.POLICY_UPDATES)
    write_end(stopped, "stopped", W.POLICY_UPDATES, tag, W.POLICY_UPDATES)
    procs = {d: subprocess.Popen([sys.executable, "-m", "asyncvla.launch.evaluator", "--run-dir", str(d),
                                  "--learner", f"tcp://127.0.0.1:{port}"],      # nothing listens there
                                 cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for d, port in zip((finished, stopped), free_ports(2))}
    said = {d: proc.communicate(timeout=300)[0] for d, proc in procs.items()}
    assert [proc.returncode for proc in procs.values()] == [0, 0], said
    assert f"finished at step {W.POLICY_UPDATES} before this evaluator joined" in said[finished]
    summary = json.loads((finished / "eval" / f"step_{W.POLICY_UPDATES:08d}" / "summary.json").read_text())
    assert summary["step"] == W.POLICY_UPDATES
    assert (finished / "tb").is_dir()
    reference = tmp_path / "ema.json"
    assert cli.main(["eval", str(tag), "--weights", "ema", "--out", str(reference)]) == 0
    reference = json.loads(reference.read_text())
    assert summary["num_episodes"] == reference["num_episodes"]
    assert summary["return_mean"] == pytest.approx(reference["return_mean"])
    assert "ended (stopped) before this evaluator joined; nothing to evaluate" in said[stopped]
    assert not (stopped / "eval").exists()


def test_bad_checkpoints_give_one_line_errors(trained_run, tmp_path):
    run, tag, _ = trained_run
    empty = tmp_path / "not_a_run"
    empty.mkdir()
    (empty / "notes.txt").write_text("hello")
    unmarked = tmp_path / "unmarked" / "checkpoints" / tag.name
    shutil.copytree(tag, unmarked)
    (unmarked / checkpoint.MARKER).unlink()
    truncated = tmp_path / "truncated" / "checkpoints" / tag.name
    shutil.copytree(tag, truncated)
    shard = truncated / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[:1000])
    garbled = tmp_path / "garbled" / "checkpoints" / tag.name       # right sizes, wrong bytes
    shutil.copytree(tag, garbled)
    shard = garbled / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.write_bytes(bytes(shard.stat().st_size))
    cases = {
        ("eval", tmp_path / "missing"): "does not exist",
        ("eval", empty): "no checkpoints under",
        ("eval", unmarked): f"no completion marker {checkpoint.MARKER}",
        ("export", truncated.parents[1], "--out", tmp_path / "x"): "1000 bytes",
        ("export", garbled, "--out", tmp_path / "y"): "could not be consolidated",
    }
    procs = {args: subprocess.Popen([sys.executable, "-m", "asyncvla.launch.cli", *map(str, args)], cwd=REPO,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for args in cases}                                   # all at once: each mostly imports
    for args, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=180)
        err = stderr.strip().splitlines()
        assert proc.returncode == 2, (args, stdout, stderr)
        assert "Traceback" not in stderr and err and cases[args] in err[-1], (args, stderr)
        assert str(args[1]) in err[-1], err[-1]                 # names the path it could not use
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_periodic_eval_logs_to_tensorboard_and_the_run_dir(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from asyncvla.actors.evaluate import periodic_eval

    cfg = load_config(None, W.POLICY_OVERRIDES + ["eval.num_episodes=3", "eval.num_envs=2"])
    writer = SummaryWriter(str(tmp_path / "tb"))
    summary = periodic_eval(VLAPolicy.build(cfg.policy), cfg, 20, tmp_path, writer)
    writer.close()
    assert summary["num_envs"] == 2 and [e["env"] for e in summary["episodes"]] == [0, 1, 0]   # two rounds
    out = tmp_path / "eval" / "step_00000020"
    assert json.loads((out / "summary.json").read_text())["success_rate"] == summary["success_rate"]
    assert sorted(p.name for p in out.glob("*.mp4")) == [f"episode_{i:04d}.mp4" for i in range(3)]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    logged = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert logged == {"eval/success_rate": [(20, pytest.approx(summary["success_rate"]))],
                      "eval/return": [(20, pytest.approx(summary["return_mean"]))],
                      "eval/length": [(20, pytest.approx(summary["length_mean"]))]}


def test_the_progress_line_shows_the_evaluators_newest_figure(tmp_path):
    from asyncvla.learner.metrics import Metrics
    m = Metrics(None, 10, False, eval_dir=tmp_path / "eval")
    assert m._latest_eval() is None                          # no evaluation yet
    for step, rate in ((4, 0.25), (12, 0.5)):
        d = tmp_path / "eval" / f"step_{step:08d}"
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"step": step, "success_rate": rate}))
    m._eval_seen = None                                       # as after the 5 s between globs
    assert m._latest_eval() == "50%@12"


def test_evaluations_run_on_one_torch_thread_and_give_the_callers_back():
    """SFT evaluates between its steps: the evaluation runs one thread (two wait on each other
    beside a busy core), and SFT's own count comes back, also after an error."""
    from asyncvla.actors.evaluate import one_torch_thread

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with one_torch_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), one_torch_thread():
            raise RuntimeError("an evaluation that fails")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
