"""Config schema: defaults, YAML + dotted overrides, and errors that name key, value and what is allowed."""

import subprocess
import sys

import pytest

from asyncvla.common.config import (Config, ConfigError, describe, from_dict, load_config, to_dict,
                                    to_yaml)
from tests.support.paths import QUICKSTART, REPO


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_defaults_and_override_order(tmp_path):
    p = write(tmp_path, "actor:\n  num_envs: 3\npolicy:\n  backbone:\n    text_layers: 2\n")
    cfg = load_config(p, ["actor.num_envs=4", "learner.lr=3e-4"])
    assert isinstance(cfg, Config)
    assert cfg.actor.num_envs == 4            # override wins over YAML
    assert cfg.policy.backbone.text_layers == 2
    assert cfg.learner.lr == pytest.approx(3e-4)
    assert cfg.algorithm.reward_type == "chunk_level"


@pytest.mark.parametrize("text, override, words", [
    ("actor:\n  num_env: 3\n", None, ["actor.num_env", "did you mean 'actor.num_envs'", "allowed keys"]),
    ("bogus: 1\n", None, ["'bogus'", "allowed keys"]),
    (None, "actor.num_envs=abc", ["actor.num_envs", "'abc'", "int"]),
    (None, "actor.num_envs=0", ["actor.num_envs=0", ">= 1"]),
    (None, "algorithm.reward_type=per_token", ["algorithm.reward_type='per_token'", "chunk_level", "action_level"]),
    (None, "learner.rollout_ema_decay=1.0", ["learner.rollout_ema_decay=1.0", "< 1"]),
    (None, "learner.min_lr=1e-3", ["learner.min_lr=0.001", "learner.lr=0.0001", "only lowers"]),
    (None, "learner.lr_decay_style=cosine", ["learner.lr_decay_style='cosine'", "constant", "linear"]),
    (None, "algorithm.clip_ratio_c=0.5", ["algorithm.clip_ratio_c=0.5", "> 1"]),
    (None, "actor.num_envs", ["key=value"]),
    (None, "policy.action_low=[-1,0]", ["policy.action_low=[-1.0, 0.0]", "policy.action_dim=7"]),
    (None, "policy.action_high=[2.0]", ["policy.action_high=[2.0]", "[-1, 1]"]),
    (None, "policy.action_low=[1.0]", ["policy.action_low=[1.0]", "low < high"]),
    (None, "env.camera_pose=[0.5,0,0.35]", ["env.camera_pose=[0.5, 0.0, 0.35]", "6 finite values"]),
    (None, "env.camera_pose=[0.5,0,nan,0,0,0]", ["env.camera_pose=", "6 finite values"]),
    (None, "env.camera_pose=[1,2,3,1,2,3]", ["env.camera_pose=[1.0, 2.0, 3.0, 1.0, 2.0, 3.0]", "same point"]),
    (None, "env.camera_fov=4", ["env.camera_fov=4", "< 3.14"]),
    (None, "env.render_size=8", ["env.render_size=8", ">= 16"]),
    (None, "policy.cnn_image_tokens=9", ["policy.cnn_image_tokens=9", "[0, 1, 4, 16, 64]"]),
    (None, "policy.backbone.vocab_size=300", ["policy.backbone.vocab_size=300", "44 text ids",
                                              "policy.n_bins=256", ">= 359"]),
])
def test_errors_name_key_value_and_allowed(tmp_path, text, override, words):
    path = write(tmp_path, text) if text else None
    with pytest.raises(ConfigError) as e:
        load_config(path, [override] if override else [])
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("override", ["learner.lr=inf", "learner.adam_eps=nan", "learner.max_abs_reward=inf",
                                      "learner.max_time_s=inf", "env.sim_latency_ms=-inf", "algorithm.gamma=nan"])
