"""LoRA adapters served live, as SGLang 0.5.19-0.5.23 serve them over HTTP (``--enable-lora``).

What is SGLang's here (``srt/lora/lora_registry.py``, ``lora_manager.py``, ``lora.py``, ``utils.py``,
``srt/managers/tokenizer_control_mixin.py`` and ``tokenizer_manager.py``, ``srt/arg_groups/lora_hook.py``
of both releases; pinned by tests/unit/test_sglang_lora_contract.py):
- the registry: adapters by name, each load a new ``lora_id`` (so no cache entry of an earlier load
  is ever reused), LRU order for ``--max-loaded-loras`` eviction of unpinned adapters, and a cache of
  every name ever loaded, from which ``/generate`` reloads an unloaded adapter implicitly;
- the replies (``LoRAUpdateOutput``) and every error message;
- which modules an adapter may target: names are normalized as SGLang's ``get_normalized_target_modules``
  (q/k/v -> ``qkv_proj``, gate/up -> ``gate_up_proj``), an adapter must fit ``--max-lora-rank`` and the
  server's targets, and ``--max-loras-per-batch`` counts the base model as one adapter of a batch;
- tensor names: a PEFT name is placed by its decoder layer (``layers.<i>.``) and module path, as
  ``LoRAAdapter._process_weight`` does; stacked ``qkv_proj`` / ``gate_up_proj`` tensors (one A shared,
  B with the modules' rows) are accepted too; ``scaling = lora_alpha / r``.

What is this engine's own: the adapter is a forward hook on each targeted ``nn.Linear`` of the HF
model that adds ``scaling · B (A x)`` to the rows of the requests naming that adapter (no peft at
runtime); an unload takes effect at once for new requests, while requests already running finish
with the adapter they started with (SGLang makes the unload wait for them instead).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

# The ``lora_path`` SGLang records for an adapter loaded from tensors (``LoadLoRAAdapterFromTensorsReqInput``)
TENSOR_PATH = "__tensor__"
NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
# SGLang's normalization of target names (``get_normalized_target_modules``), for the linear layers of
# a decoder layer; the stacked names stand for these modules, in this order of their output rows.
STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
NORMALIZED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
    "q_a_proj": "fused_qkv_a_proj_with_mqa",
    "kv_a_proj_with_mqa": "fused_qkv_a_proj_with_mqa",
}
LINEAR_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "q_a_proj",
    "kv_a_proj_with_mqa",
    "q_b_proj",
    "kv_b_proj",
    "qkv_proj",
    "gate_up_proj",
)
"""SGLang's ``SUPPORTED_LORA_TARGET_MODULES`` that are a decoder layer's linear layers (the ones this
engine can serve; embeddings, lm_head and MoE experts are refused)."""
_PEFT_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")

Key = tuple[int, str]  # (decoder layer, module path inside it), e.g. (0, "self_attn.q_proj")


class LoraError(ValueError):
    """A load/unload/request refusal; its message is SGLang's."""


def normalized_targets(targets: str | list[str] | tuple[str, ...] | set[str]) -> set[str]:
    """SGLang's ``get_normalized_target_modules``: leaf names, stacked names for fused layers; the PEFT
    shorthands ``all`` / ``all-linear`` are ``{"all"}``."""
    if isinstance(targets, str):
        if targets not in ("all", "all-linear"):
            raise LoraError("Only 'all' or 'all-linear' can be used as the string for target module")
        return {"all"}
    names = {t.split(".")[-1] for t in targets}
    return {NORMALIZED.get(n, n) for n in names}


def _modules_of(normalized: set[str]) -> set[str]:
    """The leaf module names a set of normalized targets covers."""
    leaves: set[str] = set()
    for name in normalized:
        leaves.add(name)
        leaves.update(STACKED.get(name, ()))
        leaves.update(k for k, v in NORMALIZED.items() if v == name)
    return leaves


@dataclass(frozen=True)
class AdapterConfig:
    """The fields of a PEFT ``adapter_config.json`` SGLang reads (``LoRAConfig``)."""

    r: int
    lora_alpha: float
    target_modules: Any
    use_dora: bool = False

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> AdapterConfig:
        # Indexing, as SGLang's LoRAConfig does: a missing key fails with its name.
        return cls(
            r=int(config["r"]),
            lora_alpha=float(config["lora_alpha"]),
            target_modules=config["target_modules"],
            use_dora=bool(config.get("use_dora", False)),
        )

    @property
    def scaling(self) -> float:
        return self.lora_alpha / self.r


