"""Everything a training run starts, started in order and stopped in reverse, whatever happens.

``TrainingSession`` is a context manager: leaving it normally, by an exception or by Ctrl-C stops the
trainer actors, the engines, the router and the placement group, and shuts down the Ray cluster the
run started itself, so no process outlives the run.
"""

from __future__ import annotations

import argparse
import logging
import signal
from types import FrameType

import ray

from slime.config import uses_engines
from slime.ray.cluster import (
    bundle_order,
    create_placement_group,
    release_placement_group,
    start_ray,
    total_gpus,
    trainer_gpus,
)
from slime.ray.critic import critic_args, critic_gpus
from slime.ray.engines import external_engine_url
from slime.ray.trainer_group import TrainerGroup
from slime.weight_sync.engine_client import ERROR_PATH_TIMEOUT_S, post_all, weight_update_session
from slime.weight_sync.settings import WeightSyncSettings

logger = logging.getLogger("slime")


def _sigterm_to_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class TrainingSession:
    """Ray, one placement group, the rollout manager and the trainer group of one run."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.weight_sync = WeightSyncSettings.from_args(args)
        self.pg = None
        self.trainer: TrainerGroup | None = None
        self.rollout = None
        self.start_rollout_id = 0
        self.weight_version = 0
        self.engine_urls: list[str] = []
        self.external_urls: list[str] = []
        self._released: set[str] = set()  # memory tags this run's engines have released (--colocate)
        self._pausing: ray.ObjectRef | None = None  # the pause of the coming push, sent early
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
        from slime.ray.rollout_manager import RolloutManager, load_eval_datasets
        from slime.rollout.data_source import check_streaming_data, make_data_source, rollouts_for_epochs

        args = self.args
        # Read (and so check) the data before any process starts: a bad line is a one-line error.
        # --streaming-data: only the file's structure and first record here; the rollout manager
        # builds its own source from the path and this index (12 bytes a record), so the data never
        # travels to it.
        streaming = args.streaming_data and args.data_source_path is None
        data_source = None if streaming else make_data_source(args)
        index = check_streaming_data(args) if streaming else None
        sized = index if streaming else data_source
        if args.num_rollout is None:  # --num-epoch: the trainers' LR schedule needs the count up front
            args.num_rollout = rollouts_for_epochs(sized, args.num_epoch, args.rollout_batch_size)
            logger.info("--num-epoch %d: %d rollouts", args.num_epoch, args.num_rollout)
        eval_datasets = load_eval_datasets(args)
        self._owns_ray = not ray.is_initialized() and not args.ray_address
        start_ray(args)
        engines = uses_engines(args)
        num_trainers = trainer_gpus(args)
        num_critics = critic_gpus(args)
        self.pg = create_placement_group(total_gpus(args) if engines else num_trainers + num_critics)
        # Ranks in node and GPU order, so a tensor-parallel group or an engine never straddles nodes.
        order = bundle_order(self.pg, self.pg.bundle_count)
        trainer_bundles = order[:num_trainers]
        rollout_bundles = []
        if engines:
            first = 0 if args.colocate else num_trainers
            rollout_bundles = order[first : first + args.rollout_num_gpus]
        self.rollout = RolloutManager.options(num_cpus=0).remote(
            args,
            self.pg,
            rollout_bundles,
            data_source=data_source,
            prompt_index=index,
            eval_datasets=eval_datasets,
        )
        # PPO's critic takes the last bundles.
        critic_bundles = order[len(order) - num_critics :]
        critic = TrainerGroup(critic_args(args), self.pg, critic_bundles) if num_critics else None
        # --debug-rollout-only: generation alone, no trainer at all.
        self.trainer = TrainerGroup(args, self.pg, trainer_bundles, critic=critic) if num_trainers else None
        engine_urls_ref = self.rollout.start.remote()
        if args.colocate and self.trainer is not None:
            # The engines start on the GPUs first and hand their memory back before the trainer
            # builds its model there (as they would take their share of a GPU the trainer fills);
            # the first push takes the weights' part back, hand_gpus_to_engines the KV cache.
            engine_urls, _router_url = ray.get(engine_urls_ref)
            self.engine_urls = list(engine_urls)
            self._engine_memory("/release_memory_occupation", ["weights", "kv_cache"])
            loaded = self.trainer.init()
        else:  # engines load their weights while the trainer builds its model
            loaded = self.trainer.init() if self.trainer is not None else None
            engine_urls, _router_url = ray.get(engine_urls_ref)
        if loaded is not None:
            self.start_rollout_id = loaded + 1
            ray.get(self.rollout.load.remote(loaded))
            logger.info("resumed from %s at rollout %d", args.load, self.start_rollout_id)
        self.engine_urls = list(engine_urls)
        self.external_urls = [self._register_external(a) for a in args.rollout_external_engine_addrs or []]
        if engines and self.trainer is not None:
            urls = self.engine_urls + self.external_urls
            self.trainer.connect_engines(urls, self.weight_sync)

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
        self._engine_memory("/release_memory_occupation", ["weights", "kv_cache"])
        self.trainer.onload(["weights", "train_state"])

    def hand_gpus_to_engines(self) -> None:
        """--colocate, after the weight push: the trainer's state leaves its GPU and the engines take their
        memory back (the weights' part was resumed by the push, which loads them in place; the KV cache
        comes last, once the trainer's weights are gone)."""
        if not self._colocated():
            return
        self.trainer.offload(["train_state", "weights"])
        self._engine_memory("/resume_memory_occupation", ["weights", "kv_cache"])
        self._rejoin_router()

    def _colocated(self) -> bool:
        return bool(self.args.colocate) and self.trainer is not None and uses_engines(self.args)

    def pause_for_push(self) -> None:
        """The synchronous loop, before training: the engines pause for the coming push while the
        trainer trains, since nothing generates then; ``push_weights`` waits for it. Not under
        ``--colocate`` (the engines have released their memory) or ``--use-fault-tolerance`` (the push
        first looks up which engines are up). A traced quickstart push then starts with the
        sessions' begin (≈ 2 ms) instead of the pause and the begin (≈ 6.6 ms)."""
        args = self.args
        early = uses_engines(args) and self.trainer is not None and self._pausing is None
        if early and not args.colocate and not args.use_fault_tolerance:
            self._pausing = self.rollout.pause.remote(mode="abort")

    def push_weights(self, version: int | None = None) -> dict[str, float]:
        """Trainer weights to every engine; their ``weight_version`` becomes ``version`` (default: the
        number of pushes), which every generated sample records.

        Generation is paused around the update (nothing runs in the synchronous loop, but a request
        must never decode with half-updated weights); the last bucket flushes the engines' caches.
        The distributed and tensor transports run inside one weight-update session per engine
        (SGLang >= 0.5.21), opened here once for all trainer ranks and pipeline stages. When the
        update fails, its error is the one raised: the clean-up after it only logs.
        """
        if not uses_engines(self.args) or self.trainer is None:
            return {}
        self.weight_version = self.weight_version + 1 if version is None else version
        if self.args.use_fault_tolerance:
            self._follow_restarted_engines()
        pausing, self._pausing = self._pausing or self.rollout.pause.remote(mode="abort"), None
        ray.get(pausing)
        self._post_external("/pause_generation", {"mode": "abort"})
        failed = True
        try:
            if self.args.colocate:
                # The optimizer state leaves first, the engines take their weights' memory back, and
                # the weights are handed over from the trainer's GPU (``hand_gpus_to_engines`` follows).
                self.trainer.offload(["train_state"])
                self._engine_memory("/resume_memory_occupation", ["weights"])
            metrics = self._update_in_session()
            failed = False
        finally:
            try:
                ray.get(self.rollout.resume.remote(), timeout=None if not failed else ERROR_PATH_TIMEOUT_S)
                self._post_external("/continue_generation", {})
            except Exception as exc:
                if not failed:
                    raise
                logger.warning("resuming generation after the failed weight push: %s", exc)
        self._pushed_to = list(self.engine_urls)
        if not self._colocated():  # under --colocate the engines generate once their KV cache is back
            self._rejoin_router()
        return metrics

    def _rejoin_router(self) -> None:
        """--use-fault-tolerance: engines restarted since the last push have the weights now and
        generate again (resumed, memory back): they rejoin the router."""
        if self.args.use_fault_tolerance and self._pushed_to:
            ray.get(self.rollout.rejoin_router.remote(self._pushed_to))
        self._pushed_to = []

    def _follow_restarted_engines(self) -> None:
        """--use-fault-tolerance: a restarted engine has a new URL; the trainer reconnects to the engines
        up before the push (its groups with a dead one are dropped)."""
        urls = ray.get(self.rollout.serving_engine_urls.remote(check=True))
        if urls != self.engine_urls:
            logger.info("engines now at %s; reconnecting the trainer", urls)
            self.engine_urls = urls
            self.trainer.connect_engines(urls + self.external_urls, self.weight_sync)

    def _update_in_session(self) -> dict[str, float]:
        urls = self.engine_urls + self.external_urls
        in_session = urls if self.weight_sync.transport != "disk" else []
        with weight_update_session(in_session, self.weight_sync.timeout_s):
            return self.trainer.update_weights(str(self.weight_version))

    def _engine_memory(self, path: str, tags: list[str]) -> None:
        """Releases (or resumes) ``tags`` on this run's engines; resuming only what was released.

        The engines' health probes pause while anything is released (a probe generates) and resume
        once all is back. Under ``--use-fault-tolerance`` the engines up now are asked (a restart moves
        an engine to a new URL); one that fails meanwhile is the monitor's to find."""
        if path == "/resume_memory_occupation":
            tags = [tag for tag in tags if tag in self._released]
            if not tags:
                return
        releasing = path == "/release_memory_occupation"
        if releasing and not self._released:
            ray.get(self.rollout.pause_health_checks.remote())
        urls = self.engine_urls
        if self.args.use_fault_tolerance and self.rollout is not None:
            urls = ray.get(self.rollout.serving_engine_urls.remote())
        for url, reply in zip(
            urls, post_all(urls, path, {"tags": tags}, self.weight_sync.timeout_s), strict=True
        ):
            try:
                reply.result()
            except Exception as exc:
                if not self.args.use_fault_tolerance:
                    raise
                logger.warning("%s on %s failed (%s); the health monitor takes it from here", path, url, exc)
        if releasing:
            self._released.update(tags)
        else:
            self._released.difference_update(tags)
            if not self._released:
                ray.get(self.rollout.resume_health_checks.remote())

    def _post_external(self, path: str, payload: dict) -> None:
        for reply in post_all(self.external_urls, path, payload, self.weight_sync.timeout_s):
            reply.result()

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
