"""The run on a Ray cluster: placement, the trainer group, the rollout manager, engines and the session."""
