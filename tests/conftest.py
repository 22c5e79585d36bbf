import os

# Keep torch/numpy from oversubscribing the two cores of a CI machine when tests spawn processes.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The files that take minutes (2 cores, quiet), longest first. `make test` hands whole files to two
# workers (pytest-xdist --dist loadfile) in collection order, so these start first and the many
# short files fill in behind them: both workers then finish at about the same time.
SLOW_FILES = ["test_learning.py",             # ~5 min: SFT then RL must beat the warm start
              "test_faults.py",               # ~4.5 min: the fault suite, one run under attack
              "test_pipeline_maniskill.py",   # ~4 min: demos, SFT, RL, Ctrl-C, resume on ManiSkill
              "test_shutdown.py",             # ~2.5 min
              "test_e2e.py",                  # ~2 min
              "test_fleet.py",
              "test_families.py",
              "test_e2e_system.py",
              "test_multinode.py"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))   # stable: the rest keep their order
