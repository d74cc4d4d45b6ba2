"""The engine behind the HTTP layer: builds requests, owns the model's weights, memory state and
weight-update sessions; its weight-update groups are ``update_groups.WeightUpdateGroups``.

Threads: the scheduler thread runs every forward and every change to the model (weight loads, memory
release) through `Scheduler.call`, so they happen between decode steps; blocking collectives (joining
a group, receiving broadcast tensors) run on the groups' own one-thread executor, so decoding
continues while the trainer sends, and only the final copy into the parameters pauses generation.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Any

import torch

from slime.backends.torch_engine import lora, protocol, weights
from slime.backends.torch_engine.model_runner import ModelRunner
from slime.backends.torch_engine.protocol import GenerateInput, ProtocolError
from slime.backends.torch_engine.request import Request
from slime.backends.torch_engine.routed_experts import RoutedExpertsCapture
from slime.backends.torch_engine.sampling import RowSampling
from slime.backends.torch_engine.scheduler import Scheduler
from slime.backends.torch_engine.server_args import ServerArgs
from slime.backends.torch_engine.update_groups import WeightUpdateGroups
from slime.backends.torch_engine.vision import VisionProcessor
from slime.backends.torch_engine.weight_checker import WeightChecker

logger = logging.getLogger(__name__)

# SGLang sizes this from free GPU memory (thousands for a small model); the slot KV cache here grows
# on demand, so the default only has to hold a typical rollout's requests in one running batch.
DEFAULT_MAX_RUNNING_REQUESTS = 256
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
MAX_EVENTS = 256


def pick_device(args: ServerArgs) -> torch.device:
    name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was requested but CUDA is not available")
        return torch.device("cuda", args.base_gpu_id)
    return torch.device("cpu")


class TorchEngine:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        if args.random_seed is not None:
            torch.manual_seed(args.random_seed)
        self.device = pick_device(args)
        self.max_running_requests = args.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS
        self.runner = ModelRunner(
            args.model_path,
            args.tokenizer_path,
            self.device,
            args.dtype,
            max_rows=self.max_running_requests,
            context_length=args.context_length,
            trust_remote_code=args.trust_remote_code,
        )
        self.model_path = self.runner.model_path
        self.context_length = self.runner.context_length
        self.scheduler = Scheduler(
            self.runner, self.max_running_requests, args.max_total_tokens, args.random_seed
        )
        self.scheduler.weight_version = args.weight_version
        self.lora: lora.LoraManager | None = None
        if args.enable_lora or (args.enable_lora is None and args.lora_paths):
            settings = lora.lora_settings(
                args.max_lora_rank,
                args.lora_target_modules,
                args.max_loras_per_batch,
                args.max_loaded_loras,
                args.lora_paths,
            )
            self.lora = lora.LoraManager(self.runner.model, settings, self.runner.vocab_size)
            self.runner.lora = self.lora
            self.scheduler.lora_batch_fits = self.lora.batch_fits
        if args.enable_return_routed_experts:
            text_config = self.runner.config.get_text_config()
            self.runner.routes = RoutedExpertsCapture(self.runner.model, text_config)
        renames = weights.checkpoint_renames(self.runner.model) if self.runner.is_vlm else None
        self.weights = weights.WeightStore(self.runner.model, renames)
        self.weight_checker = WeightChecker(self.runner.model)
        self.release = protocol.release(args.sglang_release)
        self.vision = (
            VisionProcessor(
                self.runner.model_path,
                self.runner.model,
                self.runner.tokenizer,
                self.release.multimodal_0_5_23,
            )
            if self.runner.is_vlm
            else None
        )
        self.update_groups = WeightUpdateGroups(self.device)
        self.weight_session: str | None = None  # the open session's selector (SGLang >= 0.5.21)
        self.released: set[str] = set()
        self.generations_while_released = 0
        # Memory releases/resumes and weight loads in the order they happened (newest last), reported
        # by /get_server_info as `memory_events`: the colocated schedule is checked against it.
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_EVENTS)
        self.shutting_down = False

    def start(self) -> None:
        self.scheduler.start()

    def record(self, event: str, **fields: Any) -> None:
        self.events.append({"event": event, "at": time.time(), **fields})

    # ---- requests -------------------------------------------------------------------------------

    def refuse_generation(self, what: str) -> str | None:
        """Why ``what`` (a request or a health check) must answer 503 now, or None.

        A generation reaching an engine whose memory is released is slime's bug, not the caller's: on
        SGLang it would run on freed GPU memory. It is logged and counted (``generations_while_released``
        in ``/get_server_info``) so that a test can assert none ever arrives.
        """
        if self.shutting_down:
            return "the server is shutting down"
        if self.released:
            self.generations_while_released += 1
            logger.warning(
                "%s reached the engine while its memory is released (%s)", what, sorted(self.released)
            )
            return (
                f"memory occupation released (tags: {sorted(self.released)}); "
                "call /resume_memory_occupation before generating"
            )
        return None

    def build_request(self, gen: GenerateInput) -> Request:
        """Tokenize and validate one request against the context length; raises ProtocolError (400)."""
        tokenizer = self.runner.tokenizer
        images = None
        if gen.image_data is not None:
            if self.vision is None:
                raise ProtocolError(protocol.MULTIMODAL_UNSUPPORTED)
            ids, images = self.vision.prepare(gen.text, gen.input_ids, gen.image_data)
        else:
            ids = gen.input_ids if gen.input_ids is not None else tokenizer(gen.text)["input_ids"]
        if not ids:
            raise ProtocolError("The input is empty (no tokens).")
        if min(ids) < 0 or max(ids) >= self.runner.vocab_size:
            raise ProtocolError(
                f"input_ids must be in [0, {self.runner.vocab_size}), got {min(ids)}..{max(ids)}"
            )
        params = gen.params
        if len(ids) >= self.context_length:
            raise ProtocolError(
                f"The input ({len(ids)} tokens) is longer than the model's context length "
                f"({self.context_length} tokens)."
            )
        if params.explicit_max_new_tokens and params.max_new_tokens + len(ids) > self.context_length:
            raise ProtocolError(
                f"Requested token count exceeds the model's maximum context length of {self.context_length} "
                f"tokens. You requested a total of {params.max_new_tokens + len(ids)} tokens: {len(ids)} "
                f"tokens from the input messages and {params.max_new_tokens} tokens for the completion. "
                "Please reduce the number of tokens in the input messages or the completion to fit within "
                "the limit."
            )
        # The scheduler's own bound (init_req_max_new_tokens, 0.5.19-0.5.23): max_req_len - input - 1
        # with max_req_len = context_length - 1.
        max_new = max(0, min(params.max_new_tokens, self.context_length - len(ids) - 2))
        budget = self.args.max_total_tokens
        if budget is not None and len(ids) + max_new > budget:
            raise ProtocolError(
                f"the request needs {len(ids) + max_new} tokens (prompt + max_new_tokens) but "
                f"--max-total-tokens is {budget}"
            )
        if gen.return_logprob and gen.logprob_start_len > len(ids):
            raise ProtocolError(
                f"logprob_start_len={gen.logprob_start_len} is higher than the number of input tokens "
                f"{len(ids)}."
            )
        if gen.return_routed_experts:
            protocol.check_routed_experts_start(gen.routed_experts_start_len, len(ids))
        routes = None
        if gen.return_routed_experts and self.runner.routes is not None:
            capture = self.runner.routes
            routes = torch.zeros((len(ids) + 1, capture.num_layers, capture.topk), dtype=torch.int32)
        generator = None
        if params.sampling_seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.sampling_seed % (2**63))
        stop_set = set(params.stop_token_ids) | self.runner.eos_token_ids
        tail = 0
        if params.stop:
            tail = max(len(tokenizer.encode(s, add_special_tokens=False)) for s in params.stop) + 1
        return Request(
            rid=gen.rid,
            input_ids=list(ids),
            params=params,
            max_new_tokens=max_new,
            return_logprob=gen.return_logprob,
            logprob_start_len=gen.logprob_start_len,
            return_text_in_logprobs=gen.return_text_in_logprobs,
            sampling=RowSampling(params.temperature, params.top_p, params.top_k, params.min_p, generator),
            stop_ids=frozenset() if params.ignore_eos else frozenset(stop_set),
            banned_until_min=sorted(stop_set) if params.min_new_tokens > 0 else [],
            stop_tail_tokens=tail,
            images=images,
            routes=routes,
            routed_experts_start_len=gen.routed_experts_start_len,
        )

    # ---- info -----------------------------------------------------------------------------------

    @property
    def weight_version(self) -> str:
        return self.scheduler.weight_version

    def model_info(self) -> dict[str, Any]:
        config = self.runner.config
        return {
            "model_path": self.model_path,
            "served_model_name": self.args.served_model_name or self.model_path,
            "tokenizer_path": self.runner.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None),
        }

    def models(self) -> dict[str, Any]:
        """``/v1/models``: SGLang's ``ModelList`` of one ``ModelCard`` whose ``max_model_len`` is the
        context length its tokenizer manager checks requests against (what clients cap by)."""
        name = self.args.served_model_name or self.model_path
        card = {
            "id": name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": name,
            "parent": None,
            "max_model_len": self.context_length,
        }
        cards = [card]
        for adapter in self.lora.registry.values() if self.lora is not None else []:
            # SGLang lists each loaded adapter as a model whose parent is the served model.
            cards.append(
                {**card, "id": adapter.name, "root": adapter.path, "parent": name, "max_model_len": None}
            )
        return {"object": "list", "data": cards}

    def server_info(self) -> dict[str, Any]:
        info = dataclasses.asdict(self.args)
        info.pop("ignored")
        info.update(
            model_path=self.model_path,
            tokenizer_path=self.runner.tokenizer_path,
            context_length=self.context_length,
            max_running_requests=self.max_running_requests,
            device=str(self.device),
            dtype=str(self.runner.dtype).removeprefix("torch."),
            weight_version=self.weight_version,
            ignored_server_args=self.args.ignored,
            internal_states=[self.scheduler.internal_state()],
            memory_events=list(self.events),
            generations_while_released=self.generations_while_released,
            version=self.release.version,
            engine="slime.backends.torch_engine",
        )
        return info

    # ---- control (run on the scheduler thread through Scheduler.call) ---------------------------

    def flush_cache(self) -> tuple[bool, str]:
        """Refused while requests run, as SGLang refuses it. SGLang's flush empties its radix cache and
        frees every KV slot, but keeps the pool it allocated at start-up (``Scheduler.flush_cache`` in
        ``srt/managers/scheduler.py`` of 0.5.19 and 0.5.23: ``tree_cache.reset()`` and the allocators'
        ``clear()``, no pool freed); here no slot outlives its request, so an idle engine has nothing
        to free, and the buffers stay for the next batch (allocating and zeroing them again after every
        weight push cost 5-7 ms per quickstart rollout). Only ``release_memory_occupation`` of
        ``kv_cache`` frees them."""
        if not self.scheduler.is_idle():
            return False, "Cache not flushed: there are running or waiting requests.\n"
        return True, "Cache flushed.\n"

    def release_memory(self, tags: list[str] | None) -> None:
        tags = list(tags or MEMORY_TAGS)
        unknown = [t for t in tags if t not in MEMORY_TAGS]
        if unknown:
            raise ProtocolError(f"unknown memory tags {unknown}; use {list(MEMORY_TAGS)}")
        self.scheduler.abort_all("memory occupation released")
        if "kv_cache" in tags:
            self.runner.cache.clear()
        if "weights" in tags:
            self.weights.release()
            self.update_groups.release_buffers()
        self.released.update(t for t in tags if t != "cuda_graph")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the freed blocks back to the driver, for the trainer
        self.record("release_memory_occupation", tags=tags)

    def resume_memory(self, tags: list[str] | None) -> None:
        tags = list(tags or MEMORY_TAGS)
        unknown = [t for t in tags if t not in MEMORY_TAGS]
        if unknown:
            raise ProtocolError(f"unknown memory tags {unknown}; use {list(MEMORY_TAGS)}")
        if "weights" in tags:
            self.weights.resume()
        self.released.difference_update(tags)
        self.record("resume_memory_occupation", tags=tags)

    def load_weights(
        self, named_tensors: list[tuple[str, torch.Tensor]], weight_version: str | None
    ) -> tuple[bool, str]:
        """Copy received tensors into the model between two forwards; all-or-nothing on bad names."""
        try:
            count = self.weights.load(named_tensors)
        except (ValueError, RuntimeError) as exc:
            return False, f"Failed to update weights: {exc}"
        if weight_version is not None:
            self.scheduler.weight_version = weight_version
        return True, f"Succeeded to update model weights ({count} tensors)."

    # ---- weight-update sessions (SGLang >= 0.5.21; run on the scheduler thread) -----------------
    # Mirrors ``WeightUpdater.begin_weight_update`` / ``end_weight_update`` and the session check of
    # ``update_weights_from_distributed`` / ``update_weights_from_tensor`` in SGLang 0.5.23's
    # ``srt/managers/scheduler_components/weight_updater.py`` (same messages).

    def begin_weight_update(self, selector: str) -> tuple[bool, str]:
        if self.weight_session is not None:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.weight_session = selector
        return True, "Success"

    def end_weight_update(self) -> tuple[bool, str]:
        if self.weight_session is None:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.weight_session = None
        return True, "Success"

    def outside_session(self, operation: str) -> str | None:
        """The refusal of ``operation`` outside a session, or None when it may run."""
        if self.release.weight_update_sessions and self.weight_session is None:
            return f"{operation} must run between begin_weight_update() and end_weight_update()"
        return None

    # ---- LoRA (SGLang's /load_lora_adapter, /load_lora_adapter_from_tensors, /unload_lora_adapter) -

    def acquire_adapters(self, names: list[str | None], as_list: bool) -> list[lora.Adapter | None]:
        """Each request's adapter (``lora_path``), on the scheduler thread; raises ProtocolError (400)."""
        if not any(names):
            return [None] * len(names)
        if self.lora is None:
            first = next(n for n in names if n)
            raise ProtocolError(
                f"LoRA adapter '{first}' was requested, but LoRA is not enabled. "
                "Please launch the server with --enable-lora flag and preload adapters "
                "using --lora-paths or /load_lora_adapter endpoint."
            )
        try:
            return self.lora.acquire(names, as_list)
        except lora.LoraError as exc:
            raise ProtocolError(str(exc)) from exc

    def load_lora_adapter(self, name: str, path: str, pinned: bool) -> dict[str, Any]:
        if self.lora is None:
            return lora.update_output(False, lora.NOT_ENABLED, None)
        return self.lora.load_from_path(name, path, pinned)

    def load_lora_adapter_from_tensors(
        self,
        name: str,
        config_dict: dict[str, Any],
        tensors: dict[str, torch.Tensor],
        pinned: bool,
        added_tokens_config: dict[str, int] | None,
    ) -> dict[str, Any]:
        if self.lora is None:
            return lora.update_output(False, lora.NOT_ENABLED, None)
        return self.lora.load_from_tensors(name, config_dict, tensors, pinned, added_tokens_config)

    def unload_lora_adapter(self, name: str) -> dict[str, Any]:
        if self.lora is None:
            return lora.update_output(False, lora.NOT_ENABLED, None)
        return self.lora.unload(name)

    def shutdown(self) -> None:
        """Abort what is in flight, stop the scheduler, close the weight-update groups."""
        self.shutting_down = True
        self.scheduler.stop()
        self.update_groups.shutdown()
