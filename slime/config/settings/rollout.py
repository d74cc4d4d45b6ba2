"""How a run generates and scores its rollouts: sampling, batching, rewards, filters, the engines.

The rollout manager and the default rollout function read these; a user's rollout, generate, reward
or filter function still receives the namespace (``plugin_args``), holding the same values.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from slime.config.engine_backend import resolve_backend
from slime.config.settings.distillation import OpdSettings
from slime.config.settings.flags import read_flags
from slime.config.settings.lora import LoraSettings, engine_server_args
from slime.config.settings.router import RouterSettings


@dataclass(frozen=True, kw_only=True)
class SamplingSettings:
    """The engine's sampling parameters of a rollout request (an eval set overrides the first four)."""

    temperature: float
    """``--rollout-temperature``."""
    top_p: float
    top_k: int
    max_response_len: int
    """``--rollout-max-response-len``: the token budget of a whole (multi-turn) response."""
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    skip_special_tokens: bool = False
    seed: int = 42
    """``--rollout-seed``: each request's own ``sampling_seed`` derives from it and the sample."""
    seed_per_sample: bool = False
    """``--rollout-seed-per-sample``: one seeded request per sample instead of one batch per group."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SamplingSettings:
        return cls(
            temperature=args.rollout_temperature,
            top_p=args.rollout_top_p,
            top_k=args.rollout_top_k,
            max_response_len=args.rollout_max_response_len,
            stop=tuple(args.rollout_stop or ()),
            stop_token_ids=tuple(args.rollout_stop_token_ids or ()),
            skip_special_tokens=bool(args.rollout_skip_special_tokens),
            seed=args.rollout_seed,
            seed_per_sample=bool(args.rollout_seed_per_sample),
        )


@dataclass(frozen=True, kw_only=True)
class BatchSettings:
    rollout_batch_size: int
    """``--rollout-batch-size``: prompt groups a rollout keeps."""
    n_samples_per_prompt: int
    over_sampling_batch_size: int
    """``--over-sampling-batch-size`` (default: the batch size): prompt groups drawn at a time."""
    concurrency: int
    """Samples in flight at most: ``--sglang-server-concurrency`` per engine."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BatchSettings:
        num_engines = max(1, (args.rollout_num_gpus or 1) // args.rollout_num_gpus_per_engine)
        return cls(
            rollout_batch_size=args.rollout_batch_size,
            n_samples_per_prompt=args.n_samples_per_prompt,
            over_sampling_batch_size=args.over_sampling_batch_size or args.rollout_batch_size,
            concurrency=args.sglang_server_concurrency * num_engines,
        )


@dataclass(frozen=True, kw_only=True)
class RewardSettings:
    reward_key: str | None = None
    """``--reward-key``: the entry of a dict reward that trains."""
    rm_type: str | None = None
    """``--rm-type``: a built-in reward function."""
    custom_rm_path: str | None = None
    """``--custom-rm-path``: a reward plugin ``fn(args, sample)``; wins over ``rm_type``."""
    group_rm: bool = False
    """``--group-rm``: ``custom_rm_path`` scores whole prompt groups."""
    rm_url: str | None = None
    custom_rm_model_path: str | None = None
    """``--custom-rm-model-path``: a reward model scoring batches of ``rm_batch_size`` samples."""
    rm_batch_size: int | None = None
    custom_reward_post_process_path: str | None = None
    """``--custom-reward-post-process-path``: upstream's ``fn(args, samples) -> (raw_rewards, rewards)``."""
    max_failed_reward_rollouts: int = 3
    """``--max-failed-reward-rollouts``: rollouts in a row with failed rewards before the run stops."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RewardSettings:
        # a plugin's hand-built namespace (upstream's tests build them) may predate the post-process flag
        post_process = getattr(args, "custom_reward_post_process_path", None)
        return read_flags(cls, args, custom_reward_post_process_path=post_process)


def routing_replay_server_args(args: argparse.Namespace) -> dict[str, object]:
    """``--use-rollout-routing-replay``: the engines keep each token's routed experts and return them to
    a request that asks (SGLang's ``--enable-return-routed-experts``; the torch engine takes it too)."""
    return {"enable_return_routed_experts": True} if args.use_rollout_routing_replay else {}


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """What an engine server is started with (``slime.backends.*.launcher``)."""

    backend: str
    """``--rollout-backend``, resolved once: ``sglang`` or ``torch``."""
    hf_checkpoint: str
    seed: int
    """``--rollout-seed``: engine ``k`` gets ``--random-seed seed + k``."""
    server_args: tuple[tuple[str, object], ...] = ()
    """The ``--sglang-*`` flags, as (snake_case name, value) pairs, after the LoRA flags slime derives
    from ``--lora-*`` (``engine_server_args``) and R3's (``routing_replay_server_args``)."""
    torch_engine_sglang_release: str = ""
    """``--torch-engine-sglang-release``: the SGLang protocol the torch engine speaks."""
    num_gpus: int = 0
    """``--rollout-num-gpus``."""
    num_gpus_per_engine: int = 1
    num_gpus_per_node: int = 8
    colocate: bool = False
    """``--colocate``: the engines release their memory between rollouts (``--enable-memory-saver``)."""
    log_level: str = "info"
    """``--log-level``, the engines' unless an ``--sglang-log-level`` says otherwise."""

    @property
    def num_engines(self) -> int:
        return max(1, (self.num_gpus or 1) // self.num_gpus_per_engine)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineSettings:
        derived = {**engine_server_args(LoraSettings.from_args(args)), **routing_replay_server_args(args)}
        return cls(
            backend=resolve_backend(args.rollout_backend),
            hf_checkpoint=args.hf_checkpoint,
            seed=args.rollout_seed,
            server_args=tuple({**derived, **(args.sglang_server_args or {})}.items()),
            torch_engine_sglang_release=args.torch_engine_sglang_release,
            num_gpus=args.rollout_num_gpus or 0,
            num_gpus_per_engine=args.rollout_num_gpus_per_engine,
            num_gpus_per_node=args.num_gpus_per_node,
            colocate=bool(args.colocate),
            log_level=str(args.log_level).lower(),
        )


@dataclass(frozen=True, kw_only=True)
class RolloutSettings:
    sampling: SamplingSettings
    batch: BatchSettings
    reward: RewardSettings
    engine: EngineSettings
    router: RouterSettings
    rollout_function_path: str
    """``--rollout-function-path``: ``fn(args, rollout_id, data_source, evaluation)``, called per rollout."""
    custom_generate_function_path: str | None = None
    """``--custom-generate-function-path``: replaces the default per-sample (or per-group) generate."""
    dynamic_sampling_filter_path: str | None = None
    """``--dynamic-sampling-filter-path``: ``fn(args, group)`` keeps a finished group or drops it."""
    partial_rollout: bool = False
    """``--partial-rollout``: aborted groups go back to the data source with their partial responses."""
    mask_offpolicy_in_partial_rollout: bool = False
    use_rollout_logprobs: bool = False
    """``--use-rollout-logprobs``: every trained sample must carry the engine's log-probs."""
    max_turns: int = 8
    """``--max-turns``: for multi-turn generate functions."""
    routed_experts_shape: tuple[int, int] | None = None
    """``--use-rollout-routing-replay``: every trained sample carries the experts the engine routed its
    tokens to (``slime.rollout.train_data``), rows of ``(--num-layers, --moe-router-topk)``; None: off."""
    opd: OpdSettings = field(default_factory=OpdSettings)
    """``--use-opd``: the teachers that score each sample's tokens (``slime.rollout.teacher``)."""
    teacher_engine: EngineSettings | None = None
    """``--opd-teacher-hf-checkpoint``: the engines the run starts for the teacher (its checkpoint, its
    GPUs; the user's ``--sglang-*`` flags but none slime derives for the student: no LoRA, no routes)."""
    kept_positions: int = 1
    """Data positions kept for a stopping run's checkpoint: ``--async-buffer-size`` + 1 rollouts
    may have begun past the last one trained (``slime.rollout.data_source.KeptPositions``)."""

    @property
    def routing_replay(self) -> bool:
        return self.routed_experts_shape is not None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RolloutSettings:
        return cls(
            sampling=SamplingSettings.from_args(args),
            batch=BatchSettings.from_args(args),
            reward=RewardSettings.from_args(args),
            engine=(engine := EngineSettings.from_args(args)),
            router=RouterSettings.from_args(args),
            rollout_function_path=args.rollout_function_path,
            custom_generate_function_path=args.custom_generate_function_path,
            dynamic_sampling_filter_path=args.dynamic_sampling_filter_path,
            partial_rollout=bool(args.partial_rollout),
            mask_offpolicy_in_partial_rollout=bool(args.mask_offpolicy_in_partial_rollout),
            use_rollout_logprobs=bool(args.use_rollout_logprobs),
            max_turns=args.max_turns,
            routed_experts_shape=(
                (int(args.num_layers), int(args.moe_router_topk)) if args.use_rollout_routing_replay else None
            ),
            opd=(opd := OpdSettings.from_args(args)),
            teacher_engine=teacher_engine_settings(args, engine, opd) if opd.teacher_gpus else None,
            kept_positions=args.async_buffer_size + 1,
        )


def teacher_engine_settings(
    args: argparse.Namespace, student: EngineSettings, opd: OpdSettings
) -> EngineSettings:
    """The OPD teacher's engines: the student engines' backend and the user's ``--sglang-*`` flags on the
    teacher's checkpoint and GPUs, without what slime derives for the student (LoRA serving, routes)."""
    assert opd.teacher_hf_checkpoint is not None  # only called with a teacher to start
    return dataclasses.replace(
        student,
        hf_checkpoint=opd.teacher_hf_checkpoint,
        server_args=tuple((args.sglang_server_args or {}).items()),
        num_gpus=opd.teacher_gpus,
        num_gpus_per_engine=opd.teacher_gpus_per_engine,
        colocate=False,
    )
