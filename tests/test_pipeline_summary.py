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
