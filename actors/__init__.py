"""Actor side: environments, the rollout loop, the actor process."""
