"""Upstream slime's ``run`` (``slime.utils.async_utils``): a rollout function written for THUDM/slime
runs its coroutines with it. Ours is ``run_on_thread_loop``: one event loop kept per thread, so the
per-process ``GenerateState.semaphore`` and the keep-alive sessions outlive one rollout, as upstream's
background loop lets them."""

from slime.engine_client.generate import run_on_thread_loop as run

__all__ = ["run"]
