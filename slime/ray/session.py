"""Everything a training run starts, started in order and stopped in reverse, whatever happens.

``TrainingSession`` is a context manager: leaving it normally, by an exception or by Ctrl-C stops the
trainer actors, the engines, the router and the placement group, and shuts down the Ray cluster the
run started itself, so no process outlives the run.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from types import FrameType
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup

from slime.config.settings.run import RunSettings
from slime.engine_client import control, memory
from slime.engine_client.calls import EngineCallError, wait_all
from slime.engine_client.timeouts import ERROR_PATH_TIMEOUT_S
from slime.engine_client.weight_updates import check_weights, weight_update_session
from slime.ray.cluster import bundle_order, create_placement_group, release_placement_group, start_ray
from slime.ray.engines import external_engine_url
from slime.ray.trainer_group import TrainerGroup
from slime.utils.startup import mark

logger = logging.getLogger("slime")

MemoryCall = Callable[[list[str], list[str], float], list[tuple[str, Exception]]]
"""``memory.release`` or ``memory.resume``: what ``TrainingSession._engine_memory`` asks the engines."""


def _sigterm_to_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class TrainingSession:
    """Ray, one placement group, the rollout manager and the trainer group of one run."""

    def __init__(self, settings: RunSettings) -> None:
        self.settings = settings
        """The run's settings; with ``--num-epoch`` the run's length is filled in once the data is read."""
        self.weight_sync = settings.weight_sync
        self.uses_engines = settings.cluster.uses_engines
        self.colocate = settings.cluster.colocate
        self.fault_tolerant = settings.fault_tolerance.enabled
        self.pg: PlacementGroup | None = None
        self.trainer: TrainerGroup | None = None
        self.rollout: Any = None  # the RolloutManager's Ray actor handle (ray types it as Never-returning)
        self.start_rollout_id = 0
        self.engine_urls: list[str] = []
        self.external_urls: list[str] = []
        self._released: set[str] = set()  # memory tags this run's engines have released (--colocate)
        self._pausing: ray.ObjectRef | None = None  # the pause of the coming push, sent early
        self._resuming: ray.ObjectRef | None = None  # the resume after the last push, not yet waited for
        self._pushed_to: list[str] = []  # engines the last push reached, until they rejoin the router
        self._owns_ray = False

    def __enter__(self) -> TrainingSession:
        signal.signal(signal.SIGTERM, _sigterm_to_interrupt)
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        from slime.ray.rollout_manager import RolloutManager
        from slime.rollout.data_source import check_streaming_data, make_data_source, rollouts_for_epochs
        from slime.rollout.evaluation import load_eval_datasets

        settings = self.settings
        # Read (and so check) the data before any process starts: a bad line is a one-line error.
        # --streaming-data: only the file's structure and first record here; the rollout manager
        # builds its own source from the path and this index (12 bytes a record), so the data never
        # travels to it.
        streaming = settings.data.streaming_data and settings.data.data_source_path is None
        data_source = None if streaming else make_data_source(settings.data, settings.plugin_args)
        index = check_streaming_data(settings.data) if streaming else None
        sized = index if streaming else data_source
        if (
            settings.loop.num_rollout is None
        ):  # --num-epoch: the trainers' LR schedule needs the count up front
            epochs = settings.data.num_epoch
            assert epochs is not None  # the config checks: --num-rollout or --num-epoch
            num_rollout = rollouts_for_epochs(sized, epochs, settings.data.rollout_batch_size)
            logger.info("--num-epoch %d: %d rollouts", epochs, num_rollout)
            self.settings = settings = settings.with_num_rollout(num_rollout)
        eval_datasets = load_eval_datasets(settings.eval)
        mark("driver: data read")
        cluster = settings.cluster
        self._owns_ray = not ray.is_initialized() and not cluster.ray_address
        start_ray(cluster)
        mark("driver: ray up")
        engines = self.uses_engines
        num_trainers, num_critics = cluster.trainer_gpus, cluster.critic_gpus
        pg = self.pg = create_placement_group(cluster.total_gpus)
        # Ranks in node and GPU order, so a tensor-parallel group or an engine never straddles nodes.
        order = bundle_order(pg, pg.bundle_count)
        mark("driver: placement group ready")
        trainer_bundles = order[:num_trainers]
        rollout_bundles = []
        if engines:
            first = 0 if cluster.colocate else num_trainers
            rollout_bundles = order[first : first + cluster.rollout_num_gpus]
        # PPO's critic takes the last bundles, an OPD teacher's engines those before them.
        critic_start = len(order) - num_critics
        teacher_bundles = order[critic_start - cluster.teacher_gpus : critic_start]
        # ray types an @ray.remote class as the class itself, without .options
        self.rollout = RolloutManager.options(num_cpus=0).remote(  # type: ignore[attr-defined]
            settings.data,
            settings.rollout,
            settings.eval,
            settings.cluster,
            settings.fault_tolerance,
            settings.plugin_args,
            pg,
            rollout_bundles,
            data_source=data_source,
            prompt_index=index,
            eval_datasets=eval_datasets,
            teacher_bundles=teacher_bundles,
        )
        critic_bundles = order[critic_start:]
        timeout_s = settings.fault_tolerance.trainer_call_timeout_s
        critic = None
        if num_critics:
            assert settings.critic is not None  # critic GPUs only with --advantage-estimator ppo
            critic = TrainerGroup(
                settings.critic,
                settings.weight_sync,
                settings.plugin_args,
                pg,
                critic_bundles,
                call_timeout_s=timeout_s,
            )
        # --debug-rollout-only: generation alone, no trainer at all.
        if num_trainers:
            self.trainer = TrainerGroup(
                settings.trainer,
                settings.weight_sync,
                settings.plugin_args,
                pg,
                trainer_bundles,
                critic=critic,
                call_timeout_s=timeout_s,
                cpu_neighbours=cluster.cpu_neighbours["trainer"],
            )
        mark("driver: actors created")
        engine_urls_ref = self.rollout.start.remote()
        if self.colocate and self.trainer is not None:
            # The engines start on the GPUs first and hand their memory back before the trainer
            # builds its model there (as they would take their share of a GPU the trainer fills);
            # the first push takes the weights' part back, hand_gpus_to_engines the KV cache.
            engine_urls, _router_url = ray.get(engine_urls_ref)
            mark("driver: engines ready")
            self.engine_urls = list(engine_urls)
            self._prepare_weight_check()
            self._engine_memory(memory.release, self._released_by_engines())
            loaded = self.trainer.init()
            mark("driver: trainers ready")
        else:  # engines load their weights while the trainer builds its model
            loaded = self.trainer.init() if self.trainer is not None else None
            mark("driver: trainers ready")
            engine_urls, _router_url = ray.get(engine_urls_ref)
            mark("driver: engines ready")
            self.engine_urls = list(engine_urls)
            self._prepare_weight_check()
        if loaded is not None:
            self.start_rollout_id = loaded + 1
            ray.get(self.rollout.load.remote(loaded))
            logger.info("resumed from %s at rollout %d", settings.loop.load, self.start_rollout_id)
        self.engine_urls = list(engine_urls)
        self.external_urls = [self._register_external(a) for a in cluster.external_engine_addrs]
        if engines and self.trainer is not None:
            urls = self.engine_urls + self.external_urls
            self.trainer.connect_engines(urls)
            mark("driver: trainers connected to the engines")

    def _prepare_weight_check(self) -> None:
        """``--check-weight-update-equal``, before the first push: every engine snapshots the weights it
        loaded and overwrites them with noise, so that only a complete push can make them equal again
        (``check_weight_update``). With LoRA the base is never pushed: snapshot only."""
        if not (self.weight_sync.check_equal and self.trainer is not None and self.engine_urls):
            return
        actions = ["snapshot"] if self.weight_sync.lora.enabled else ["snapshot", "reset_tensors"]
        for action in actions:
            wait_all(check_weights(self.engine_urls, {"action": action}, self.weight_sync.timeout_s))

    def check_weight_update(self) -> None:
        """``--check-weight-update-equal``, after the first push: every engine's weights equal the
        snapshot; else the run stops naming the engine and the first tensors that differ."""
        if not (self.weight_sync.check_equal and self.trainer is not None and self.engine_urls):
            return
        self.engines_resumed()
        try:
            wait_all(check_weights(self.engine_urls, {"action": "compare"}, self.weight_sync.timeout_s))
        except EngineCallError as exc:
            found = exc.engine_message.replace("check tensor equality failed:", "").strip().splitlines()
            shown = "; ".join(found[:3]) + (f"; and {len(found) - 3} more" if len(found) > 3 else "")
            raise EngineCallError(
                exc.url, exc.path, f"weights differ after the first push: {shown}"
            ) from None
        logger.info("--check-weight-update-equal: every engine's weights equal its checkpoint after the push")

    def _register_external(self, addr: str) -> str:
        """An engine slime did not start, added to the router once checked. It is updated with the
        others but never stopped; the router forgets it when the run ends."""
        url = external_engine_url(addr, self.weight_sync)
        ray.get(self.rollout.register_engine.remote(url))
        return url

    def hand_gpus_to_trainer(self) -> None:
        """--colocate, after generating: the engines free their GPU memory, the trainer takes it back."""
        if not self._colocated():
            return
        self._engine_memory(memory.release, self._released_by_engines())
        assert self.trainer is not None  # _colocated()
        self.trainer.onload(["weights", "train_state"])

    def _released_by_engines(self) -> list[str]:
        """What colocated engines give back while the trainer trains: with LoRA the KV cache only, as
        the base they serve never changes and is never sent again (``--lora-train-only`` too)."""
        return ["kv_cache"] if self.weight_sync.lora.enabled else ["weights", "kv_cache"]

    def hand_gpus_to_engines(self) -> None:
        """--colocate, after the weight push: the trainer's state leaves its GPU and the engines take their
        memory back (the weights' part was resumed by the push, which loads them in place; the KV cache
        comes last, once the trainer's weights are gone)."""
        if not self._colocated():
            return
        assert self.trainer is not None  # _colocated()
        self.trainer.offload(["train_state", "weights"])
        self._engine_memory(memory.resume, ["weights", "kv_cache"])
        self._rejoin_router()

    def _colocated(self) -> bool:
        return self.colocate and self.trainer is not None and self.uses_engines

    def pause_for_push(self) -> None:
        """Before training, once nothing generates until the push (the synchronous loop: at once; the
        overlapped one: when the rollout ahead is done): the engines pause for the coming push while
        the trainer trains; ``push_weights`` waits for it. Does not block, unless nothing generated
        since the last push (``--load-debug-rollout-data``): then it waits for that push's resume. Not
        under ``--colocate`` (the engines have released their memory) or ``--use-fault-tolerance`` (the
        push first looks up which engines are up). A traced quickstart push then starts with the
        sessions' begin (≈ 2 ms) instead of the pause and the begin (≈ 6.6 ms; overlapped quickstart:
        3.9 ms of a 17 ms push)."""
        early = self.uses_engines and self.trainer is not None and self._pausing is None
        if early and not self.colocate and not self.fault_tolerant:
            self.engines_resumed()  # the pause must not overtake the last push's resume
            self._pausing = self.rollout.pause.remote(mode="abort")

    def push_weights(self, version: int) -> dict[str, float]:
        """Trainer weights to every engine; their ``weight_version`` becomes ``version`` (the loop
        counts it: ``RolloutLoop.version``), which every generated sample records.

        Generation is paused around the update (nothing runs in the synchronous loop, but a request
        must never decode with half-updated weights); the last bucket flushes the engines' caches.
        The distributed and tensor transports run inside one weight-update session per engine
        (SGLang >= 0.5.21), opened here once for all trainer ranks and pipeline stages. When the
        update fails, its error is the one raised: the clean-up after it only logs.

        After a push that succeeded the engines resume while the caller goes on (the overlapped
        quickstart: 2.6 ms of each step): whatever next asks them to generate waits for it first
        (``engines_resumed``); an engine's request arriving before the resume would wait on the engine
        anyway, as SGLang holds requests while paused. Not under ``--colocate`` or
        ``--use-fault-tolerance``, whose pushes end with more calls to the engines.
        """
        if not self.uses_engines or self.trainer is None:
            return {}
        self.engines_resumed()  # a pause must not overtake the last push's resume
        if self.fault_tolerant:
            self._follow_restarted_engines()
        pausing, self._pausing = self._pausing or self.rollout.pause.remote(mode="abort"), None
        ray.get(pausing)
        control.pause(self.external_urls, "abort", self.weight_sync.timeout_s)
        failed = True
        try:
            if self.colocate:
                # The optimizer state leaves first, the engines take their weights' memory back, and
                # the weights are handed over from the trainer's GPU (``hand_gpus_to_engines`` follows).
                self.trainer.offload(["train_state"])
                self._engine_memory(memory.resume, ["weights"])
            metrics = self._update_in_session(version)
            failed = False
        finally:
            try:
                resuming = self.rollout.resume.remote()
                if failed or self.colocate or self.fault_tolerant:
                    ray.get(resuming, timeout=None if not failed else ERROR_PATH_TIMEOUT_S)
                else:
                    self._resuming = resuming
                control.resume(self.external_urls, self.weight_sync.timeout_s)
            except Exception as exc:
                if not failed:
                    raise
                logger.warning("resuming generation after the failed weight push: %s", exc)
        self._pushed_to = list(self.engine_urls)
        if not self._colocated():  # under --colocate the engines generate once their KV cache is back
            self._rejoin_router()
        return metrics

    def engines_resumed(self) -> None:
        """Waits for the resume the last push sent on; raises its error (an engine that failed to
        resume). Called before anything generates: a rollout, an evaluation."""
        resuming = self._resuming
        if resuming is not None:
            ray.get(resuming)
            if self._resuming is resuming:  # the loop's thread and the rollouts-ahead thread both call it
                self._resuming = None

    def _rejoin_router(self) -> None:
        """--use-fault-tolerance: engines restarted since the last push have the weights now and
        generate again (resumed, memory back): they rejoin the router."""
        if self.fault_tolerant and self._pushed_to:
            ray.get(self.rollout.rejoin_router.remote(self._pushed_to))
        self._pushed_to = []

    def _follow_restarted_engines(self) -> None:
        """--use-fault-tolerance: a restarted engine has a new URL; the trainer reconnects to the engines
        up before the push (its groups with a dead one are dropped)."""
        urls = ray.get(self.rollout.serving_engine_urls.remote(check=True))
        if urls != self.engine_urls:
            logger.info("engines now at %s; reconnecting the trainer", urls)
            self.engine_urls = urls
            assert self.trainer is not None  # push_weights: only with a trainer
            self.trainer.connect_engines(urls + self.external_urls)

    def _update_in_session(self, version: int) -> dict[str, float]:
        urls = self.engine_urls + self.external_urls
        # Weight-update sessions wrap parameter updates; adapter loads and disk loads need none.
        in_session = [] if self.weight_sync.transport == "disk" or self.weight_sync.lora.enabled else urls
        assert self.trainer is not None  # push_weights: only with a trainer
        with weight_update_session(in_session, self.weight_sync.timeout_s):
            return self.trainer.update_weights(str(version))

    def _engine_memory(self, call: MemoryCall, tags: list[str]) -> None:
        """Releases (or resumes) ``tags`` on this run's engines; resuming only what was released.

        The engines' health probes pause while anything is released (a probe generates) and resume
        once all is back. Under ``--use-fault-tolerance`` the engines up now are asked (a restart moves
        an engine to a new URL); one that fails meanwhile is the monitor's to find."""
        releasing = call is memory.release
        if not releasing:
            tags = [tag for tag in tags if tag in self._released]
            if not tags:
                return
        if releasing and not self._released:
            ray.get(self.rollout.pause_health_checks.remote())
        urls = self.engine_urls
        if self.fault_tolerant and self.rollout is not None:
            urls = ray.get(self.rollout.serving_engine_urls.remote())
        for url, exc in call(urls, tags, self.weight_sync.timeout_s):
            if not self.fault_tolerant:
                raise exc
            path = memory.RELEASE_PATH if releasing else memory.RESUME_PATH
            logger.warning("%s on %s failed (%s); the health monitor takes it from here", path, url, exc)
        if releasing:
            self._released.update(tags)
        else:
            self._released.difference_update(tags)
            if not self._released:
                ray.get(self.rollout.resume_health_checks.remote())

    def close(self) -> None:
        """Stops everything that was started, in reverse order; safe after a partial start."""
        if self.trainer is not None:
            self.trainer.shutdown()
            self.trainer = None
        if self.rollout is not None:
            try:
                ray.get(self.rollout.shutdown.remote(), timeout=120)
            except Exception as exc:  # the manager died: its engines die with their actors below
                logger.warning("rollout manager shutdown failed: %s", exc)
            ray.kill(self.rollout)
            self.rollout = None
        if self.pg is not None:
            release_placement_group(self.pg)
            self.pg = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
