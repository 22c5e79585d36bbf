import os

# Keep torch/numpy from oversubscribing the two cores of a CI machine when tests spawn processes.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
