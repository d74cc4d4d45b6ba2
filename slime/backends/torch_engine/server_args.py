"""Command line of the torch engine: SGLang's own server flags, so `--sglang-*` options pass through.

Names, types and defaults are not written here: they come from slime's one table of SGLang
`ServerArgs` fields (`slime.config.sglang_args.FallbackServerArgs`, checked against SGLang 0.5.23 by
tests/unit/test_sglang_wheels.py), always that table and never an installed SGLang's, since what this
engine implements does not change with the SGLang on the node. What this module decides is what the
engine does with each flag:
- honoured: the ones this engine implements (`HONOURED`, with the engine's own help or narrower choices);
- accepted without effect, each for a stated reason (`NO_EFFECT`), because slime's launcher always
  passes them to SGLang (ports for SGLang's internal NCCL, warm-up, memory-saver switches ...);
- everything else: refused at start with one line naming the option, exit status 2, so a setting that
  would change behaviour on real SGLang is never silently dropped here.
Parallel sizes must be 1 (one process, one device).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from slime.backends.torch_engine.protocol import SUPPORTED_RELEASES
from slime.config.sglang_args import FallbackServerArgs, derive_server_flags

PROG = "python -m slime.backends.torch_engine"

# SGLang flag (snake_case) -> why it has no effect here.
NO_EFFECT = {
    "mem_fraction_static": "no static KV pool: the cache grows on demand, bounded by --max-total-tokens",
    "enable_memory_saver": "release/resume_memory_occupation always work",
    "skip_server_warmup": "there is no warm-up",
    "nccl_port": "no internal NCCL group (single process)",
    "dist_init_addr": "no internal process group (single process)",
    "gpu_id_step": "single device",
    "disable_radix_cache": "there is no prefix cache",
    "chunked_prefill_size": "prefill batches are bounded by the engine's own token budget",
    "cuda_graph_max_bs": "no CUDA graphs",  # this and the next: names before SGLang 0.5.23, not in the table
    "cuda_graph_bs": "no CUDA graphs",
    "cuda_graph_max_bs_decode": "no CUDA graphs",
    "cuda_graph_bs_decode": "no CUDA graphs",
    "disable_cuda_graph": "no CUDA graphs",
    "enable_draft_weights_cpu_backup": "no speculative decoding",
    "log_level_http": "HTTP access logs follow --log-level",
    "load_format": "weights are read with transformers (safetensors)",
    "enable_metrics": "counters are in /get_server_info internal_states",
    "watchdog_timeout": "no watchdog",
    "lora_backend": "one implementation: each row's scaling * B(A x), added by hooks in PyTorch (lora.py)",
}
# Parallel sizes that only have one valid value in this engine.
MUST_BE_ONE = ("tp_size", "dp_size", "pp_size", "ep_size", "nnodes")
# SGLang flag (snake_case) this engine implements -> argparse settings beyond the table's type and default.
HONOURED: dict[str, dict[str, Any]] = {
    "model_path": {"required": True, "help": "local HF checkpoint directory"},
    "tokenizer_path": {},
    "host": {},
    "port": {},
    **{name: {} for name in MUST_BE_ONE},
    "node_rank": {},
    "base_gpu_id": {"help": "CUDA device index with --device cuda"},
    "context_length": {"help": "default: max_position_embeddings"},
    "max_running_requests": {"help": "default 64"},
    "max_total_tokens": {"help": "token budget of running requests"},
    "random_seed": {},
    "log_level": {"choices": ["debug", "info", "warning", "error", "critical"]},
    "device": {"choices": ["cpu", "cuda"], "help": "default: cuda if available"},
    "dtype": {},
    "trust_remote_code": {},
    "served_model_name": {},
    "api_key": {"help": "require 'Authorization: Bearer KEY' on every endpoint but /health*, as SGLang does"},
    "weight_version": {},
    "enable_lora": {"help": "serve LoRA adapters (on with --lora-paths too)"},
    "max_lora_rank": {"help": "default: the largest rank of --lora-paths"},
    "lora_target_modules": {"nargs": "*", "help": "HF module names or 'all'; default: those of --lora-paths"},
    "lora_paths": {"nargs": "*", "help": "<PATH> | <NAME>=<PATH> | JSON {lora_name, lora_path, pinned}"},
    "max_loaded_loras": {"help": "LRU-evict unpinned adapters beyond this many"},
    "max_loras_per_batch": {"help": "adapters per running batch, the base model counting as one"},
    "enable_return_routed_experts": {"help": "answer return_routed_experts (R3) with each MoE layer's top-k"},
}


@dataclass
class ServerArgs(FallbackServerArgs):
    """The engine's settings: SGLang's ServerArgs fields of the table (reported by /get_server_info, as
    SGLang reports its own) and the release whose protocol the engine mirrors. A flag without effect
    leaves its field at the default, which is what the engine does; what was given is in ``ignored``."""

    sglang_release: str = SUPPORTED_RELEASES[-1]
    ignored: dict[str, Any] = field(default_factory=dict)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="SGLang-protocol generation server in plain PyTorch + transformers.",
        allow_abbrev=False,
    )
    flags, defaults = derive_server_flags(FallbackServerArgs), FallbackServerArgs()
    for name, settings in HONOURED.items():
        option, spec, default = "--" + name.replace("_", "-"), flags[name], getattr(defaults, name)
        if spec.kind == "switch":
            parser.add_argument(option, action="store_true", default=default, **settings)
        elif spec.kind == "list":  # one or more values; the settings may take none (nargs "*")
            parser.add_argument(
                option,
                default=default,
                **{"type": spec.parse, "nargs": "+", "choices": spec.choices, **settings},
            )
        else:
            parser.add_argument(
                option, default=default, **{"type": spec.parse, "choices": spec.choices, **settings}
            )
    parser.add_argument(
        "--sglang-release",
        choices=SUPPORTED_RELEASES,
        default=SUPPORTED_RELEASES[-1],
        help="the SGLang release whose HTTP protocol to mirror (weight-update sessions, load endpoints)",
    )
    for name in NO_EFFECT:  # a switch, one value or a list (``--cuda-graph-bs-decode 1 2 4``)
        parser.add_argument("--" + name.replace("_", "-"), nargs="*", default=None, help=argparse.SUPPRESS)

    def one_line_error(message: str) -> NoReturn:
        parser.exit(2, f"{PROG}: error: {message}\n")

    parser.error = one_line_error  # type: ignore[method-assign]
    return parser


def parse_server_args(argv: list[str] | None = None) -> ServerArgs:
    """Parse the command line; any problem exits with status 2 and one line on stderr."""
    parser = _parser()
    namespace, unknown = parser.parse_known_args(argv)
    for token in unknown:
        if token.startswith("--"):
            name = token.split("=", 1)[0]
            parser.error(f"{name} is an SGLang option that the torch engine does not support")
    if unknown:
        parser.error(f"unexpected argument {unknown[0]!r}")
    values = vars(namespace)
    for name in MUST_BE_ONE:
        if values[name] != 1:
            flag = "--" + name.replace("_", "-")
            parser.error(
                f"{flag} {values[name]} is not supported by the torch engine (one process, one device)"
            )
    if values["node_rank"] != 0:
        parser.error("--node-rank must be 0 for the torch engine (single node)")
    for name in ("context_length", "max_running_requests", "max_total_tokens"):
        if values[name] is not None and values[name] <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {values[name]}")
    for name in ("model_path", "tokenizer_path"):
        if values[name] is not None and not Path(values[name]).is_dir():
            parser.error(
                f"--{name.replace('_', '-')} {values[name]} is not a directory (a local HF checkpoint)"
            )
    ignored = {name: _as_given(values.pop(name)) for name in NO_EFFECT if values.get(name) is not None}
    for name in NO_EFFECT:
        values.pop(name, None)
    return ServerArgs(**values, ignored=ignored)


def _as_given(values: list[str]) -> Any:
    """A no-effect flag's values as ``--sglang-*`` parsing records them: True for a bare switch."""
    if not values:
        return True
    return values[0] if len(values) == 1 else values


def main_error(message: str) -> NoReturn:
    """One-line start-up failure (e.g. the model directory is unusable), exit status 2."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(2)
