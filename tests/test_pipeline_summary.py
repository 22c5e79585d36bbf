"""The lines `asyncvla pipeline` (`make train`) ends with: the tensorboard command must show SFT's
run and RL's run both, as tensorboard itself reads it (it keeps only the last of several --logdir
flags)."""

import shlex

from tensorboard import program
from tensorboard.backend.event_processing import io_wrapper
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from asyncvla.launch.pipeline import format_final


def test_the_tensorboard_command_shows_every_run(tmp_path):
    run = tmp_path / "my run"                       # a space: the path must reach tensorboard whole
    log_dirs = [run / "sft" / "tb", run / "tb"]      # as final_summary lists them
    for d in log_dirs:
        EventFileWriter(str(d)).close()
    result = {"success_rate": 0.5, "ci95": [0.3, 0.7]}
    summary = {"env_id": "PixelReach-v0", "episodes": 8, "sft": {"steps": 10, **result},
               "rl": {"updates": 4, **result}, "tensorboard": [str(d) for d in log_dirs]}
    [line] = [line for line in format_final(summary).splitlines() if "tensorboard" in line]
    argv = shlex.split(line)
    assert argv[0] == "tensorboard", line
    tensorboard = program.TensorBoard()
    tensorboard.configure(argv=argv)                 # tensorboard's own flag parsing
    runs = set(io_wrapper.GetLogdirSubdirectories(tensorboard.flags.logdir))
    assert runs == {str(d) for d in log_dirs}, line


def test_with_several_tasks_each_tasks_figure_comes_before_their_mean():
    def result(p):
        return {"success_rate": p, "ci95": [p - 0.1, p + 0.1]}
    tasks = {"PushCube-v1": result(0.9), "PickCube-v1": result(0.3)}
    summary = {"env_id": "PushCube-v1,PickCube-v1", "episodes": 8, "tensorboard": ["runs/x/tb"],
               "sft": {"steps": 10, **result(0.5), "tasks": tasks},
               "rl": {"updates": 4, **result(0.6), "tasks": tasks}}
    lines = format_final(summary).splitlines()
    assert "8 fixed episodes per task" in lines[0]
    after_rl = [x for x in lines if "after RL" in x]
    assert [x.split(":")[1].split()[0] for x in after_rl] == ["PushCube-v1", "PickCube-v1", "mean"]
    assert "90.0%" in after_rl[0] and "60.0%" in after_rl[2] and len([x for x in lines if "after SFT" in x]) == 3