def test_float_keys_refuse_nan_and_inf(override):
    """nan passes every range check and inf a one-sided one (learner.lr > 0): the schema refuses both."""
    key, value = override.split("=")
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert f"{key}={value}" in str(e.value) and "finite" in str(e.value), str(e.value)


def test_no_float_key_takes_nan_or_inf_from_yaml_or_a_received_config(tmp_path):
    with pytest.raises(ConfigError, match=r"learner.value_lr=nan.*finite"):
        load_config(write(tmp_path, "learner:\n  value_lr: .nan\n"))
    floats = [(section, name) for section, fields in to_dict(Config()).items() if isinstance(fields, dict)
              for name, v in fields.items() if isinstance(v, float)]
    assert len(floats) > 20
    for section, name in floats:
        for bad in (float("nan"), float("inf")):
            data = to_dict(Config())
            data[section][name] = bad
            with pytest.raises(ConfigError, match=f"{section}.{name}="):
                from_dict(data)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "actor: [1,\n"))
    # A syntax error is one line naming the file, the line and column, and what the parser found
    # (PyYAML's own text takes four lines).
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "env:\n  id: PushCube-v1\n  bad: [1, 2\nlearner:\n  lr: 1\n"))
    assert "\n" not in str(e.value), str(e.value)
    assert "c.yaml' is not valid YAML: line 4, column 8: did not find expected ',' or ']'" in str(e.value)
    with pytest.raises(ConfigError, match="mapping"):
        load_config(write(tmp_path, "- 1\n- 2\n"))


def test_dict_round_trip_is_validated():
    cfg = load_config(None, ["env.id=PixelReach-v0", "policy.action_dim=2"])
    again = from_dict(to_dict(cfg))
    assert again == cfg
    bad = to_dict(cfg)
    bad["actor"]["num_envs"] = -1
    with pytest.raises(ConfigError, match="actor.num_envs"):
        from_dict(bad)
    assert "PixelReach-v0" in to_yaml(cfg)


def test_configs_saved_with_retired_keys_still_load(tmp_path):
    """Run directories and checkpoints of older versions hold keys that are gone (RETIRED_KEYS)."""
    old = to_dict(load_config(None))
    old["logging"]["log_interval_s"] = 5.0
    assert from_dict(old) == load_config(None)
    assert load_config(write(tmp_path, "logging:\n  log_interval_s: 5.0\n")) == load_config(None)
    with pytest.raises(ConfigError, match="logging.log_every"):          # an unknown key still is an error
        load_config(write(tmp_path, "logging:\n  log_every: 5.0\n"))


def test_a_renamed_key_is_read_as_its_new_name_for_one_release_with_one_warning(tmp_path, caplog):
    """RENAMED_KEYS: env.replay_failed_starts became env.retry_failed_starts; files, overrides and
    saved configs (a run directory, a checkpoint) with the old name still load, each saying so."""
    want = load_config(None, ["env.retry_failed_starts=0.25"])
    with caplog.at_level("WARNING", logger="asyncvla.config"):
        assert load_config(None, ["env.replay_failed_starts=0.25"]) == want
        assert load_config(write(tmp_path, "env:\n  replay_failed_starts: 0.25\n")) == want
        old = to_dict(want)
        old["env"]["replay_failed_starts"] = old["env"].pop("retry_failed_starts")
        assert from_dict(old) == want
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3 and all("'env.replay_failed_starts' is deprecated" in m and "'env.retry_failed_starts'" in m
                                  and "\n" not in m for m in said), said
    with caplog.at_level("WARNING", logger="asyncvla.config"):
        assert load_config(None, ["transport.trajectory_port=6000"]).transport.segment_port == 6000
    with pytest.raises(ConfigError, match="both 'env.replay_failed_starts' and 'env.retry_failed_starts' are set"):
        load_config(write(tmp_path, "env:\n  replay_failed_starts: 0.25\n  retry_failed_starts: 0.5\n"))