@dataclass(eq=False)
class Adapter:
    """One loaded adapter: per targeted module its ``A [r, in]`` and ``B [out, r]`` on the engine's device."""

    name: str
    path: str
    pinned: bool
    config: AdapterConfig
    weights: dict[Key, tuple[torch.Tensor, torch.Tensor]]
    lora_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def scaling(self) -> float:
        return self.config.scaling


def update_output(success: bool, error_message: str | None, loaded: dict[str, str] | None) -> dict[str, Any]:
    """SGLang's ``LoRAUpdateOutput`` as its HTTP server answers it (``msgspec_to_builtins``: the
    ``BaseReq`` fields ``rid`` and ``http_worker_ipc`` come first, both None)."""
    return {
        "rid": None,
        "http_worker_ipc": None,
        "success": success,
        "error_message": error_message,
        "loaded_adapters": loaded,
    }


def read_adapter_dir(path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``adapter_config.json`` and ``adapter_model.safetensors`` of a PEFT adapter directory."""
    from safetensors.torch import load_file

    directory = Path(path)
    if not directory.is_dir():
        raise LoraError(
            f"{path} is not a directory (the torch engine loads PEFT adapters from local directories)"
        )
    config = json.loads((directory / "adapter_config.json").read_text())
    weights = directory / "adapter_model.safetensors"
    if not weights.is_file():
        raise LoraError(f"{weights} does not exist (the torch engine reads safetensors adapters only)")
    return config, load_file(str(weights))


def tensor_checksum(tensor: torch.Tensor) -> str:
    """The sha256 SGLang compares ``expected_checksums`` with: the tensor's raw bytes, flattened."""
    data = tensor.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class LoraSettings:
    """The engine's LoRA flags after SGLang's start-up checks (``check_lora_server_args``)."""

    max_lora_rank: int
    target_modules: frozenset[str]  # normalized, or {"all"}
    max_loras_per_batch: int
    max_loaded_loras: int | None
    lora_paths: tuple[tuple[str, str, bool], ...]  # (name, path, pinned)


def parse_lora_paths(items: list[str] | None) -> list[tuple[str, str, bool]]:
    """``--lora-paths``: ``<PATH>`` | ``<NAME>=<PATH>`` | JSON ``{"lora_name", "lora_path", "pinned"}``."""
    parsed = []
    for item in items or []:
        if item.lstrip().startswith("{"):
            entry = json.loads(item)
            if "lora_name" not in entry or "lora_path" not in entry:
                raise LoraError(
                    "When providing LoRA paths as a list of dict, each dict should contain 'lora_name' and "
                    f"'lora_path' keys. Got: {entry}"
                )
            parsed.append((entry["lora_name"], entry["lora_path"], bool(entry.get("pinned", False))))
        elif "=" in item:
            name, path = item.split("=", 1)
            parsed.append((name, path, False))
        else:
            parsed.append((item, item, False))
    return parsed


def lora_settings(
    max_lora_rank: int | None,
    target_modules: list[str] | None,
    max_loras_per_batch: int,
    max_loaded_loras: int | None,
    lora_paths: list[str] | None,
) -> LoraSettings:
    """SGLang's checks of the LoRA flags; rank and targets default to those of ``--lora-paths``."""
    if max_loras_per_batch <= 0:
        raise LoraError("max_loras_per_batch must be positive")
    paths = parse_lora_paths(lora_paths)
    if not paths and not (max_lora_rank and target_modules):
        raise LoraError(
            "When no initial --lora-paths is provided, you need to specify both --max-lora-rank and "
            "--lora-target-modules for LoRA initialization."
        )
    if target_modules and "all" in target_modules and len(target_modules) != 1:
        raise LoraError(
            "If 'all' is specified in --lora-target-modules, it should be the only module specified."
        )
    if max_loaded_loras is not None:
        if max_loaded_loras < max_loras_per_batch:
            raise LoraError(
                "max_loaded_loras should be greater than or equal to max_loras_per_batch. "
                f"max_loaded_loras={max_loaded_loras}, max_loras_per_batch={max_loras_per_batch}"
            )
        if len(paths) > max_loaded_loras:
            raise LoraError(
                "The number of LoRA paths should not exceed max_loaded_loras. "
                f"max_loaded_loras={max_loaded_loras}, lora_paths={len(paths)}"
            )
    configs = [AdapterConfig.from_dict(read_adapter_dir(path)[0]) for _, path, _ in paths]
    rank = max_lora_rank or max(c.r for c in configs)
    if target_modules:
        targets = {"all"} if target_modules == ["all"] else normalized_targets(target_modules)
    else:
        targets = set().union(*(normalized_targets(c.target_modules) for c in configs))
    unsupported = sorted(
        t for t in targets if t != "all" and t not in {NORMALIZED.get(n, n) for n in LINEAR_TARGETS}
    )
    if unsupported:
        raise LoraError(f"the torch engine serves LoRA on decoder linear layers only, not on {unsupported}")
    return LoraSettings(rank, frozenset(targets), max_loras_per_batch, max_loaded_loras, tuple(paths))


class LoraManager:
    """Adapters by name, the hooks that apply them, and SGLang's rules for loading and batching.

    Every method runs on the scheduler thread (loads and unloads happen between two forwards)."""

    def __init__(self, model: nn.Module, settings: LoraSettings, vocab_size: int) -> None:
        self.settings = settings
        self.vocab_size = vocab_size
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        # The text decoder only (a VLM's vision tower has layers of its own): ``layers.<i>.<path>``.
        get_decoder = getattr(model, "get_decoder", None)
        decoder: nn.Module = get_decoder() if callable(get_decoder) else model
        leaves = (
            set(LINEAR_TARGETS)
            if "all" in settings.target_modules
            else _modules_of(set(settings.target_modules))
        )
        self.modules: dict[Key, nn.Linear] = {}
        for name, module in decoder.named_modules():
            match = re.match(r"(?:.*\.)?layers\.(\d+)\.(.+)$", name)
            if (
                match
                and isinstance(module, nn.Linear)
                and name.split(".")[-1] in leaves
                and ".experts." not in name
            ):
                key = (int(match.group(1)), match.group(2))
                self.modules[key] = module
                module.register_forward_hook(self._hook(key))
        if not self.modules:
            raise LoraError(
                f"--lora-target-modules {sorted(settings.target_modules)} match no linear layer of the model"
            )
        # SGLang's two views: the tokenizer's registry (name -> adapter, LRU order; the repr of its keys
        # is in messages) and the backend's loaded adapters (insertion order, in replies).
        self.registry: collections.OrderedDict[str, Adapter] = collections.OrderedDict()
        self.loaded: dict[str, Adapter] = {}  # lora_id -> adapter
        self.ever_loaded: dict[str, tuple[str, bool]] = {}  # name -> (path, pinned): implicit reloads
        self._rows: list[tuple[torch.Tensor, Adapter]] = []
        for name, path, pinned in settings.lora_paths:
            result = self.load_from_path(name, path, pinned)
            if not result["success"]:
                raise LoraError(f"Failed to load LoRA adapter {name}: {result['error_message']}")

    # ---- forward --------------------------------------------------------------------------------

    def _hook(self, key: Key) -> Callable[[nn.Module, tuple[Any, ...], torch.Tensor], torch.Tensor]:
        def add_delta(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
            for rows, adapter in self._rows:
                weights = adapter.weights.get(key)
                if weights is None:
                    continue
                a, b = weights
                x = args[0].index_select(0, rows)
                output.index_add_(0, rows, (x @ a.T) @ b.T * adapter.scaling)
            return output

        return add_delta

    @contextlib.contextmanager
    def rows(self, adapters: list[Adapter | None] | None) -> Iterator[None]:
        """Apply each row's adapter (None: the base model) during the forward inside."""
        groups: dict[Adapter, list[int]] = {}
        for row, adapter in enumerate(adapters or []):
            if adapter is not None:
                groups.setdefault(adapter, []).append(row)
        self._rows = [(torch.tensor(r, device=self.device), a) for a, r in groups.items()]
        try:
            yield
        finally:
            self._rows = []

    def batch_fits(self, lora_ids: set[str | None]) -> bool:
        """SGLang's ``validate_lora_batch``: at most ``--max-loras-per-batch`` adapters, the base model
        (None) counting as one, and pinned adapters keep their slots."""
        if len(lora_ids) > self.settings.max_loras_per_batch:
            return False
        pinned = sum(a.pinned for a in self.loaded.values())
        if pinned == 0:
            return True
        in_batch = sum(1 for i in lora_ids if i is not None and i in self.loaded and self.loaded[i].pinned)
        return len(lora_ids) - in_batch <= self.settings.max_loras_per_batch - pinned

    # ---- loading --------------------------------------------------------------------------------

    def loaded_adapters(self) -> dict[str, str]:
        return {a.name: a.path for a in self.loaded.values()}

    def load_from_path(self, name: str, path: str, pinned: bool = False) -> dict[str, Any]:
        def read() -> tuple[AdapterConfig, dict[str, torch.Tensor]]:
            config, tensors = read_adapter_dir(path)
            return AdapterConfig.from_dict(config), tensors

        return self._load(name, path, pinned, read)

    def load_from_tensors(
        self,
        name: str,
        config_dict: dict[str, Any],
        tensors: dict[str, torch.Tensor],
        pinned: bool = False,
        added_tokens_config: dict[str, int] | None = None,
    ) -> dict[str, Any]:
        added = {t: i for t, i in (added_tokens_config or {}).items() if i >= self.vocab_size}
        if added:
            return update_output(
                False,
                f"Failed to load {name} because LoRA serving currently doesn't support adapters that add "
                "tokens to the vocabulary",
                self.loaded_adapters(),
            )
        return self._load(name, TENSOR_PATH, pinned, lambda: (AdapterConfig.from_dict(config_dict), tensors))

    def _load(
        self,
        name: str,
        path: str,
        pinned: bool,
        read: Callable[[], tuple[AdapterConfig, dict[str, torch.Tensor]]],
    ) -> dict[str, Any]:
        """``LoRAManager._load_lora_adapter`` then the tokenizer's registration and LRU eviction."""
        try:
            config, tensors = read()
            self._validate(name, path, pinned, config)
            adapter = Adapter(name, path, pinned, config, self._place(config, tensors))
        except Exception as exc:  # SGLang answers any failure of the backend load this way
            return update_output(False, str(exc), self.loaded_adapters())
        self.loaded[adapter.lora_id] = adapter
        result = update_output(True, "", self.loaded_adapters())
        self.registry[name] = adapter
        self.ever_loaded[name] = (path, pinned)
        limit = self.settings.max_loaded_loras
        while limit is not None and len(self.registry) > limit:
            victim = next((n for n, a in self.registry.items() if not a.pinned), None)
            if victim is None:
                return update_output(
                    False,
                    "Didn't find any LoRA adapters when trying to evict LRU LoRA adapter. "
                    f"LoRA registry is: {self.registry}",
                    None,
                )
            logger.info("Unloading least recently used LoRA adapter '%s'", victim)
            self.unload(victim)
            del result["loaded_adapters"][victim]
        return result

    def _validate(self, name: str, path: str, pinned: bool, config: AdapterConfig) -> None:
        """``LoRAManager.validate_new_adapter``, in its order and words."""
        if config.use_dora:
            raise LoraError(
                f"Failed to load {name} because LoRA serving currently doesn't support DoRA adapters"
            )
        for existing in self.loaded.values():
            if existing.name == name:
                raise LoraError(f"Failed to load LoRA adapter {name} because it is already loaded")
            if existing.path == path and path != TENSOR_PATH:
                logger.warning(
                    "%s is already loaded with name: %s, but another copy is being loaded with name: %s",
                    path,
                    existing.name,
                    name,
                )
        targets = normalized_targets(config.target_modules)
        fits = config.r <= self.settings.max_lora_rank and (
            "all" in targets
            or "all" in self.settings.target_modules
            or targets <= self.settings.target_modules
        )
        if not fits:
            raise LoraError(
                f"LoRA adapter {name} with rank {config.r} is incompatible with the current LoRA memory pool "
                "configuration. Please ensure that the LoRA adapter's rank is within the configured "
                "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`."
            )
        pinned_now = sum(a.pinned for a in self.loaded.values())
        if pinned and pinned_now >= self.settings.max_loras_per_batch - 1:
            raise LoraError(
                f"Failed to load LoRA adapter {name} as a pinned adapter. It is not allowed to pin all slots "
                "in the LoRA memory pool to avoid starvation for unpinned adapters and base models. Please "
                "increase your `--max-loras-per-batch` or load it as unpinned LoRA adapters."
            )

    def _place(
        self, config: AdapterConfig, tensors: dict[str, torch.Tensor]
    ) -> dict[Key, tuple[torch.Tensor, torch.Tensor]]:
        """Each PEFT tensor onto its module (stacked ones split into their modules' rows), checked
        against the module's shape; a name that places nowhere is refused rather than ignored."""
        halves: dict[Key, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors.items():
            match = _PEFT_NAME.search(name)
            if match is None:
                raise LoraError(f"{name} is not a LoRA tensor of a decoder layer's linear module")
            layer, path, half = int(match.group(1)), match.group(2), match.group(3)
            leaf = path.split(".")[-1]
            if leaf in STACKED and (layer, path) not in self.modules:  # a model with q/k/v apart
                parts = [(layer, path[: -len(leaf)] + m) for m in STACKED[leaf]]
                if half == "A":
                    for key in parts:
                        halves.setdefault(key, {})["A"] = tensor
                else:
                    sizes = [self._module(key, name).out_features for key in parts]
                    if tensor.shape[0] != sum(sizes):
                        raise LoraError(f"{name} has {tensor.shape[0]} rows, its modules {sum(sizes)}")
                    for key, rows in zip(parts, tensor.split(sizes), strict=True):
                        halves.setdefault(key, {})["B"] = rows
            else:
                halves.setdefault((layer, path), {})[half] = tensor
        weights = {}
        for key, pair in halves.items():
            module = self._module(key, f"layers.{key[0]}.{key[1]}")
            if set(pair) != {"A", "B"}:
                raise LoraError(
                    f"layers.{key[0]}.{key[1]} has lora_{'A' if 'A' not in pair else 'B'} missing"
                )
            a, b = pair["A"], pair["B"]
            want_a, want_b = (config.r, module.in_features), (module.out_features, config.r)
            if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                raise LoraError(
                    f"layers.{key[0]}.{key[1]}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)}, "
                    f"expected {want_a} / {want_b} (r={config.r})"
                )
            weights[key] = (
                a.to(self.device, self.dtype, copy=True).contiguous(),
                b.to(self.device, self.dtype, copy=True).contiguous(),
            )
        return weights

    def _module(self, key: Key, name: str) -> nn.Linear:
        module = self.modules.get(key)
        if module is None:
            raise LoraError(f"{name} is not a module this engine serves LoRA on (--lora-target-modules)")
        return module

    def unload(self, name: str) -> dict[str, Any]:
        """``LoRARegistry.unregister`` then the backend's unload."""
        adapter = self.registry.get(name)
        if adapter is None:
            message = f"LoRA with name {name} does not exist. Loaded LoRAs: {self.registry.keys()}"
            return update_output(False, message, None)
        del self.registry[name]
        self.loaded.pop(adapter.lora_id, None)
        return update_output(True, "", self.loaded_adapters())

    # ---- requests -------------------------------------------------------------------------------

    def acquire(self, names: list[str | None], as_list: bool) -> list[Adapter | None]:
        """``TokenizerManager._resolve_lora_path``: each request's adapter by name, reloading one that
        was unloaded (or evicted) from where it was first loaded; raises LoraError (HTTP 400)."""
        unique = set(names)
        limit = self.settings.max_loaded_loras
        if limit is not None and len(unique if as_list else {names[0]}) > limit:
            raise LoraError(
                f"Received request with {len(unique)} unique loras requested but max loaded loras is {limit}"
            )
        for name in [n for n in unique if n is not None]:
            if name in self.registry:
                self.registry.move_to_end(name)
                continue
            if name not in self.ever_loaded:
                raise LoraError(
                    f"Got LoRA adapter that has never been loaded: {name}\n"
                    f"All loaded adapters: {self.ever_loaded.keys()}."
                )
            path, pinned = self.ever_loaded[name]
            logger.info("Reloading evicted adapter: %s", name)
            result = self.load_from_path(name, path, pinned)
            if not result["success"] and "already loaded" not in result["error_message"]:
                raise LoraError(f"Failed to implicitly load LoRA adapter {name}: {result['error_message']}")
        adapters: list[Adapter | None] = []
        for wanted in names:
            adapter = None if wanted is None else self.registry.get(wanted)
            if wanted is not None and adapter is None:
                raise LoraError(
                    f"The following requested LoRA adapters are not loaded: {wanted}\n"
                    f"Loaded adapters: {self.registry.keys()}."
                )
            if wanted is not None:
                self.registry.move_to_end(wanted)
            adapters.append(adapter)
        return adapters

    def read(self, lora_name: str, name: str, truncate_size: int) -> list[Any]:
        """The torch engine's own read-back of an adapter tensor by its PEFT name (SGLang has none:
        ``get_weights_by_name`` reads model parameters, and adapters live in its LoRA memory pool)."""
        adapter = self.registry.get(lora_name)
        if adapter is None:
            raise LoraError(
                f"LoRA with name {lora_name} does not exist. Loaded LoRAs: {self.registry.keys()}"
            )
        match = _PEFT_NAME.search(name)
        key = (int(match.group(1)), match.group(2)) if match else None
        if key is None or key not in adapter.weights:
            raise LoraError(f"{name} is not a tensor of LoRA adapter {lora_name}")
        tensor = adapter.weights[key][0 if match and match.group(3) == "A" else 1]
        return tensor.float().tolist()[:truncate_size]
