"""The learner's DeepSpeed pieces on real ZeRO-3 ranks (gloo on CPU).

tests/ds_worker.py runs each rank in its own process (so no process group lives in the test
session): `train` (2 ranks) takes five updates beside an un-sharded reference, gathers and EMAs
after each, and checkpoints at updates 2, 3, 4 with keep_last=2; `resume` (2 fresh ranks) loads
the newest checkpoint and redoes update 5; `errors` (1 rank, no launcher environment) meets a
missing, damaged, interrupted and wrong-world-size checkpoint, and round-trips a bf16 one.
The test model: a frozen Linear base, a low-rank adapter and a "value_head" submodule.
"""

import time
from pathlib import Path

import pytest
import torch

from asyncvla.common.config import Config
from asyncvla.learner import engine as ds_engine

from tests import ds_worker as W
from tests.support.engines import DIST_VARS, launch


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ds")
    t0 = time.perf_counter()
    train = launch("train", out, 2)
    t1 = time.perf_counter()
    resume = launch("resume", out, 2)
    t2 = time.perf_counter()
    errors = launch("errors", out, 0)
    t3 = time.perf_counter()
    r0 = train[0]
    print(f"\nwall: train {t1 - t0:.1f} s, resume {t2 - t1:.1f} s, errors {t3 - t2:.1f} s; "
          f"gather {[round(t['gather_s'] * 1e3, 1) for t in r0['timings']]} ms, "
          f"ema {[round(t['ema_s'] * 1e3, 2) for t in r0['timings']]} ms, "
          f"save {[round(s * 1e3, 1) for s in r0['save_s']]} ms")
    return {"out": out, "train": train, "resume": resume, "errors": errors[0]}


def _trainable_names():
    return sorted(n for n, p in W.TinyAdapterModel().named_parameters() if p.requires_grad)


# ------------------------------------------------------------------------- configuration (no ranks)
def test_ds_config_follows_the_learner_config():
    cfg = Config()
    cfg.learner.micro_batch_size, cfg.learner.clip_grad, cfg.learner.zero_stage = 8, 0.5, 2
    ds = ds_engine.build_ds_config(ds_engine.EngineSpec.rl(cfg), world_size=4, gradient_accumulation_steps=3)
    assert ds["train_micro_batch_size_per_gpu"] == 8 and ds["gradient_accumulation_steps"] == 3
    assert ds["train_batch_size"] == 8 * 3 * 4
    assert ds["zero_optimization"]["stage"] == 2 and ds["gradient_clipping"] == 0.5
    opt = ds["optimizer"]
    assert opt["type"] == "AdamW" and opt["params"]["torch_adam"] is True
    assert opt["params"]["lr"] == cfg.learner.lr and opt["params"]["eps"] == cfg.learner.adam_eps
    assert ds["bf16"]["enabled"] is torch.cuda.is_available()          # precision 'auto'
    cfg.learner.precision = "bf16"
    assert ds_engine.build_ds_config(ds_engine.EngineSpec.rl(cfg), 1)["bf16"]["enabled"] is True
    assert ds_engine.build_ds_config(ds_engine.EngineSpec.rl(Config()), 1)["zero_optimization"]["stage"] == 3


def test_param_groups_leave_out_frozen_and_split_the_value_head():
    model = W.TinyAdapterModel()
    names = {id(p): n for n, p in model.named_parameters()}
    groups = ds_engine.param_groups(model, lr=1e-4, value_lr=1e-3)
    assert [(g["name"], g["lr"]) for g in groups] == [("policy", 1e-4), ("value_head", 1e-3)]
    assert sorted(names[id(p)] for p in groups[0]["params"]) == ["adapter.a", "adapter.b"]
    assert all(names[id(p)].startswith("value_head.") for p in groups[1]["params"])
    model.value_head.requires_grad_(False)
    assert [g["name"] for g in ds_engine.param_groups(model, 1e-4, 1e-3)] == ["policy"]
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        ds_engine.param_groups(model, 1e-4, 1e-3)