def test_every_field_is_documented():
    text = describe()
    for line in text.splitlines()[1::2]:
        assert line.strip(), "a field without a help string"
    assert "actor.num_envs = 2" in text


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_shipped_configs_validate(name):
    cfg = load_config(REPO / "configs" / name)
    # Each states its task's episode limit: a learner bounds the episode lengths actors report by
    # it (without one only by protocol.MAX_EPISODE_STEPS, 2^24).
    assert cfg.env.max_episode_steps is not None, name


def test_cli_unknown_key_exits_nonzero(tmp_path):
    p = write(tmp_path, "transport:\n  contrl_port: 1\n")
    r = subprocess.run([sys.executable, "-m", "asyncvla.launch.cli", "config", str(p)],
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert "transport.contrl_port" in r.stderr
    ok = subprocess.run([sys.executable, "-m", "asyncvla.launch.cli", "config", str(QUICKSTART),
                         "actor.num_envs=3"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "num_envs: 3" in ok.stdout


def test_gpu_config_builds_a_smolvlm_256m_shaped_policy():
    """configs/maniskill_gpu.yaml: its backbone has SmolVLM-256M's shape (~0.26 B parameters), built
    on the meta device (no memory), and the policy's image size suits its 16 px patches."""
    import torch
    from transformers import Idefics3ForConditionalGeneration

    from asyncvla.common.policy.backbone import build_tiny_tokenizer, tiny_backbone_config

    cfg = load_config(REPO / "configs" / "maniskill_gpu.yaml")
    p = cfg.policy
    config = tiny_backbone_config(p.backbone, p.image_size, build_tiny_tokenizer(p.backbone.vocab_size - p.n_bins))
    with torch.device("meta"):
        model = Idefics3ForConditionalGeneration(config)
    params = sum(t.numel() for t in model.parameters())
    assert 0.24e9 < params < 0.29e9, params
    assert cfg.env.sim_backend == "physx_cpu" and cfg.env.render_backend == "gpu"
    assert cfg.actor.device == "cuda" and p.is_lora and p.action_head == "parallel"


def test_overrides_may_follow_options():
    from asyncvla.launch.cli import parse

    args = parse(["train", "configs/pixel_task.yaml", "actor.num_envs=4", "--sync", "learner.max_steps=9"])
    assert args.overrides == ["actor.num_envs=4", "learner.max_steps=9"] and args.sync
    with pytest.raises(SystemExit):
        parse(["train", "configs/pixel_task.yaml", "--no-such-flag"])
    with pytest.raises(SystemExit):
        parse(["keygen", "keys", "learner.max_steps=9"])        # keygen takes no overrides


def test_the_tiny_vocabulary_check_matches_the_tokenizer_it_guards():
    """Config refuses a vocab_size whose text part the tiny tokenizer could not be built in, and only
    such: TINY_TEXT_IDS_MIN is what the most demanding family needs, one id less fails."""
    from asyncvla.common.config import TINY_TEXT_IDS_MIN, BackboneConfig
    from asyncvla.common.policy.backbone import build_tiny_tokenizer
    from asyncvla.common.policy.families import family_by_name

    families = [family_by_name(name) for name in BackboneConfig.__dataclass_fields__["family"].metadata["choices"]]
    for family in families:
        assert len(build_tiny_tokenizer(TINY_TEXT_IDS_MIN, family)) == TINY_TEXT_IDS_MIN
    neediest = max(families, key=lambda f: len(f.special_tokens))
    with pytest.raises(ValueError, match=f"at least {TINY_TEXT_IDS_MIN} text ids"):
        build_tiny_tokenizer(TINY_TEXT_IDS_MIN - 1, neediest)
    load_config(None, ["policy.n_bins=256", f"policy.backbone.vocab_size={256 + TINY_TEXT_IDS_MIN}"])
    load_config(None, ["policy.backbone.vocab_size=300", "policy.pretrained_path=/models/vlm"])
