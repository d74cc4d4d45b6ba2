"""A fully asynchronous rollout: one persistent generation worker keeps the engines busy across rollouts.

Plugged in with ``--rollout-function-path examples/fully_async/fully_async_rollout.py:generate_rollout``.
The default rollout function starts a rollout's requests when the trainer asks for the rollout and
waits for the slowest group, so engines idle at every rollout boundary. Here the first call starts a
worker (a thread with its own asyncio loop, inside the rollout manager's process) that never stops:
it keeps ``--over-sampling-batch-size`` prompt groups in flight, and every finished, scored group
goes into a bounded queue. A rollout only takes ``--rollout-batch-size`` groups off that queue.

The queue's bound (``QUEUE_ROLLOUTS`` rollouts' worth of groups) is what limits staleness; the loop
logs it as ``rollout/staleness`` from the weight versions every sample records.
A weight push pauses the engines with ``abort``: the groups in flight then come back unfinished and
are generated again (continued, under ``--partial-rollout``) with the new weights.

Groups already queued when the run stops are not trained on; a resumed run continues after the
prompts the worker had taken, so resuming is approximate.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import queue
import threading
from typing import Any

from tqdm import tqdm

from slime.config.settings.fault_tolerance import FaultToleranceSettings
from slime.rollout.generate_utils import rollout_context
from slime.rollout.output import RolloutOutput
from slime.rollout.plugin_args import rollout_settings, router_url, settings_of
from slime.rollout.sample import Sample
from slime.rollout.sglang_rollout import RolloutClient, sampling_params
from slime.rollout.sglang_rollout import generate_rollout as default_rollout

logger = logging.getLogger(__name__)

QUEUE_ROLLOUTS = 2  # finished groups the worker may hold, in rollouts' worth


class GenerationWorker:
    """Generates prompt groups forever on its own thread; finished groups wait in ``self.groups``."""

    def __init__(self, args: argparse.Namespace, data_source: Any) -> None:
        self.args, self.data_source = args, data_source
        self.groups: queue.Queue[list[Sample]] = queue.Queue(maxsize=QUEUE_ROLLOUTS * args.rollout_batch_size)
        self.interrupted = 0  # groups cut short by a weight push (so far), then generated on
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fully-async-rollout", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            asyncio.run(self._generate_forever())
        except BaseException as error:  # raised by the next take(); at shutdown the engines went away
            self.error = error
            logger.warning("fully async generation worker stopped: %s", error)

    async def _generate_forever(self) -> None:
        args = self.args
        settings = rollout_settings(args)
        client = RolloutClient(args, router_url(args), settings, settings_of(args, FaultToleranceSettings))
        params = sampling_params(settings.sampling)
        bar = tqdm(desc="fully async", unit="sample", mininterval=1.0)
        try:
            with rollout_context(client.context):
                in_flight = {
                    asyncio.ensure_future(self._one_group(client, group, params, bar))
                    for group in self.data_source.get_samples(args.over_sampling_batch_size)
                }
                while True:
                    done, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                    for _ in done:  # every finished group frees a slot for the next prompt
                        (group,) = self.data_source.get_samples(1)
                        in_flight.add(asyncio.ensure_future(self._one_group(client, group, params, bar)))
                    for task in done:
                        task.result()  # raises a generation error here
        finally:
            bar.close()
            await client.close()

    async def _one_group(
        self, client: RolloutClient, group: list[Sample], params: dict[str, Any], bar: tqdm
    ) -> None:
        """Generates ``group`` until all of it finished, then queues it (waits while the queue is full)."""
        while True:
            group = await client.generate_group(group, params, bar)
            if all(sample.finished for sample in group):
                break
            self.interrupted += 1  # a weight push aborted it: on, with the new weights
            for sample in group:
                if not sample.finished and not self.args.partial_rollout:
                    sample.reset_response()
        await asyncio.to_thread(self.groups.put, group)

    def take(self, n: int) -> list[list[Sample]]:
        """``n`` finished groups, oldest first; raises the worker's error if it died."""
        taken = []
        while len(taken) < n:
            if self.error is not None:
                raise RuntimeError("the fully async generation worker died") from self.error
            try:
                taken.append(self.groups.get(timeout=1.0))
            except queue.Empty:
                continue
        return taken


_WORKER: GenerationWorker | None = None


def generate_rollout(
    args: argparse.Namespace, rollout_id: int, data_source: Any, evaluation: bool = False
) -> RolloutOutput:
    """slime's rollout-function contract; evaluation is the default one (it must see current weights)."""
    global _WORKER
    if evaluation:
        return default_rollout(args, rollout_id, data_source, evaluation=True)
    if _WORKER is None:
        _WORKER = GenerationWorker(args, data_source)
    groups = _WORKER.take(args.rollout_batch_size)
    metrics = {
        "rollout/fully_async/queued_groups": float(_WORKER.groups.qsize()),
        "rollout/fully_async/interrupted_groups": float(_WORKER.interrupted),
    }
    return RolloutOutput(groups, metrics)
