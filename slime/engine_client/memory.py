"""``--colocate``: engines hand their GPU memory to the trainer and take it back, by tag.

SGLang's ``/release_memory_occupation`` and ``/resume_memory_occupation`` take ``{"tags"}``
(``weights``, ``kv_cache``); the same calls serve the run's own engines and external ones. Both wait
for every engine and hand back the ones that failed, so that the caller decides whether a failure
stops the run or is left to the health monitor (``--use-fault-tolerance``).
"""

from __future__ import annotations

from slime.engine_client.calls import failures, post_all

RELEASE_PATH = "/release_memory_occupation"
RESUME_PATH = "/resume_memory_occupation"


def release(urls: list[str], tags: list[str], timeout: float) -> list[tuple[str, Exception]]:
    """Frees ``tags`` on every engine of ``urls``; the engines that failed, with their error, in order."""
    return failures(urls, post_all(urls, RELEASE_PATH, {"tags": tags}, timeout))


def resume(urls: list[str], tags: list[str], timeout: float) -> list[tuple[str, Exception]]:
    """Takes ``tags`` back on every engine of ``urls``; the engines that failed, with their error."""
    return failures(urls, post_all(urls, RESUME_PATH, {"tags": tags}, timeout))
