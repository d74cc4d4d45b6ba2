"""The default rollout function: prompt groups -> HTTP ``/generate`` through the router -> scored samples.

``generate_rollout(args, rollout_id, data_source, evaluation)`` is what ``--rollout-function-path``
names by default. Per prompt group it sends one batched ``/generate`` to the router (SGLang's list
form: the prompt's token ids, tokenized once with the ``--hf-checkpoint`` tokenizer, once per
sample, with one rid and one ``sampling_params`` for the batch; samples with another token budget
go in a batch of their own) and takes each sample's response tokens and log-probs from its reply
(``slime.rollout.generate_utils.generate_turns``). One request per group instead of one per sample
cut the quickstart's generation from 157 to 97 ms per step (128 samples through the router, 2-core
VM): HTTP handling shares the engine's GIL with its scheduler. ``--rollout-seed-per-sample`` sends
one seeded request per sample instead (exact resume). The response is never
re-tokenized from text, because text -> ids does not round-trip and the trainer must score exactly
the tokens the engine sampled.

A group is scored as soon as its last sample is back, so rewards overlap with generation. All requests
share one aiohttp session, kept across rollouts (keep-alive connections); at most
``--sglang-server-concurrency`` samples per engine are in flight (a group larger than that is sent
in several batches).

Rollout control:

- Dynamic sampling: prompts are drawn ``--over-sampling-batch-size`` at a time whenever the groups
  kept plus those in flight fall short of ``--rollout-batch-size``; each finished group passes
  ``--dynamic-sampling-filter-path`` or is dropped (counted by reason). Once enough groups are kept,
  the rollout's own requests are aborted on every engine (by rid; requests of an evaluation running
  beside are left alone) and the rollout waits until every one of its requests has come back.
- Groups that did not finish (aborted, or over-sampled past the target) go back to the data source:
  with ``--partial-rollout`` as they are, so their samples resume with the tokens and log-probs they
  have and the rest of the ``--rollout-max-response-len`` budget; otherwise reset to the prompt.
- ``--mask-offpolicy-in-partial-rollout`` leaves tokens an older weight version sampled out of the loss.

``--custom-generate-function-path`` replaces the per-sample step (multi-turn, tools):
``async def generate(args, sample, sampling_params) -> Sample | list[Sample]``, or, in the usage
guide's form, the per-group step ``async def custom_generate(args, samples, evaluation=False) -> list``
(``slime.utils.plugins.is_group_generate``); a reward either sets on a sample is kept.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import copy
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from tqdm import tqdm

from slime.config.eval_config import EvalSetSettings
from slime.config.settings.eval import EvalSettings
from slime.config.settings.fault_tolerance import FaultToleranceSettings
from slime.config.settings.rollout import RolloutSettings
from slime.engine_client import control
from slime.engine_client.generate import client_session, run_on_thread_loop
from slime.rollout.data_source import DataSource
from slime.rollout.errors import RolloutError
from slime.rollout.evaluation import EvalSet, eval_metrics
from slime.rollout.filters import FilterResult, as_filter_result
from slime.rollout.generate_state import GenerateState, generate, get_model_url  # noqa: F401 upstream's path
from slime.rollout.generate_utils import (
    RolloutContext,
    append_model_turn,
    complete_generated,
    fail_on_image,
    generate_turns,
    mask_offpolicy_turns,
    parse_reply,
    prompt_ids,
    remaining_tokens,
    request_images,
    rollout_context,
    route_request,
)
from slime.rollout.output import RolloutOutput
from slime.rollout.plugin_args import eval_settings, rollout_settings, router_url, settings_of
from slime.rollout.rewards import RewardChoice, score_groups
from slime.rollout.router import engine_urls
from slime.rollout.sample import Sample
from slime.rollout.sampling import sampling_params
from slime.rollout.teacher import TeacherPool
from slime.rollout.vision import ImageError
from slime.utils.plugins import declares, is_group_generate, load_function

# (args, sample, sampling_params) per sample, or (args, samples, ...) per group (the usage guide's form).
GenerateFn = Callable[..., Awaitable[Sample | list[Sample]]]
FilterFn = Callable[[argparse.Namespace, list[Sample]], FilterResult | bool]

ABORT_RETRY_S = 0.5  # a request still in the router when the abort went out reaches an engine later
ABORT_ESCALATE_S = 3.0  # aborts by rid that long without effect: abort_all (see RolloutClient.abort)
ABORT_BY_RID_ROUNDS = 2  # the by-rid posts of an abort: at most this many full rounds' worth
ABORT_REPORT_S = 30.0  # how often a long abort says which requests it still waits for

logger = logging.getLogger(__name__)

# A rollout's sample bar shows once it has run this long: a quickstart rollout (a tenth of a second,
# several a second) printed two bar lines per rollout, which Ray forwards to the driver's console,
# burying the per-rollout log line; a GPU rollout of minutes shows its bar as before.
BAR_DELAY_S = 2.0


def sample_bar(desc: str, total: int) -> tqdm:
    return tqdm(total=total, desc=desc, unit="sample", mininterval=1.0, delay=BAR_DELAY_S)


def apply_reply(sample: Sample, prompt: list[int], reply: dict[str, Any]) -> Sample:
    """``sample`` as ``prompt`` followed by the one ``/generate`` reply (pure; for single-call generators)."""
    sample.tokens = list(prompt)
    sample.response, sample.response_length = "", 0
    sample.loss_mask, sample.rollout_log_probs = [], []
    sample.weight_versions, sample.turn_spans = [], []
    append_model_turn(sample, parse_reply(reply, sample.index))
    return sample


_context_lengths: dict[tuple[str, ...], int] = {}


def engines_context_length(router_url: str) -> int | None:
    """The context length of the engines behind ``router_url`` (``control.context_length``),
    asked once per set of engines: each rollout's first requests waited on that lookup, and an engine
    keeps its context length for life (a restarted one has a new URL or the same flags)."""
    urls = tuple(sorted(engine_urls(router_url)))
    if urls not in _context_lengths:
        length = control.context_length(list(urls))
        if length is None:
            return None
        _context_lengths[urls] = length
    return _context_lengths[urls]


class SampleSlots:
    """At most ``capacity`` samples in flight. A batch takes a slot per sample, all before it is sent:
    batches taking theirs one by one could each hold part of the slots and wait for each other forever."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free = asyncio.Semaphore(capacity)
        self._taking = asyncio.Lock()  # one batch takes its slots at a time

    @contextlib.asynccontextmanager
    async def hold(self, count: int) -> AsyncIterator[None]:
        taken = 0
        try:
            async with self._taking:
                while taken < count:
                    await self._free.acquire()
                    taken += 1
            yield
        finally:
            for _ in range(taken):
                self._free.release()