def test_warmup_ramps_linearly_then_holds():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [p], "lr": 1.0}, {"params": [], "lr": 10.0}])
    sched = ds_engine.warmup_schedule(4)(opt)
    seen = []
    for _ in range(6):
        seen.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    assert seen == [[k / 4, 10 * k / 4] for k in (1, 2, 3)] + [[1.0, 10.0]] * 3
    opt = torch.optim.SGD([p], lr=1.0)
    ds_engine.warmup_schedule(0)(opt)
    assert opt.param_groups[0]["lr"] == 1.0


def test_critic_warmup_holds_the_policy_group_then_ramps_it():
    p, v = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [p], "lr": 1.0, "name": "policy"},
                           {"params": [v], "lr": 10.0, "name": "value_head"}])
    sched = ds_engine.warmup_schedule(2, critic_warmup_steps=3)(opt)
    seen = []
    for _ in range(7):
        seen.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    # the value head ramps from update 1; the policy holds 0 for 3 updates, then ramps
    assert seen == [[0.0, 5.0], [0.0, 10.0], [0.0, 10.0], [0.5, 10.0], [1.0, 10.0], [1.0, 10.0], [1.0, 10.0]]


def test_warmups_count_learner_updates_not_optimizer_steps():
    # an update of 2 epochs x 2 minibatches steps the optimizer (and the schedule) 4 times
    p, v = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [p], "lr": 1.0, "name": "policy"},
                           {"params": [v], "lr": 1.0, "name": "value_head"}])
    sched = ds_engine.warmup_schedule(2, critic_warmup_steps=1, steps_per_update=4)(opt)
    seen = []
    for _ in range(16):
        seen.append(tuple(g["lr"] for g in opt.param_groups))
        opt.step()
        sched.step()
    assert seen == [(0.0, 0.5)] * 4 + [(0.5, 1.0)] * 4 + [(1.0, 1.0)] * 8


def test_linear_decay_lowers_the_policy_lr_to_its_floor_and_holds_it():
    p, v = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [p], "lr": 1.0, "name": "policy"},
                           {"params": [v], "lr": 10.0, "name": "value_head"}])
    sched = ds_engine.warmup_schedule(0, critic_warmup_steps=1, steps_per_update=2,
                                      decay_iters=4, min_lr_fraction=0.2)(opt)
    seen = []
    for _ in range(14):
        seen.append(tuple(round(g["lr"], 6) for g in opt.param_groups))
        opt.step()
        sched.step()
    # update k (0-based) at 1 - 0.8 * min(1, k / 4), after one update of critic warm-up; the value
    # head keeps its lr
    policy = [0.0, 0.8, 0.6, 0.4, 0.2, 0.2, 0.2]
    assert seen == [(lr, 10.0) for lr in policy for _ in range(2)]


def test_the_configured_decay_spans_max_steps_unless_told():
    p = torch.nn.Parameter(torch.zeros(1))

    def lrs(**learner):
        cfg = Config()
        for k, val in learner.items():
            setattr(cfg.learner, k, val)
        cfg.algorithm.update_epochs, cfg.algorithm.num_minibatches = 1, 1
        opt = torch.optim.SGD([{"params": [p], "lr": cfg.learner.lr, "name": "policy"}])
        sched = ds_engine.lr_schedule(ds_engine.EngineSpec.rl(cfg))(opt)
        out = []
        for _ in range(6):
            out.append(opt.param_groups[0]["lr"] / cfg.learner.lr)
            opt.step()
            sched.step()
        return [round(x, 6) for x in out]

    assert lrs() == [1.0] * 6
    assert lrs(lr_decay_style="linear", max_steps=4) == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    assert lrs(lr_decay_style="linear", max_steps=100, lr_decay_iters=2, lr=1e-4, min_lr=5e-5) == \
        [1.0, 0.75, 0.5, 0.5, 0.5, 0.5]


