"""What many test files share, so that no test file imports another:

    paths.py        the repository's root and the configs tests run
    segments.py     segment specs and segments as actors build them (for any action head)
    wire.py         editing messages as they travel, for tests that build bad ones
    sockets.py      transport settings, a fake learner, raw sends, waiting on a condition
    runs.py         small runs of the real commands: configs, processes, logs, tensorboard figures
    engines.py      real DeepSpeed ranks of tests/ds_worker.py, each in its own process
    checkpoints.py  checkpoint tag folders made by hand
    ports.py        ports for a test's run, free on this machine and on no other xdist worker's list
"""
