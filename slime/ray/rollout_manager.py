"""The rollout side as one Ray actor: engines, the router in front of them, the prompts, the rollout function.

Each responsibility is its own small object and ``RolloutManager`` only wires them:

- ``EnginePool`` (``slime.ray.engines``): engine actors on the placement group's bundles;
- ``Router`` (``slime.rollout.router``): the sglang-router process the rollout talks to;
- the data source (``slime.rollout.data_source``, or ``--data-source-path``): which prompts come
  next, resumable;
- ``RolloutFunction`` (``slime.rollout.rollout_function``): the ``--rollout-function-path`` plugin,
  called once per rollout (``evaluation=False``) and once per evaluation with the eval sets
  (``evaluation=True``);
- the evaluation sets (``--eval-config`` or ``--eval-prompt-data``, ``slime.rollout.evaluation``),
  scored by ``eval``, which also writes each evaluation's samples to ``--eval-output-dir``.

The manager receives its settings parts and, for the plugins only, the run's namespace
(``plugin_args``). Once the router is up, plugins get the manager's own copy of it naming the router
(``sglang_router_ip``/``sglang_router_port``, slime's convention; ``slime.rollout.plugin_args``).
Without engine bundles (SFT, train-only debugging) no engine and no router start.

What leaves the actor is train data: a dict of per-sample lists (``slime.rollout.train_data``) plus
the rollout's metrics under ``"metrics"``, which the driver pops before training.

The actor is threaded (``max_concurrency``) so that ``pause``/``resume`` reach the engines while a
``generate`` call is running, as a weight update in the middle of a rollout needs.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup

from slime.config.settings.cluster import ClusterSettings
from slime.config.settings.data import DataSettings
from slime.config.settings.distillation import DEFAULT_TEACHER
from slime.config.settings.eval import EvalSettings
from slime.config.settings.fault_tolerance import FaultToleranceSettings
from slime.config.settings.rollout import RolloutSettings
from slime.ray.engine_recovery import EngineRecovery, EngineWatch
from slime.ray.engines import DEFAULT_START_TIMEOUT_S, EnginePool, EngineStartError, engine_failure
from slime.rollout.data_source import DataSource, KeptPositions, make_data_source
from slime.rollout.errors import EngineFailure
from slime.rollout.evaluation import EvalSet, eval_output_dir, load_eval_datasets, write_eval_samples
from slime.rollout.generate_utils import cached_tokenizer
from slime.rollout.plugin_args import bind as plugin_args_bind
from slime.rollout.plugin_args import tokenizer_path, with_router
from slime.rollout.prompt_index import PromptIndex
from slime.rollout.rewards.failures import RewardFailureStreak
from slime.rollout.rollout_function import RolloutFunction
from slime.rollout.router import Router
from slime.rollout.train_data import (
    RolloutBatch,
    apply_reward_post_process,
    require_rollout_log_probs,
    rollout_metrics,
    samples_to_train_data,
)
from slime.utils.startup import mark

logger = logging.getLogger(__name__)


def run_log_dir() -> str:
    """A fresh directory for the engine and router logs of this run."""
    root = Path(tempfile.gettempdir()) / "slime_logs"
    root.mkdir(parents=True, exist_ok=True)
    return tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=root)


def _load_tokenizer_early(path: str) -> None:
    """The rollout's tokenizer, loaded ahead of its first use; a checkpoint whose tokenizer does not
    load fails where the rollout first needs it, as without this (a custom rollout may need none)."""
    try:
        cached_tokenizer(path)
    except Exception as exc:
        logger.debug("tokenizer of %s not loaded ahead: %s", path, exc)


@ray.remote(num_cpus=0, max_concurrency=4)  # type: ignore[call-overload]  # ray's stub lacks max_concurrency
class RolloutManager:
    """Owns the engines, the router, the data source and the rollout function of a run."""

    def __init__(
        self,
        data: DataSettings,
        rollout: RolloutSettings,
        eval: EvalSettings,
        cluster: ClusterSettings,
        fault_tolerance: FaultToleranceSettings,
        plugin_args: argparse.Namespace,
        pg: PlacementGroup,
        bundle_indices: list[int],
        *,
        log_dir: str | None = None,
        data_source: DataSource | None = None,
        prompt_index: PromptIndex | None = None,
        eval_datasets: list[EvalSet] | None = None,
        teacher_bundles: list[int] | None = None,
    ) -> None:
        """``plugin_args``: the run's namespace, for the plugins only. ``data_source`` /
        ``eval_datasets``: already read by the driver (which checks the data before starting
        anything); read from the settings when not given (``--streaming-data``: always, from the
        driver's ``prompt_index`` of the file when given). ``teacher_bundles``: where the OPD teacher's
        engines go (``--opd-teacher-hf-checkpoint``)."""
        mark("rollout manager: up")
        self.data, self.rollout, self.eval_settings = data, rollout, eval
        self.fault_tolerance = fault_tolerance
        self.plugin_args = plugin_args
        """The run's namespace until the router is up, then the manager's copy naming it."""
        self._bind_plugin_args()
        self.log_dir = log_dir or run_log_dir()
        self.engines = EnginePool(rollout.engine, cluster, pg, bundle_indices, self.log_dir)
        self.router = Router(self.log_dir, settings=rollout.router) if bundle_indices else None
        self.teachers: EnginePool | None = None
        if rollout.opd.enabled and rollout.sampling.temperature != 1.0:
            logger.warning(
                "--use-opd with --rollout-temperature %g: the teacher's log-probs are at temperature 1 "
                "(SGLang scores prompts on raw logits), the student's at %g; the reverse KL compares the two",
                rollout.sampling.temperature,
                rollout.sampling.temperature,
            )
        if rollout.teacher_engine is not None and teacher_bundles:
            teacher_logs = Path(self.log_dir) / "teacher"
            teacher_logs.mkdir(parents=True, exist_ok=True)
            teacher = rollout.teacher_engine
            self.teachers = EnginePool(teacher, cluster, pg, teacher_bundles, str(teacher_logs))
        if data_source is None:
            data_source = make_data_source(data, plugin_args, prompt_index)
        self.data_source = data_source
        self.rollout_fn = RolloutFunction(rollout.rollout_function_path)
        self.reward_failures = RewardFailureStreak.from_settings(rollout.reward)
        self.eval_datasets = eval_datasets if eval_datasets is not None else load_eval_datasets(eval)
        self.recovery: EngineRecovery | None = None  # --use-fault-tolerance, once the engines are up
        self.watch: EngineWatch | None = None  # otherwise: a failed engine stops the run
        self._fault_reported: dict[str, float] = {}
        # train_async.py draws up to --async-buffer-size + 1 rollouts' prompts past the last one trained.
        kept_dir = Path(self.log_dir) / "position_kept"
        self.positions = KeptPositions(self.data_source, kept_dir, rollout.kept_positions)

    def start(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> tuple[list[str], str | None]:
        """Starts the router and the engines and registers every engine; ``(engine URLs, router URL)``.

        Without engine bundles nothing starts: ``([], None)``. On any failure everything already
        started is stopped before the error is raised.
        """
        if self.router is None:
            return [], None
        logger.info("rollout logs in %s", self.log_dir)
        try:
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                teachers = pool.submit(self._start_teachers, timeout_s)
                # The tokenizer loads while the engines start: unpickled from the tokenizer cache (on
                # a checkpoint's first run a short-lived process makes the entry: 2.4 CPU-s on 2 cores).
                tokenizer = pool.submit(_load_tokenizer_early, tokenizer_path(self.plugin_args))
                router_url = self.router.start()
                mark("rollout manager: router up")
                urls = self.engines.start(timeout_s)
                mark("rollout manager: engines serve")
                for url in urls:
                    self.router.add_worker(url)
                mark("rollout manager: engines in the router")
                teachers.result()
                tokenizer.result()
        except BaseException:
            self.shutdown()
            raise
        health: EngineRecovery | EngineWatch
        if self.fault_tolerance.enabled:
            health = self.recovery = EngineRecovery(self.fault_tolerance, self.engines, self.router)
        else:
            health = self.watch = EngineWatch(self.fault_tolerance, self.engines)
        health.start()
        # slime's plugin convention: custom generate functions find the router through their args.
        self.plugin_args = with_router(self.plugin_args, router_url)
        self._bind_plugin_args()
        return urls, router_url

    def _start_teachers(self, timeout_s: float) -> None:
        """Starts the OPD teacher's engines (with the rollout engines) and makes them the ``default``
        teacher the rollout asks, one engine after another."""
        if self.teachers is None:
            return
        try:
            urls = self.teachers.start(timeout_s)
        except EngineStartError as error:
            raise EngineStartError(f"OPD teacher {self.rollout.opd.teacher_hf_checkpoint}: {error}") from None
        opd = self.rollout.opd
        teacher_urls = {**opd.teacher_urls, DEFAULT_TEACHER: " ".join(urls)}
        opd = dataclasses.replace(opd, teacher_urls=teacher_urls)
        self.rollout = dataclasses.replace(self.rollout, opd=opd)
        logger.info("OPD teacher engines: %s", ", ".join(urls))

    def teacher_urls(self) -> list[str]:
        """The URLs of the OPD teacher engines this manager started (none without a teacher checkpoint)."""
        return list(self.teachers.urls) if self.teachers is not None else []

    def _bind_plugin_args(self) -> None:
        """slime's default plugins, called with ``plugin_args``, read this manager's settings."""
        rollout = self.rollout
        parts = (self.data, rollout, rollout.sampling, rollout.reward, self.eval_settings)
        plugin_args_bind(self.plugin_args, *parts, self.fault_tolerance)

    def generate(self, rollout_id: int) -> RolloutBatch:
        """One rollout: its train data (per-sample lists) and its metrics."""
        if self.data.save and rollout_id > 0:  # the position after the previous rollout, should this one fail
            self.positions.keep(rollout_id - 1)
        with self._failures_named():
            output, seconds = self.rollout_fn(self.plugin_args, rollout_id, self.data_source)
        self.reward_failures.observe(rollout_id, output.groups)
        require_rollout_log_probs(self.rollout, output.groups)
        trained_rewards = None
        if (post_process := self.rollout.reward.custom_reward_post_process_path) is not None:
            raw, trained_rewards = apply_reward_post_process(post_process, self.plugin_args, output.groups)
            for sample, value in zip((s for group in output.groups for s in group), raw, strict=True):
                sample.reward = value
        reward_key = self.rollout.reward.reward_key
        data = samples_to_train_data(
            output.groups,
            reward_key,
            routing_replay=self.rollout.routing_replay,
            distillation=self.rollout.opd.enabled,
        )
        if trained_rewards is not None:  # upstream's form: these train as they are
            data["rewards"] = trained_rewards
        metrics = rollout_metrics(output.groups, seconds, reward_key)
        if self.recovery is not None:  # restarts and time out of service since the last rollout's report
            now = self.recovery.counters()
            metrics.update({key: value - self._fault_reported.get(key, 0.0) for key, value in now.items()})
            self._fault_reported = now
        self.positions.generated = rollout_id
        return RolloutBatch(data=data, metrics={**metrics, **output.metrics})

    def save_position_after(self, rollout_id: int) -> None:
        """The data position after ``rollout_id`` to ``--save``, for a run that stops between checkpoints."""
        assert self.data.save is not None  # the loop calls it only with --save
        self.positions.save_after(rollout_id, self.data.save)

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
                self.engines, self.fault_tolerance.health_check_timeout_s, self.recovery is not None
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
            output, _ = self.rollout_fn(self.plugin_args, rollout_id, self.eval_datasets, evaluation=True)
        if output.eval_groups:
            path = eval_output_dir(self.eval_settings, self.log_dir) / f"rollout_{rollout_id}.jsonl"
            lines = write_eval_samples(path, rollout_id, output.eval_groups, self.eval_settings.reward_key)
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
        directory = directory or self.data.save
        if directory is None:
            raise ValueError("no directory to save the data source position to; pass --save")
        return str(self.data_source.save(rollout_id, directory))

    def load(self, rollout_id: int, directory: str | None = None) -> bool:
        """Continues the data source from ``rollout_id``'s saved position (default: ``--load``)."""
        directory = directory or self.data.load
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
        if self.teachers is not None:
            self.teachers.shutdown()
        if self.router is not None:
            self.router.shutdown()
        logger.info("rollout stopped; logs in %s", self.log_dir)
