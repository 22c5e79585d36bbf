"""Shared contract between actors and learner: config, protocol, transport, policy."""