class RolloutClient:
    """The per-rollout HTTP state: one session, one concurrency bound, one abort signal, and the reward
    function its groups are scored with (an evaluation set's own, or the reward flags').

    ``args`` go to the plugins it calls (generate and reward functions) and nowhere else."""

    def __init__(
        self,
        args: argparse.Namespace,
        url: str,
        settings: RolloutSettings,
        fault_tolerance: FaultToleranceSettings,
        reward: RewardChoice | None = None,
        evaluation: bool = False,
    ) -> None:
        self.args = args
        self.settings = settings
        self.evaluation = evaluation
        self.router_url = url
        self.reward = RewardChoice.from_settings(settings.reward) if reward is None else reward
        concurrency = settings.batch.concurrency
        self.slots = SampleSlots(concurrency)
        self.plugin = settings.custom_generate_function_path
        self.generate: GenerateFn | None = load_function(self.plugin) if self.plugin else None
        self.per_group = self.generate is not None and is_group_generate(self.generate)
        # The loop's shared session (keep-alive connections across rollouts); a dead engine is the
        # router's to report.
        session, self._shared_session = client_session(concurrency)
        self.context = RolloutContext(
            session,
            context_length_lookup=lambda: engines_context_length(url),
        )
        if fault_tolerance.enabled:  # a request a dead engine dropped goes to another one
            self.context.retries = fault_tolerance.request_retries
            self.context.retry_wait_s = fault_tolerance.health_check_interval_s
        opd = settings.opd
        self.teachers = TeacherPool(opd, settings.sampling.temperature) if opd.scores_in_rollout else None
        self.opd_only = opd.enabled and opd.opd_only
        self.reward_settings = settings.reward
        if evaluation:  # an eval set is scored by its reward alone, each reward a number
            self.teachers, self.opd_only = None, False
            self.reward_settings = dataclasses.replace(settings.reward, custom_reward_post_process_path=None)

    async def close(self) -> None:
        if not self._shared_session:
            await self.context.session.close()

    async def generate_group(
        self, group: list[Sample], params: dict[str, Any], progress: tqdm
    ) -> list[Sample]:
        """Generates every unfinished sample of ``group``; scores the group if all of it finished.

        A finished sample (its group was returned to the data source before the others finished) is
        passed through: generate functions only ever see samples with something left to generate.
        """
        if self.generate is None:
            await self._generate_batched(group, params, progress)
            done = group
        elif self.per_group:
            done = await self._generate_group_form(group, params, progress)
        else:
            returned = [self._generate_one(sample, params, progress) for sample in group]
            done = [sample for samples in await asyncio.gather(*returned) for sample in samples]
        if all(sample.finished for sample in done):
            await self._score(done)
        return done

    async def _score(self, group: list[Sample]) -> None:
        """The group's rewards and, with ``--use-opd``, its teacher's log-probs, concurrently;
        ``--opd-only`` sets the task reward to 0 instead of calling the reward function."""
        if self.opd_only:
            for sample in group:
                sample.reward = 0.0
        scoring = [score_groups(self.args, [group], self.reward_settings, self.reward)]
        if self.teachers is not None:
            scoring.append(self.teachers.score(self.args, self.context, group))
        await asyncio.gather(*scoring)

    async def _generate_batched(self, group: list[Sample], params: dict[str, Any], progress: tqdm) -> None:
        """The default step: one model turn for each unfinished sample's remaining token budget, the
        group in one batched ``/generate`` (in chunks of at most the concurrency bound), or with
        ``--rollout-seed-per-sample`` one seeded request per sample; a resumed partial sample
        continues where it stopped."""
        todo = [sample for sample in group if not sample.finished]
        fresh = [sample for sample in todo if not sample.tokens]
        if fresh:
            try:
                shared = prompt_ids(self.args, fresh[0])  # once per group: the samples share the prompt
            except ImageError as error:  # the group's images: every sample of it fails, the rollout goes on
                fail_on_image(fresh, error)
                todo = [sample for sample in todo if not sample.finished]
                fresh = []
            for sample in fresh:
                sample.tokens = list(shared)
                sample.multimodal_train_inputs = fresh[0].multimodal_train_inputs
        size = 1 if self.settings.sampling.seed_per_sample else self.slots.capacity  # one alone is seeded
        chunks = [todo[start : start + size] for start in range(0, len(todo), size)]
        await asyncio.gather(*(self._generate_chunk(chunk, params, progress) for chunk in chunks))

    async def _generate_chunk(self, samples: list[Sample], params: dict[str, Any], progress: tqdm) -> None:
        async with self.slots.hold(len(samples)):
            if self.context.aborted.is_set():  # never started: they go back untouched
                return
            budgets = [remaining_tokens(sample, params) for sample in samples]
            tokens, indices = [sample.tokens for sample in samples], [sample.index for sample in samples]
            images = [request_images(self.args, sample) for sample in samples]
            routes = [route_request(sample) for sample in samples]
            turns = await generate_turns(
                self.args, tokens, params, budgets, indices, images=images, routes=routes
            )
        for sample, turn in zip(samples, turns, strict=True):
            append_model_turn(sample, turn)
        progress.update(len(samples))

    async def _generate_one(self, sample: Sample, params: dict[str, Any], progress: tqdm) -> list[Sample]:
        """One sample through ``--custom-generate-function-path``."""
        assert self.generate is not None and self.plugin is not None  # _generate_group: a custom generate
        if sample.finished:
            return [sample]
        async with self.slots.hold(1):
            if self.context.aborted.is_set():  # never started: it goes back untouched
                return [sample]
            result = await self.generate(self.args, sample, dict(params))
        progress.update(1)
        samples = result if isinstance(result, list) else [result]
        for returned in samples:
            complete_generated(self.args, returned, self.plugin)
        return samples

    async def _generate_group_form(
        self, group: list[Sample], params: dict[str, Any], progress: tqdm
    ) -> list[Sample]:
        """The group's unfinished samples through a per-group generate (the usage guide's form), in one
        call: such a function may compare or rank the group's responses. ``evaluation`` and
        ``sampling_params`` are passed by keyword where it declares them."""
        assert self.generate is not None and self.plugin is not None  # _generate_group: a custom generate
        finished = [sample for sample in group if sample.finished]
        todo = [sample for sample in group if not sample.finished]
        if not todo:
            return group
        kwargs: dict[str, Any] = {}
        if declares(self.generate, "evaluation"):
            kwargs["evaluation"] = self.evaluation
        if declares(self.generate, "sampling_params"):
            kwargs["sampling_params"] = dict(params)
        async with self.slots.hold(min(len(todo), self.slots.capacity)):
            if self.context.aborted.is_set():  # never started: they go back untouched
                return group
            result = await self.generate(self.args, todo, **kwargs)
        if not isinstance(result, list) or not all(isinstance(s, Sample) for s in result):
            raise RolloutError(
                f"--custom-generate-function-path {self.plugin} returned {type(result).__name__}; "
                "a per-group generate (args, samples, evaluation=False) returns the list of samples"
            )
        progress.update(len(todo))
        for returned in result:
            complete_generated(self.args, returned, self.plugin)
        return finished + result

    async def abort(self, pending: set[asyncio.Task[list[Sample]]]) -> list[list[Sample]]:
        """Aborts this rollout's requests on every engine until each has come back.

        The rollout's own requests are aborted by rid (``context.in_flight``), so that other clients
        of the same engines (an evaluation running beside under ``train_async.py``, an external user)
        keep theirs. Nothing tells which engine holds a rid, so each goes to every engine
        (``control.EngineAborts``, one aiohttp session). The aborts are repeated every
        ``ABORT_RETRY_S`` for the rids still out: a request still in the router when they went out
        reaches an engine later. SGLang (0.5.20+) forwards only the first abort of a rid, though, and
        a request held by a paused engine (or still being tokenized) is not in its scheduler yet, so
        that abort is lost for good. So the by-rid phase is bounded: after ``ABORT_ESCALATE_S``, or
        once its posts would pass ``ABORT_BY_RID_ROUNDS`` rounds of every rid out at the start to every
        engine (the first round always fits; repeats of a few stragglers stay cheap, repeats of many
        held requests are the lost aborts above), the rollout falls back to ``abort_all``, repeated,
        which ends such a request once it is scheduled (and every other client's requests with it,
        said in a warning). The returned requests decide, not the engines' load: it does not count
        held requests, and it counts other clients' (an evaluation beside must not hold the rollout up).
        """
        self.context.aborted.set()
        urls = await asyncio.to_thread(engine_urls, self.router_url)
        groups = []
        started = time.monotonic()
        next_report = started + ABORT_REPORT_S
        escalated = False
        max_rid_calls = ABORT_BY_RID_ROUNDS * len(urls) * len(self.context.in_flight)
        async with control.EngineAborts(urls, max_rid_calls, ABORT_ESCALATE_S) as aborts:
            while pending:
                if escalated or not await aborts.by_rid(sorted(self.context.in_flight)):
                    if not escalated:
                        escalated = True
                        logger.warning(
                            "%d requests of this rollout outlived their abort by rid (%.1f s, %d posts to "
                            "%d engines; held by a paused engine?); aborting every request on the engines "
                            "instead",
                            len(self.context.in_flight),
                            time.monotonic() - started,
                            aborts.rid_calls,
                            len(urls),
                        )
                    await aborts.abort_all()
                done, pending = await asyncio.wait(pending, timeout=ABORT_RETRY_S)
                groups += [task.result() for task in done]
                if pending and time.monotonic() >= next_report:
                    next_report += ABORT_REPORT_S
                    logger.warning(
                        "%d requests of this rollout still on the engines %.0f s after the abort (paused "
                        "engines hold new requests until /continue_generation): %s",
                        len(self.context.in_flight),
                        time.monotonic() - started,
                        sorted(self.context.in_flight)[:8],
                    )
        return groups