def test_incomplete_launcher_environment_is_refused(monkeypatch):
    for k in DIST_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        ds_engine.init_distributed(Config())


# ------------------------------------------------------------------------------ two ZeRO-3 ranks
def test_ranks_start_without_compiling_any_op(runs):
    # DeepSpeed's CPU shm all-reduce op took minutes to compile under a lock that a killed rank leaves
    # behind (every later start then waits on it); the ranks ran here on an empty extensions dir.
    built = runs["out"] / "torch_extensions"
    assert not built.exists() or not any(built.iterdir()), sorted(p.name for p in built.iterdir())


def test_zero3_updates_match_an_unsharded_reference(runs):
    r0 = runs["train"][0]
    assert r0["partitioned"], "ZeRO-3 did not partition the parameters"
    assert r0["group_names"] == ["policy", "value_head"]
    for k, (got, ref) in enumerate(zip(r0["gathered"], r0["ref"])):
        assert sorted(got) == _trainable_names()
        for name in got:
            assert got[name].dtype == torch.float32 and got[name].shape == ref[name].shape
            assert torch.allclose(got[name], ref[name], rtol=0, atol=1e-6), (k, name)
    assert all(torch.equal(r0["gathered"][0][n], r0["ref"][0][n]) for n in r0["gathered"][0])


def test_an_update_changes_only_trainable_parameters(runs):
    r0 = runs["train"][0]
    before, after = r0["initial_all"], r0["final_all"]
    trainable = set(_trainable_names())
    for name in before:
        changed = not torch.equal(before[name], after[name])
        assert changed == (name in trainable), name
        assert torch.equal(before[name], r0["ref_all"][name])


def test_value_head_group_runs_at_its_own_lr(runs):
    r0 = runs["train"][0]
    lr, value_lr = 1e-3, 1e-2
    ramp = [min(1.0, k / W.WARMUP) for k in range(1, W.LAST + 1)]
    assert [g["policy"] for g in r0["lrs"]] == pytest.approx([lr * f for f in ramp])
    assert [g["value_head"] for g in r0["lrs"]] == pytest.approx([value_lr * f for f in ramp])
    # Adam's first step moves each weight by ~lr (m/sqrt(v) = ±1): the size of the step shows
    # which learning rate a parameter actually got.
    g0, g1 = r0["gathered"][0], r0["gathered"][1]
    for name in g0:
        step = (g1[name] - g0[name]).abs().median().item()
        expected = (value_lr if name.startswith("value_head") else lr) * ramp[0]
        assert 0.9 < step / expected < 1.05, (name, step, expected)


def test_gather_ships_full_tensors_from_rank0_only(runs):
    r0, r1 = runs["train"]
    assert all(g is None for g in r1["gathered"])
    shapes = {n: tuple(p.shape) for n, p in W.TinyAdapterModel().named_parameters()}
    got = {n: tuple(t.shape) for n, t in r0["gathered"][0].items()}
    assert got == {n: shapes[n] for n in _trainable_names()}


def test_finite_check_reads_each_partition_without_its_padding(runs):
    r0, r1 = runs["train"]
    assert any(r1["padding"].values())             # an odd-sized parameter ends rank 1 in padding
    assert r0["finite_despite_nan_padding"] and r1["finite_despite_nan_padding"]
    for name in _trainable_names():                # the two ranks' real parts are the whole tensor
        whole = torch.cat([r0["local_parts"][name], r1["local_parts"][name]])
        assert torch.equal(whole, r0["ref_all"][name].flatten()), name


