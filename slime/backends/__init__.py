"""The engine and trainer backends; ``slime.config.engine_backend.resolve_backend`` chooses between the
engine servers."""
