"""The VLA policy shared by actors (sampling) and learner (training)."""

from .action_tokenizer import ActionTokenizer
from .logprobs import LOGPROB_LEVELS, action_log_softmax, reduce_logprobs, token_logprobs
from .model import ActOutput, EvalOutput, VLAPolicy, resolve_dtype
from .kinds import build_policy, load_policy, starts_trained  # noqa: E402

__all__ = ["VLAPolicy", "build_policy", "load_policy", "starts_trained", "ActOutput", "EvalOutput", "ActionTokenizer", "reduce_logprobs", "token_logprobs",
           "action_log_softmax", "resolve_dtype", "LOGPROB_LEVELS"]