def test_ema_of_published_weights(runs):
    r0 = runs["train"][0]
    gathered, pub0, pub5 = r0["gathered"], r0["pub0"], r0["pub5"]
    for g, p in zip(gathered, pub0):                           # d = 0: the learner's weights
        assert all(torch.equal(g[n], p[n]) for n in g)
    for name in gathered[0]:                                   # d = 0.5, by hand
        expected = gathered[0][name].clone()
        assert torch.equal(pub5[0][name], expected)
        for k in (1, 2):
            expected = 0.5 * expected + 0.5 * gathered[k][name]
            assert torch.allclose(pub5[k][name], expected, rtol=0, atol=1e-7), (k, name)
        assert not torch.equal(pub5[2][name], gathered[2][name])


def test_checkpoints_prune_and_point_at_the_newest_complete(runs):
    r0 = runs["train"][0]
    assert [r0["saves"][k]["tags_after"] for k in W.SAVE_AT] == [
        ["step_00000002"], ["step_00000002", "step_00000003"], ["step_00000003", "step_00000004"]]
    root = runs["out"] / "train" / "run" / "checkpoints"
    assert (root / "latest_complete").read_text() == "step_00000004"
    assert (root / "latest").read_text() == "step_00000004"       # DeepSpeed's, written by us after
    assert sorted(p.name for p in (root / "step_00000004").iterdir()) == [
        "COMPLETE.json", "zero_pp_rank_0_mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt"]


def test_fresh_run_resumes_exactly(runs):
    t0, _ = runs["train"]
    for rank, rec in enumerate(runs["resume"]):
        assert Path(rec["found"]).name == "step_00000004"
        state = rec["state"]
        assert sorted(state) == ["config", "ema", "env_steps", "rng", "step", "version"]   # no DeepSpeed keys
        assert (state["step"], state["version"], state["env_steps"]) == (4, 4, 4000)
        assert state["config"]["learner"]["rollout_ema_decay"] == 0.5
        train = runs["train"][rank]
        draws = train["saves"][4]["rng_draws"]          # drawn right after the state was captured
        assert torch.equal(rec["rng_draws"]["torch"], draws["torch"])
        assert (rec["rng_draws"]["numpy"] == draws["numpy"]).all()
        assert rec["rng_draws"]["python"] == draws["python"]
        assert rec["lr_after_load"]["policy"] == pytest.approx(1e-3 * 5 / W.WARMUP)   # mid-ramp
    r0 = runs["resume"][0]
    # Weights bit-equal to those saved; the next update (optimizer + LR state restored) too.
    assert all(torch.equal(r0["loaded"][n], t0["gathered"][4][n]) for n in t0["gathered"][4])
    assert all(torch.equal(r0["next"][n], t0["gathered"][5][n]) for n in t0["gathered"][5])
    assert all(torch.equal(r0["ema_shadow"][n], t0["pub5"][4][n]) for n in t0["pub5"][4])
    assert runs["resume"][1]["state"]["ema"] is None and runs["resume"][1]["loaded"] is None


def test_unusable_checkpoints_give_clear_errors(runs):
    e = runs["errors"]["errors"]
    assert "does not exist" in e["missing"]
    assert "written by 2 learner ranks but this run has 1" in e["world_size"]
    assert "launch.num_learner_ranks=2" in e["world_size"] and "zero_to_fp32.py" in e["world_size"]
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt is missing" in e["damaged"]
    assert "no complete checkpoint" in e["damaged_run"]
    assert "no completion marker" in e["interrupted"]
    assert "build a fresh engine" in e["after_save"]
    assert not any("Traceback" in m for m in e.values())


def test_collective_timeout_comes_from_the_config(runs):
    timeout = runs["errors"]["timeout"]
    if timeout is None:
        pytest.skip("this torch version hides the process group's time-out")
    assert timeout.total_seconds() == 77 * 60


def test_bf16_checkpoint_round_trip(runs):
    b = runs["errors"]["bf16"]
    assert b["dtype"] == "torch.bfloat16" and b["equal"] and b["state"] == {"step": 1}
    assert "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt" in b["files"]