async def _gather_or_cancel(coros: list[Awaitable[Any]]) -> list[Any]:
    """``gather`` that cancels the rest on the first error, so a failed rollout stops sending requests."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        await _cancel(tasks)


async def _cancel(tasks: Any) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def generate_groups(
    args: argparse.Namespace,
    settings: RolloutSettings,
    fault_tolerance: FaultToleranceSettings,
    groups: list[list[Sample]],
    url: str,
    desc: str = "rollout",
    eval_set: EvalSetSettings | None = None,
) -> list[list[Sample]]:
    """Generates and scores ``groups`` through the router at ``url``; returns them in the same order.

    ``eval_set``: sample and score with that evaluation set's settings instead of the rollout's.
    """
    reward = None
    if eval_set is not None:
        reward = RewardChoice(
            rm_type=eval_set.rm_type, custom_rm_path=eval_set.custom_rm_path, group_rm=eval_set.group_rm
        )
    client = RolloutClient(args, url, settings, fault_tolerance, reward, evaluation=eval_set is not None)
    params = sampling_params(settings.sampling, eval_set)
    total = sum(len(group) for group in groups)
    try:
        with (
            rollout_context(client.context),
            sample_bar(desc, total) as bar,
        ):
            return await _gather_or_cancel([client.generate_group(group, params, bar) for group in groups])
    finally:
        await client.close()


def _return_to_source(partial_rollout: bool, data_source: DataSource, groups: list[list[Sample]]) -> int:
    """Unfinished groups back to the data source (as they are under --partial-rollout); returns how
    many samples carry a partial response."""
    partial = 0
    for group in groups:
        for sample in group:
            if not partial_rollout:
                sample.reset_response()
            partial += sample.response_length > 0 and not sample.finished
    if groups:
        data_source.add_samples(groups)
    return partial


# A rollout that drew this many times its batch (or over-sampling batch) of prompt groups without
# reaching it would draw without end: a filter keeping under 1 group in 20, or groups that never finish.
MAX_DRAWS_PER_BATCH = 20


def _endless_draws(
    settings: RolloutSettings,
    rollout_id: int,
    drawn: int,
    kept: int,
    dropped: collections.Counter[str],
    unfinished: list[list[Sample]],
) -> RolloutError:
    """The error of a rollout that reached the draw bound, saying where its groups went."""
    statuses = collections.Counter(s.status.value for group in unfinished for s in group if not s.finished)
    filtered = ""
    if settings.dynamic_sampling_filter_path:
        filtered = (
            f"{sum(dropped.values())} dropped by --dynamic-sampling-filter-path "
            f"{settings.dynamic_sampling_filter_path} ({dict(dropped)}), "
        )
    return RolloutError(
        f"rollout {rollout_id} drew {drawn} prompt groups for a batch of "
        f"{settings.batch.rollout_batch_size} and "
        f"kept {kept}: {filtered}{len(unfinished)} came back unfinished (samples {dict(statuses)}); "
        "it would draw prompts forever: check the filter, the reward, the generate function or the data"
    )


async def sample_rollout(
    args: argparse.Namespace,
    settings: RolloutSettings,
    fault_tolerance: FaultToleranceSettings,
    rollout_id: int,
    data_source: DataSource,
) -> RolloutOutput:
    """``--rollout-batch-size`` groups that pass the dynamic-sampling filter (see the module docstring);
    ``args`` go to the plugins (generate, reward and filter functions)."""
    target = settings.batch.rollout_batch_size
    client = RolloutClient(args, router_url(args), settings, fault_tolerance)
    keep_fn: FilterFn | None = None
    if settings.dynamic_sampling_filter_path:
        keep_fn = load_function(settings.dynamic_sampling_filter_path)
    params = sampling_params(settings.sampling)
    kept: list[tuple[int, list[Sample]]] = []  # (submission order, group): trained in the order drawn
    unfinished: list[list[Sample]] = []
    dropped: collections.Counter[str] = collections.Counter()
    order: dict[asyncio.Task[list[Sample]], int] = {}
    pending: set[asyncio.Task[list[Sample]]] = set()
    finished_groups = abort_s = 0.0
    draw_limit = MAX_DRAWS_PER_BATCH * max(target, settings.batch.over_sampling_batch_size)
    bar = sample_bar(f"rollout {rollout_id}", total=0)
    try:
        with rollout_context(client.context):
            while len(kept) < target:
                if len(kept) + len(pending) < target and len(order) < draw_limit:
                    for group in data_source.get_samples(settings.batch.over_sampling_batch_size):
                        bar.total += len(group)
                        task = asyncio.ensure_future(client.generate_group(group, params, bar))
                        order[task], pending = len(order), pending | {task}
                if not pending and len(order) >= draw_limit:  # raised once no request is left running
                    raise _endless_draws(settings, rollout_id, len(order), len(kept), dropped, unfinished)
                if not pending:
                    raise RolloutError(f"the data source returned no prompt groups in rollout {rollout_id}")
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=order.__getitem__):
                    group = task.result()
                    if len(kept) == target or not all(sample.finished for sample in group):
                        unfinished.append(group)  # over-sampled past the target, or aborted by a pause
                        continue
                    finished_groups += 1
                    verdict = as_filter_result(keep_fn(args, group)) if keep_fn else FilterResult(True)
                    if verdict.keep:
                        kept.append((order[task], group))
                    else:
                        dropped[verdict.reason or "filtered"] += 1
            if pending:
                start = time.perf_counter()
                unfinished += await client.abort(pending)
                pending, abort_s = set(), time.perf_counter() - start
    finally:
        bar.close()
        await _cancel(list(order))  # also takes the errors of finished tasks no one looked at
        await client.close()
    groups = [group for _, group in sorted(kept, key=lambda item: item[0])]
    masked = 0
    if settings.mask_offpolicy_in_partial_rollout:
        masked = sum(mask_offpolicy_turns(sample) for group in groups for sample in group)
    partial = _return_to_source(settings.partial_rollout, data_source, unfinished)
    metrics = {"rollout/returned_groups": float(len(unfinished)), "perf/abort_time": abort_s}
    if fault_tolerance.enabled:
        metrics["fault/requests_retried"] = float(client.context.retried)
    if keep_fn is not None:
        metrics["rollout/dynamic_sampling/finished_groups"] = float(finished_groups)
        metrics["rollout/dynamic_sampling/kept_groups"] = float(len(groups))
        for reason, n in sorted(dropped.items()):
            metrics[f"rollout/dynamic_sampling/dropped/{reason}"] = float(n)
    if settings.partial_rollout:
        metrics["rollout/partial_samples_returned"] = float(partial)
    if settings.mask_offpolicy_in_partial_rollout:
        metrics["rollout/offpolicy_masked_tokens"] = float(masked)
    return RolloutOutput(groups, metrics)


def generate_rollout(
    args: argparse.Namespace,
    rollout_id: int,
    data_source: DataSource | list[EvalSet],
    evaluation: bool = False,
) -> RolloutOutput:
    """One rollout (``data_source``: a ``PromptDataSource`` or a ``--data-source-path`` instance), or
    under ``evaluation`` the scores of the evaluation sets ``data_source`` lists. A plugin by contract:
    it works from the settings ``args`` stand for (``slime.rollout.plugin_args``)."""
    settings, fault_tolerance = rollout_settings(args), settings_of(args, FaultToleranceSettings)
    if evaluation:
        assert isinstance(data_source, list)  # the evaluation sets, by contract
        return eval_rollout(args, settings, fault_tolerance, eval_settings(args), rollout_id, data_source)
    assert not isinstance(data_source, list)
    return run_on_thread_loop(sample_rollout(args, settings, fault_tolerance, rollout_id, data_source))


def _eval_copy(prompt: Sample, group_index: int, index: int) -> Sample:
    sample = copy.deepcopy(prompt)
    sample.group_index, sample.index = group_index, index
    return sample


def eval_rollout(
    args: argparse.Namespace,
    settings: RolloutSettings,
    fault_tolerance: FaultToleranceSettings,
    evals: EvalSettings,
    rollout_id: int,
    eval_sets: list[EvalSet],
) -> RolloutOutput:
    """Scores every evaluation set with its own settings: ``n_samples_per_eval_prompt`` responses per
    prompt, its sampling parameters and its reward function. Returns the ``eval/<name>`` metrics
    (``slime.rollout.evaluation.eval_metrics``) and each set's scored groups, which the rollout manager
    writes out sample by sample."""
    pass_threshold = evals.pass_threshold_or_none
    metrics: dict[str, float] = {}
    eval_groups: dict[str, list[list[Sample]]] = {}
    for eval_set in eval_sets:
        name, n_per_prompt = eval_set.name, eval_set.settings.n_samples_per_eval_prompt
        groups = [
            [_eval_copy(prompt, i, i * n_per_prompt + k) for k in range(n_per_prompt)]
            for i, prompt in enumerate(eval_set.prompts)
        ]
        desc = f"eval {name} @ rollout {rollout_id}"
        generating = generate_groups(
            args, settings, fault_tolerance, groups, router_url(args), desc, eval_set.settings
        )
        done = run_on_thread_loop(generating)
        unscored = [sample for group in done for sample in group if not sample.finished]
        if unscored:
            raise RolloutError(
                f"evaluation set {name!r}: {len(unscored)} samples came back unfinished (e.g. sample "
                f"{unscored[0].index}, status {unscored[0].status.value}) and cannot be scored"
            )
        metrics.update(eval_metrics(name, done, evals.reward_key, pass_threshold))
        eval_groups[name] = done
    return RolloutOutput([], metrics, eval_groups)
