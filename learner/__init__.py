"""Learner side: V-trace PPO math, the DeepSpeed engine, ingest, publishing, checkpoints."""
