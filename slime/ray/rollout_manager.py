"""The rollout side as one Ray actor: engines, the router in front of them, the prompts, the rollout function.

Each responsibility is its own small object and ``RolloutManager`` only wires them:

- ``EnginePool`` (``slime.ray.engines``): engine actors on the placement group's bundles;
- ``Router`` (``slime.rollout.router``): the sglang-router process the rollout talks to;
- the data source (``slime.rollout.data_source``, or ``--data-source-path``): which prompts come
  next, resumable;
- ``RolloutFunction``: the ``--rollout-function-path`` plugin, called once per rollout
  (``evaluation=False``) and once per evaluation with the eval sets (``evaluation=True``);
- the evaluation sets (``--eval-config`` or ``--eval-prompt-data``, ``slime.rollout.evaluation``),
  scored by ``eval``, which also writes each evaluation's samples to ``--eval-output-dir``.

Rollout functions find the router through ``args.sglang_router_ip``/``args.sglang_router_port``
(slime's convention, set by ``start``). Without engine bundles (SFT, train-only debugging) no engine
and no router start.

What leaves the actor is train data: a dict of per-sample lists (``samples_to_train_data``, a pure
function) plus the rollout's metrics under ``"metrics"``, which the driver pops before training.

The actor is threaded (``max_concurrency``) so that ``pause``/``resume`` reach the engines while a
``generate`` call is running, as a weight update in the middle of a rollout needs.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import ray
from ray.util.placement_group import PlacementGroup

from slime.ray.engine_recovery import EngineRecovery, EngineWatch
from slime.ray.engines import DEFAULT_START_TIMEOUT_S, EnginePool, engine_failure
from slime.rollout.data_source import DataSource, KeptPositions, make_data_source
from slime.rollout.errors import EngineFailure, RolloutError
from slime.rollout.evaluation import EvalSet, eval_output_dir, write_eval_samples
from slime.rollout.output import RolloutOutput
from slime.rollout.prompt_files import PromptFormat, load_prompts, load_tokenizer
from slime.rollout.prompt_index import PromptIndex
from slime.rollout.rewards.failures import RewardFailureStreak
from slime.rollout.router import Router, RouterSettings
from slime.rollout.sample import Sample
from slime.utils.plugins import load_function

logger = logging.getLogger(__name__)

METRICS_KEY = "metrics"

RolloutFn = Callable[[argparse.Namespace, int, Any, bool], RolloutOutput]


def run_log_dir() -> str:
    """A fresh directory for the engine and router logs of this run."""
    root = Path(tempfile.gettempdir()) / "slime_logs"
    root.mkdir(parents=True, exist_ok=True)
    return tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=root)


def samples_to_train_data(groups: list[list[Sample]], reward_key: str | None = None) -> dict[str, list]:
    """The trainer's per-sample lists from scored sample groups, in group order.

    ``rewards`` is the scalar that trains (``--reward-key`` picks it from a dict); ``raw_rewards`` is
    what the reward function returned (a number or a dict), kept for logging; ``weight_versions`` are
    the engine weight versions each sample was generated with (the loops log staleness from them).
    ``prompt_groups`` numbers each sample's group in ``groups``: group-relative advantages normalise
    over it, not over blocks of ``--n-samples-per-prompt`` (a generate function may return several
    samples per prompt, so groups can be larger). ``rollout_log_prob_masks`` are 0 for a response
    without engine log-probs (built by hand, or text tokenized after the fact): TIS, MIS and the
    mismatch metrics leave its tokens out. A
    FAILED sample (its reward could not be computed) keeps its place, so group shapes hold, but its
    loss mask is all zeros and ``valid_rewards`` is False: nothing is learned from a reward that does
    not exist, and its placeholder 0.0 stays out of its group's mean and std. A sample a plugin marked
    ``remove_sample`` (upstream slime's field) keeps its place and reward but its loss mask is zeros.
    """
    samples = [sample for group in groups for sample in group]
    prompt_groups = [number for number, group in enumerate(groups) for _ in group]
    # Rollouts that sample nothing (SFT) have no engine log-probs: then the keys are left out, so
    # that a present key always means one log-prob per response token.
    with_log_probs = any(sample.rollout_log_probs is not None for sample in samples)
    keys = ["tokens", "response_lengths", "loss_masks", "rewards", "raw_rewards", "sample_indices"]
    keys += ["weight_versions", "valid_rewards", "prompt_groups"]
    if with_log_probs:
        keys += ["rollout_log_probs", "rollout_log_prob_masks"]
    data: dict[str, list] = {key: [] for key in keys}
    for sample, prompt_group in zip(samples, prompt_groups, strict=True):
        n = sample.response_length
        mask = list(sample.loss_mask) if sample.loss_mask is not None else [1] * n
        log_probs = sample.rollout_log_probs
        if len(mask) != n or (log_probs is not None and len(log_probs) != n) or len(sample.tokens) <= n:
            raise ValueError(
                f"sample {sample.index} is inconsistent: {len(sample.tokens)} tokens, response_length {n}, "
                f"{len(mask)} loss-mask entries, "
                f"{None if log_probs is None else len(log_probs)} rollout log-probs "
                "(the generate function must fill all of them for the response)"
            )
        if (
            sample.status == Sample.Status.FAILED or sample.remove_sample
        ):  # upstream's flag: keep, do not train
            mask = [0] * n
        data["tokens"].append(list(sample.tokens))
        data["response_lengths"].append(n)
        data["loss_masks"].append(mask)
        data["rewards"].append(sample.reward_value(reward_key))
        data["raw_rewards"].append(sample.reward)
        data["sample_indices"].append(sample.index)
        data["weight_versions"].append(list(sample.weight_versions))
        data["valid_rewards"].append(sample.status != Sample.Status.FAILED)
        data["prompt_groups"].append(prompt_group)
        if with_log_probs:
            known = log_probs is not None
            data["rollout_log_probs"].append(list(log_probs) if known else [0.0] * n)
            data["rollout_log_prob_masks"].append([int(known)] * n)
    return data


def require_rollout_log_probs(args: argparse.Namespace, groups: list[list[Sample]]) -> None:
    """``--use-rollout-logprobs`` takes the engine's log-probs as the old policy's: a trained sample
    without them (its response built by hand or from text) would be trained against placeholders."""
    samples = [sample for group in groups for sample in group]
    missing = [s.index for s in samples if s.rollout_log_probs is None and s.response_length]
    if args.use_rollout_logprobs and missing:
        raise RolloutError(
            f"--use-rollout-logprobs: {len(missing)} samples have no engine log-probs (e.g. sample "
            f"{missing[0]}; --custom-generate-function-path {args.custom_generate_function_path} built "
            "its response without slime.rollout.generate_utils.append_model_turn); drop the flag to "
            "recompute the old log-probs in the trainer"
        )


def rollout_metrics(
    groups: list[list[Sample]], seconds: float, reward_key: str | None = None
) -> dict[str, float]:
    """What a rollout log line shows: lengths, how responses ended, speed, mean reward."""
    samples = [sample for group in groups for sample in group]
    n = max(len(samples), 1)
    tokens = sum(sample.response_length for sample in samples)

    def ratio(status: Sample.Status) -> float:
        return sum(sample.status == status for sample in samples) / n

    return {
        "rollout/num_samples": float(len(samples)),
        "rollout/response_length": tokens / n,
        "rollout/truncated_ratio": ratio(Sample.Status.TRUNCATED),
        "rollout/aborted_ratio": ratio(Sample.Status.ABORTED),
        "rollout/failed_ratio": ratio(Sample.Status.FAILED),
        "rollout/context_capped_samples": float(sum(bool(s.metadata.get("context_capped")) for s in samples)),
        "perf/generation_time": seconds,
        "perf/tokens_per_sec": tokens / seconds if seconds > 0 else 0.0,
        "rollout/raw_reward": sum(s.reward_value(reward_key) for s in samples) / n,
    }


def load_eval_datasets(args: argparse.Namespace) -> list[EvalSet]:
    """Every evaluation set of ``args.eval_sets`` with its prompts, read like the training prompts with
    the set's own keys and chat template (the tokenizer is loaded once, if any set renders with it)."""
    settings = getattr(args, "eval_sets", None) or []
    tokenizer = None
    if any(s.apply_chat_template for s in settings):
        tokenizer = load_tokenizer(args.hf_checkpoint)
    sets = []
    for s in settings:
        prompt_format = PromptFormat(
            input_key=s.input_key,
            label_key=s.label_key,
            metadata_key=args.metadata_key,
            tool_key=args.tool_key,
            tokenizer=tokenizer if s.apply_chat_template else None,
            apply_chat_template=s.apply_chat_template,
        )
        sets.append(EvalSet(s, load_prompts(s.path, prompt_format)))
    return sets


class RolloutFunction:
    """The ``--rollout-function-path`` plugin, ``fn(args, rollout_id, data_source, evaluation)``.

    A function written for slime's older contract may return the list of sample groups alone.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.fn: RolloutFn = load_function(path)

    def __call__(
        self, args: argparse.Namespace, rollout_id: int, data_source: Any, evaluation: bool = False
    ) -> tuple[RolloutOutput, float]:
        """The rollout's output and the seconds it took."""
        start = time.perf_counter()
        output = self.fn(args, rollout_id, data_source, evaluation)
        if isinstance(output, list):
            output = RolloutOutput(output)
        if not isinstance(output, RolloutOutput):
            raise TypeError(
                f"--rollout-function-path {self.path} returned {type(output).__name__}; "
                "expected RolloutOutput(groups, metrics)"
            )
        return output, time.perf_counter() - start


@ray.remote(num_cpus=0, max_concurrency=4)
class RolloutManager:
    """Owns the engines, the router, the data source and the rollout function of a run."""

    def __init__(
        self,
        args: argparse.Namespace,
        pg: PlacementGroup,
        bundle_indices: list[int],
        log_dir: str | None = None,
        data_source: DataSource | None = None,
        prompt_index: PromptIndex | None = None,
        eval_datasets: list[EvalSet] | None = None,
    ) -> None:
        """``data_source`` / ``eval_datasets``: already read by the driver (which checks the data before
        starting anything); read from the flags when not given (``--streaming-data``: always, from the
        driver's ``prompt_index`` of the file when given)."""
        self.args = args
        self.log_dir = log_dir or run_log_dir()
        self.engines = EnginePool(args, pg, bundle_indices, self.log_dir)
        self.router = (
            Router(self.log_dir, settings=RouterSettings.from_args(args)) if bundle_indices else None
        )
        self.data_source = data_source if data_source is not None else make_data_source(args, prompt_index)
        self.rollout_fn = RolloutFunction(args.rollout_function_path)
        self.reward_failures = RewardFailureStreak.from_args(args)  # --max-failed-reward-rollouts
        self.eval_datasets = eval_datasets if eval_datasets is not None else load_eval_datasets(args)
        self.recovery: EngineRecovery | None = None  # --use-fault-tolerance, once the engines are up
        self.watch: EngineWatch | None = None  # otherwise: a failed engine stops the run
        self._fault_reported: dict[str, float] = {}
        # train_async.py draws up to --async-buffer-size + 1 rollouts' prompts past the last one trained.
        self.positions = KeptPositions(
            self.data_source, Path(self.log_dir) / "position_kept", args.async_buffer_size + 1
        )

    def start(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> tuple[list[str], str | None]:
        """Starts the router and the engines and registers every engine; ``(engine URLs, router URL)``.

        Without engine bundles nothing starts: ``([], None)``. On any failure everything already
        started is stopped before the error is raised.
        """
        if self.router is None:
            return [], None
        logger.info("rollout logs in %s", self.log_dir)
        try:
            router_url = self.router.start()
            urls = self.engines.start(timeout_s)
            for url in urls:
                self.router.add_worker(url)
        except BaseException:
            self.shutdown()
            raise
        if self.args.use_fault_tolerance:
            self.recovery = EngineRecovery(self.args, self.engines, self.router)
        else:
            self.watch = EngineWatch(self.args, self.engines)
        self._health().start()
        # slime's plugin convention: custom generate functions find the router through args.
        parts = urlsplit(router_url)
        self.args.sglang_router_ip, self.args.sglang_router_port = parts.hostname, parts.port
        return urls, router_url

    def generate(self, rollout_id: int) -> dict[str, Any]:
        """One rollout as train data (per-sample lists) with its metrics under ``"metrics"``."""
        if self.args.save and rollout_id > 0:  # the position after the previous rollout, should this one fail
            self.positions.keep(rollout_id - 1)
        with self._failures_named():
            output, seconds = self.rollout_fn(self.args, rollout_id, self.data_source)
        self.reward_failures.observe(rollout_id, output.groups)
        require_rollout_log_probs(self.args, output.groups)
        data: dict[str, Any] = samples_to_train_data(output.groups, self.args.reward_key)
        metrics = rollout_metrics(output.groups, seconds, self.args.reward_key)
        if self.recovery is not None:  # restarts and time out of service since the last rollout's report
            now = self.recovery.counters()
            metrics.update({key: value - self._fault_reported.get(key, 0.0) for key, value in now.items()})
            self._fault_reported = now
        data[METRICS_KEY] = {**metrics, **output.metrics}
        self.positions.generated = rollout_id
        return data

    def save_position_after(self, rollout_id: int) -> None:
        """The data position after ``rollout_id`` to ``--save``, for a run that stops between checkpoints."""
        self.positions.save_after(rollout_id, self.args.save)

    @contextlib.contextmanager
    def _failures_named(self):
        """An error while engines are in use becomes one ``EngineFailure`` line when an engine is down
        (which one, how it ended or what it answered, what to do); other errors pass unchanged."""
        try:
            yield
        except EngineFailure:
            raise
        except Exception as error:
            failure = self.watch.failure if self.watch is not None else None
            failure = failure or engine_failure(
                self.engines, self.args.rollout_health_check_timeout, self.recovery is not None
            )
            if failure is None:
                raise
            logger.warning("engines failed under this call: %s", str(error).splitlines()[0][:500])
            raise failure from None

    def eval(self, rollout_id: int) -> dict[str, float]:
        """Scores the evaluation sets with the current weights; ``eval/<name>`` metrics. Their samples go
        to ``<eval output dir>/rollout_<rollout_id>.jsonl`` (``slime.rollout.evaluation``)."""
        if not self.eval_datasets:
            return {}
        if self.router is None:
            raise RuntimeError("evaluation needs rollout engines; this run started none")
        with self._failures_named():
            output, _ = self.rollout_fn(self.args, rollout_id, self.eval_datasets, evaluation=True)
        if output.eval_groups:
            path = eval_output_dir(self.args, self.log_dir) / f"rollout_{rollout_id}.jsonl"
            lines = write_eval_samples(path, rollout_id, output.eval_groups, self.args.reward_key)
            logger.info("evaluation of rollout %d: %d samples in %s", rollout_id, lines, path)
        return output.metrics

    def engine_urls(self) -> list[str]:
        return list(self.engines.urls)

    def serving_engine_urls(self, check: bool = False) -> list[str]:
        """The engines a weight push must reach now: all, or under ``--use-fault-tolerance`` those up
        (a restarted one included: it gets the weights before it serves); ``check``: probe them first."""
        if self.recovery is None:
            return list(self.engines.urls)
        if check:
            self.recovery.check_now()
        return self.recovery.serving_urls()

    def rejoin_router(self, urls: list[str]) -> list[int]:
        """After a push to ``urls``, once they generate again: restarted engines among them rejoin the
        router; their ranks."""
        return self.recovery.rejoin_router(urls) if self.recovery is not None else []

    def _health(self) -> EngineRecovery | EngineWatch | None:
        return self.recovery or self.watch

    def pause_health_checks(self) -> None:
        """While the engines are released (``--colocate``) they must not be probed."""
        if (health := self._health()) is not None:
            health.monitor.pause()

    def resume_health_checks(self) -> None:
        if (health := self._health()) is not None:
            health.monitor.resume()

    def router_url(self) -> str | None:
        return None if self.router is None else self.router.url

    def register_engine(self, url: str) -> None:
        """(Re-)adds an engine to the router; it receives requests once this returns."""
        self._require_router().add_worker(url)

    def unregister_engine(self, url: str) -> None:
        """Takes an engine out of the router; no new request reaches it once this returns."""
        self._require_router().remove_worker(url)

    def _require_router(self) -> Router:
        if self.router is None:
            raise RuntimeError("this rollout manager has no engines and no router")
        return self.router

    def pids(self) -> dict[str, Any]:
        """Process ids of the engine servers and the router (for checks that nothing is left behind)."""
        router = None if self.router is None else self.router.pid
        return {"engines": self.engines.pids() if self.engines.actors else [], "router": router}

    def save(self, rollout_id: int, directory: str | None = None) -> str:
        """Saves the data source position after ``rollout_id`` (default directory: ``--save``)."""
        directory = directory or self.args.save
        if directory is None:
            raise ValueError("no directory to save the data source position to; pass --save")
        return str(self.data_source.save(rollout_id, directory))

    def load(self, rollout_id: int, directory: str | None = None) -> bool:
        """Continues the data source from ``rollout_id``'s saved position (default: ``--load``)."""
        directory = directory or self.args.load
        return directory is not None and self.data_source.load(rollout_id, directory)

    def pause(self, mode: str = "abort") -> None:
        """Pauses generation on every engine up (e.g. around a weight update), and their probes."""
        self.pause_health_checks()
        with self._failures_named():
            self.engines.pause(mode, urls=self.serving_engine_urls())

    def resume(self) -> None:
        try:
            with self._failures_named():
                self.engines.resume(urls=self.serving_engine_urls())
        finally:
            self.resume_health_checks()

    def shutdown(self) -> None:
        """Stops the engines, the router and the data source's workers; safe to call twice."""
        if (close := getattr(self.data_source, "close", None)) is not None:
            close()
        if (health := self._health()) is not None:
            health.stop()
        self.engines.shutdown()
        if self.router is not None:
            self.router.shutdown()
        logger.info("rollout stopped; logs in %s", self.log_dir)
