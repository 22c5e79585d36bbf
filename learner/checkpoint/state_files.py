"""Reading a checkpoint's state files without trusting them. State files are read with
torch.load(weights_only=True): a checkpoint that holds an arbitrary pickled object (which could run
code when unpickled) is refused. The recorded config is read without torch and without importing
anything the file names (`recorded_config`)."""

from __future__ import annotations

import importlib
import io
import pickle
import zipfile
from pathlib import Path

import numpy as np

from .layout import CLIENT_KEY, CheckpointError, first_line
from .resume import resolve

# Globals a state file may name beyond tensors and plain containers: DeepSpeed's optimizer shards
# hold its loss scaler, ZeRO stage and (ZeRO-1/2) fragment addresses; RNG states of older
# checkpoints hold numpy arrays. A DeepSpeed version that writes more needs them added here.
SAFE_GLOBALS = frozenset({
    "deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum", "deepspeed.utils.tensor_fragment.fragment_address",
    "numpy.core.multiarray._reconstruct", "numpy.ndarray", "numpy.dtype"})


def recorded_config(ckpt_dir) -> dict | None:
    """The config recorded in the client_state of a complete checkpoint (None: none recorded), read
    without torch and without importing anything the file names: a state file is a zip whose
    data.pkl holds its objects, and only plain containers and values are rebuilt from it (see
    _Skeleton). Raises CheckpointError like `load`."""
    path = rank0_states(resolve(ckpt_dir))
    try:
        with zipfile.ZipFile(path) as z:
            pkl = next(n for n in z.namelist() if n.endswith("/data.pkl"))      # <archive>/data.pkl
            state = _Skeleton(io.BytesIO(z.read(pkl))).load()
    except Exception as e:
        raise CheckpointError(f"checkpoint file '{path}' could not be read: {first_line(e)}") from None
    client = state.get(CLIENT_KEY) if isinstance(state, dict) else None
    config = client.get("config") if isinstance(client, dict) else None
    return config if isinstance(config, dict) else None


class _Stub:
    """Stands in for every object a state file names (a tensor, a storage, DeepSpeed's classes):
    made from anything, holding nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass

    def __setitem__(self, key, value):
        pass

    def append(self, item):
        pass

    def extend(self, items):
        pass


class _Skeleton(pickle.Unpickler):
    """Rebuilds a pickle's plain containers and values; every global it names is a _Stub (nothing is
    imported, so nothing runs) and every storage a tensor would read from disk is one too."""

    def find_class(self, module, name):
        return _Stub

    def persistent_load(self, pid):
        return _Stub()


def read_client_state(ckpt_dir) -> dict:
    """The client_state of a complete checkpoint, read from rank 0's file without an engine
    (tensors on the CPU). Raises CheckpointError like `load`."""
    tag_dir = resolve(ckpt_dir)
    state = load_file(rank0_states(tag_dir))
    if CLIENT_KEY not in state:
        raise CheckpointError(f"checkpoint '{tag_dir}' holds no training state of this program "
                              f"(key '{CLIENT_KEY}' missing)")
    return state[CLIENT_KEY]


def rank0_states(tag_dir: Path) -> Path:
    files = sorted(tag_dir.glob("*mp_rank_00_model_states.pt"))
    if not files:
        raise CheckpointError(f"checkpoint '{tag_dir}' has no rank-0 model states file")
    return files[0]


def load_file(path) -> dict:
    """One state file of a checkpoint, tensors on the CPU, read with weights_only=True: tensors,
    plain values and the few SAFE_GLOBALS only. Raises CheckpointError naming the file and what is
    wrong (an arbitrary pickled object is refused before anything is unpickled)."""
    import torch

    try:
        with torch.serialization.safe_globals(check_pickle(path)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"checkpoint file '{path}' could not be read: {first_line(e)}") from None


def check_pickle(path) -> list:
    """The SAFE_GLOBALS that the state file at `path` names (for torch.serialization.safe_globals),
    or a CheckpointError if it names anything else: a checkpoint of this program never does, and
    unpickling it could run any code. Reads the pickle only, not the tensors; a file that is no
    torch file raises what torch raises."""
    import torch

    named = set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    refused = sorted(named - SAFE_GLOBALS)
    if refused:
        raise CheckpointError(f"checkpoint file '{path}' holds pickled objects of {', '.join(refused)}, which "
                              "a checkpoint of this program never does; refusing to load it (unpickling "
                              "could run code)")
    allowed = [getattr(importlib.import_module(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1])
               for name in sorted(named)]
    if "numpy.dtype" in named:          # the uint32 keys of older RNG states: built, not named
        allowed.append(type(np.dtype(np.uint32)))
    return allowed
