"""``--sglang-*``: flags derived from a ServerArgs dataclass, checked at parse time, and the SGLang
server command lines slime builds from them (one-node and two-node engines)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from pathlib import Path
from typing import Annotated, Literal, Optional

import pytest

from slime.backends.sglang import server_command
from slime.config import ConfigError, parse_args
from slime.config import sglang_args as sa
from slime.config.settings.rollout import EngineSettings
from slime.ray.cluster import BundleLocation
from slime.ray.engines import EngineNode, EngineStartError, engine_command, plan_engine_nodes
from tests.unit.test_sglang_wheels import source


@dataclasses.dataclass(frozen=True)
class Arg:
    """Shaped like SGLang's ``Arg`` metadata (read by attribute, never imported)."""

    help: str = ""
    choices: list | None = None
    aliases: list[str] | None = None
    cli_name: str | None = None
    type_parser: object = None
    nargs: str | None = None
    action: object = None
    no_cli: bool = False


def _json_list(text: str) -> list:
    value = json.loads(text)
    if not isinstance(value, list):
        raise ValueError("not a JSON list")
    return value


@dataclasses.dataclass
class ServerArgs:
    """A stand-in with the shapes SGLang's ServerArgs uses: plain and ``Annotated`` fields."""

    model_path: Annotated[str, Arg(help="weights", aliases=["--model"])]
    tp_size: Annotated[int, Arg(aliases=["--tensor-parallel-size"])] = 1
    host: str = "127.0.0.1"
    port: int = 30000
    nccl_port: Optional[int] = None  # noqa: UP045 (SGLang spells it so)
    random_seed: Optional[int] = None  # noqa: UP045
    enable_memory_saver: bool = False
    context_length: Optional[int] = None  # noqa: UP045
    mem_fraction_static: float | None = None
    enable_metrics: bool = False
    cuda_graph_bs: Optional[list[int]] = None  # noqa: UP045
    lora_target_modules: Annotated[Optional[list[str]], Arg(nargs="*", choices=["q_proj", "v_proj"])] = None  # noqa: UP045
    dtype: Literal["auto", "bfloat16", "float16"] = "auto"
    attention_backend: Annotated[Optional[str], Arg(choices=["fa3", "flashinfer", "triton"])] = None  # noqa: UP045
    json_override: Annotated[str, Arg(type_parser=_json_list)] = "[]"
    draft_algorithm: Annotated[Optional[str], Arg(nargs="?")] = None  # noqa: UP045
    lora_paths: Annotated[Optional[list[str]], Arg(action="LoRAPathAction")] = None  # noqa: UP045
    speculative_config: dict | None = None
    internal_state: Annotated[int, Arg(no_cli=True)] = 0
    derived: int = dataclasses.field(default=0, init=False)


@dataclasses.dataclass
class ServerArgsWithCli(ServerArgs):
    """As SGLang's: the class builds its own CLI, leaving a field out and adding flags by hand."""

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(ServerArgs):
            if f.init and f.name not in ("internal_state", "speculative_config"):
                parser.add_argument("--" + f.name.replace("_", "-"), type=str)
        parser.add_argument("--model", dest="model_path")
        parser.add_argument("--tensor-parallel-size", dest="tp_size")
        parser.add_argument("--config", type=str)
        parser.add_argument("--enable-ep-moe", action="store_true")  # deprecated, no field
        parser.add_argument("--tp", dest="tp_size", type=int)  # deprecated alias of a field


STRICT = sa.ServerArgsSource(ServerArgs, strict=True, origin="SGLang 9.9 (stand-in)")
LENIENT = sa.ServerArgsSource(ServerArgs, strict=False, origin="a subset")


def check(leftover: list[str], source: sa.ServerArgsSource = STRICT) -> dict[str, object]:
    server_args, unknown = sa.collect_sglang_args(leftover)
    assert unknown == []
    sa.check_sglang_server_args(server_args, source)
    return server_args


def error(leftover: list[str], source: sa.ServerArgsSource = STRICT) -> str:
    with pytest.raises(ConfigError) as info:
        check(leftover, source)
    line = info.value.line()
    assert "\n" not in line
    return line


def test_flags_follow_the_dataclass_types_and_metadata() -> None:
    flags = sa.derive_server_flags(ServerArgs)
    assert flags["enable_metrics"].kind == "switch"
    assert (flags["cuda_graph_bs"].kind, flags["cuda_graph_bs"].parse) == ("list", int)
    assert (flags["context_length"].kind, flags["context_length"].parse) == ("value", int)
    assert flags["mem_fraction_static"].parse is float
    assert flags["dtype"].choices == ("auto", "bfloat16", "float16")
    assert flags["attention_backend"].choices == ("fa3", "flashinfer", "triton")
    assert flags["lora_target_modules"].min_values == 0
    assert flags["lora_paths"].kind == "any" and flags["speculative_config"].kind == "any"
    assert flags["model"].field == "model_path" and flags["tensor_parallel_size"].field == "tp_size"
    assert "internal_state" not in flags and "derived" not in flags


def test_where_the_class_builds_its_cli_that_cli_decides_which_flags_exist() -> None:
    flags = sa.derive_server_flags(ServerArgsWithCli)
    assert set(flags) == set(sa.derive_server_flags(ServerArgs)) - {"speculative_config"} | {
        "config",
        "enable_ep_moe",
        "tp",
    }
    assert (flags["config"].kind, flags["enable_ep_moe"].kind) == ("any", "any")
    assert flags["tp"].field == "tp_size" and flags["context_length"].parse is int  # the field's type
    source = sa.ServerArgsSource(ServerArgsWithCli, strict=True, origin="SGLang with a CLI")
    assert check(["--sglang-config", "c.yaml", "--sglang-enable-ep-moe"], source)
    assert "is set by slime" in error(["--sglang-tp", "2"], source)
    assert "is not a server flag" in error(["--sglang-speculative-config", "{}"], source)


def as_msgspec_struct(cls: type) -> type:
    """``cls`` rebuilt as a ``msgspec.Struct``, the shape of ServerArgs from SGLang 0.5.20 on."""
    msgspec = pytest.importorskip("msgspec")
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = [
        (f.name, hints[f.name], msgspec.NODEFAULT if f.default is dataclasses.MISSING else f.default)
        for f in dataclasses.fields(cls)
        if f.init and f.default_factory is dataclasses.MISSING
    ]
    namespace = {"add_cli_args": cls.add_cli_args} if hasattr(cls, "add_cli_args") else None
    return msgspec.defstruct(cls.__name__, fields, kw_only=True, module=cls.__module__, namespace=namespace)


@pytest.mark.parametrize("cls", [ServerArgs, ServerArgsWithCli])
def test_a_msgspec_struct_server_args_gives_the_flags_of_the_dataclass(cls: type) -> None:
    struct = as_msgspec_struct(cls)
    assert not dataclasses.is_dataclass(struct)
    assert sa.init_fields(struct) == [f.name for f in dataclasses.fields(cls) if f.init]
    assert sa.derive_server_flags(struct) == sa.derive_server_flags(cls)
    source = sa.ServerArgsSource(struct, strict=True, origin="SGLang 0.5.23 (stand-in)")
    assert check(["--sglang-context-length", "4096", "--sglang-enable-metrics"], source)
    assert "is set by slime" in error(["--sglang-tp-size", "2"], source)
    assert "is not a server flag" in error(["--sglang-no-such-flag", "1"], source)


def test_a_class_that_is_neither_dataclass_nor_struct_is_named() -> None:
    class Plain:
        model_path: str = ""

    with pytest.raises(TypeError, match=r"Plain is neither a dataclass nor a msgspec\.Struct"):
        sa.init_fields(Plain)


@pytest.mark.parametrize(
    "leftover",
    [
        ["--sglang-model-path", "/m"],
        ["--sglang-model", "/m"],
        ["--sglang-tp-size", "2"],
        ["--sglang-tensor-parallel-size", "2"],
        ["--sglang-port", "1"],
        ["--sglang-host", "0.0.0.0"],
        ["--sglang-nccl-port", "1"],
        ["--sglang-random-seed", "1"],
        ["--sglang-enable-memory-saver"],
    ],
)
def test_fields_slime_controls_are_refused_in_one_line(leftover: list[str]) -> None:
    line = error(leftover)
    assert line.startswith(f"error: {leftover[0]}: is set by slime for each engine (")
    assert line.endswith("; drop it")


def test_controlled_fields_are_refused_even_without_sglang() -> None:
    line = error(["--sglang-tp-size", "2"], sa.ServerArgsSource(sa.FallbackServerArgs, False, "subset"))
    assert line == (
        "error: --sglang-tp-size: is set by slime for each engine "
        "(from --rollout-num-gpus-per-engine); drop it"
    )


def test_switches_take_no_value() -> None:
    assert check(["--sglang-enable-metrics"]) == {"enable_metrics": True}
    line = error(["--sglang-enable-metrics", "false"])
    assert line == (
        "error: --sglang-enable-metrics: is a switch and takes no value, got 'false'; "
        "write --sglang-enable-metrics alone"
    )
    assert "takes no value" in error(["--sglang-enable-metrics=1"])


def test_lists_take_typed_values_and_keep_what_was_typed() -> None:
    assert check(["--sglang-cuda-graph-bs", "1", "2", "4"]) == {"cuda_graph_bs": ["1", "2", "4"]}
    assert check(["--sglang-cuda-graph-bs", "8"]) == {"cuda_graph_bs": "8"}
    assert "invalid int value 'two'" in error(["--sglang-cuda-graph-bs", "1", "two"])
    assert error(["--sglang-cuda-graph-bs"]).endswith("needs a value; write --sglang-cuda-graph-bs VALUE")
    assert check(["--sglang-lora-target-modules", "q_proj", "v_proj"])
    assert "'k_proj' is not one of q_proj, v_proj" in error(["--sglang-lora-target-modules", "k_proj"])
    assert check(["--sglang-lora-target-modules"]) == {"lora_target_modules": True}  # nargs="*"


def test_optional_scalars_take_one_value_of_their_type() -> None:
    assert check(["--sglang-context-length", "4096", "--sglang-mem-fraction-static=0.8"]) == {
        "context_length": "4096",
        "mem_fraction_static": "0.8",
    }
    assert error(["--sglang-context-length", "4k"]).startswith(
        "error: --sglang-context-length: invalid int value '4k'"
    )
    assert "takes one value, got 2 (1 2)" in error(["--sglang-context-length", "1", "2"])
    assert "needs a value" in error(["--sglang-mem-fraction-static"])
    assert check(["--sglang-draft-algorithm"]) == {"draft_algorithm": True}  # nargs="?"
    assert "takes one value" in error(["--sglang-draft-algorithm", "a", "b"])


def test_choices_literals_and_type_parsers() -> None:
    assert check(["--sglang-dtype", "bfloat16", "--sglang-attention-backend", "fa3"])
    assert "'fp8' is not one of auto, bfloat16, float16" in error(["--sglang-dtype", "fp8"])
    assert "is not one of fa3, flashinfer, triton" in error(["--sglang-attention-backend", "flash"])
    assert check(["--sglang-json-override", "[1, 2]"])
    assert "not a JSON list" in error(["--sglang-json-override", "{}"])
    # A custom argparse action or an unmodelled type: passed as typed, for SGLang to judge.
    assert check(["--sglang-lora-paths", "a=/x", "b=/y", "--sglang-speculative-config", "{}"])


def test_unknown_flags_are_refused_with_sglang_and_left_to_the_engine_without() -> None:
    line = error(["--sglang-enable-warp-drive"])
    assert line == (
        "error: --sglang-enable-warp-drive: is not a server flag of SGLang 9.9 (stand-in); "
        "see python -m sglang.launch_server --help"
    )
    assert check(["--sglang-enable-warp-drive", "3"], LENIENT) == {"enable_warp_drive": "3"}


def test_without_sglang_the_builtin_subset_is_used() -> None:
    source = sa.server_args_source()
    assert source.cls is sa.FallbackServerArgs and not source.strict
    assert "SGLang not installed" in source.origin
    names = {f.name for f in dataclasses.fields(sa.FallbackServerArgs)}
    assert set(sa.SLIME_CONTROLLED) <= names


def test_the_builtin_subset_is_the_torch_engines_flag_table_too(tmp_path: Path) -> None:
    """One hand-kept table of ServerArgs fields: the torch engine's flags, types and defaults are its."""
    from slime.backends.torch_engine import server_args as engine

    table = set(sa.init_fields(sa.FallbackServerArgs))
    assert set(engine.HONOURED) <= table
    assert set(engine.NO_EFFECT) - table == {"cuda_graph_max_bs", "cuda_graph_bs"}  # names before 0.5.23
    argv = ["--model-path", str(tmp_path), "--port", "7", "--mem-fraction-static", "0.5"]
    args = engine.parse_server_args(argv)
    settings = {k: v for k, v in dataclasses.asdict(args).items() if k in table}
    assert settings == dataclasses.asdict(sa.FallbackServerArgs(model_path=str(tmp_path), port=7))
    assert args.ignored == {"mem_fraction_static": "0.5"}


def test_the_torch_engine_accepts_list_and_switch_flags_without_effect(tmp_path: Path) -> None:
    """``--sglang-cuda-graph-bs-decode 1 2 4`` (the ``--sglang`` help's own example) passes slime's check,
    so the engine it is handed to must take a list there too, and a bare switch."""
    from slime.backends.torch_engine import server_args as engine

    argv = ["--model-path", str(tmp_path), "--cuda-graph-bs-decode", "1", "2", "4", "--disable-cuda-graph"]
    assert engine.parse_server_args(argv).ignored == {
        "cuda_graph_bs_decode": ["1", "2", "4"],
        "disable_cuda_graph": True,
    }


def _hf(tmp_path: Path) -> str:
    config = {
        "model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 64,
        "max_position_embeddings": 128, "tie_word_embeddings": True,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def _argv(hf: str, *extra: str) -> list[str]:
    return [
        "--hf-checkpoint", hf, "--rollout-batch-size", "4", "--lr", "1e-6", "--num-rollout", "1",
        "--rollout-num-gpus", "2", *extra,
    ]  # fmt: skip


def test_parse_args_checks_against_the_installed_serverargs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sa, "server_args_source", lambda: STRICT)
    hf = _hf(tmp_path)
    args = parse_args(_argv(hf, "--sglang-cuda-graph-bs", "1", "2", "--sglang-enable-metrics"))
    assert args.sglang_server_args == {"cuda_graph_bs": ["1", "2"], "enable_metrics": True}
    for flag, expected in [
        (["--sglang-tensor-parallel-size", "2"], "error: --sglang-tensor-parallel-size: is set by slime"),
        (["--sglang-warp", "9"], "error: --sglang-warp: is not a server flag of SGLang 9.9 (stand-in)"),
    ]:
        with pytest.raises(SystemExit) as exc:
            parse_args(_argv(hf, *flag))
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.count("\n") == 1 and err.startswith(expected), err


def _engine(**overrides: object) -> EngineSettings:
    values = {
        "backend": "sglang",
        "hf_checkpoint": "/models/Qwen3-4B",
        "seed": 42,
        "colocate": False,
        "log_level": "info",
        "torch_engine_sglang_release": "0.5.23",
        "server_args": (
            ("mem_fraction_static", "0.7"),
            ("enable_metrics", True),
            ("cuda_graph_bs", ["1", "2"]),
        ),
    }
    return EngineSettings(**{**values, **overrides})


def test_one_node_engine_command_line() -> None:
    argv = server_command(_engine(), "10.0.0.1", 30001, engine_rank=2, num_gpus=4, nccl_port=30002)
    assert argv == [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", "/models/Qwen3-4B",
        "--host", "10.0.0.1", "--port", "30001", "--nccl-port", "30002",
        "--tp-size", "4", "--base-gpu-id", "0",
        "--random-seed", "44",
        "--mem-fraction-static", "0.7", "--enable-metrics", "--cuda-graph-bs", "1", "2",
        "--log-level", "info",
    ]  # fmt: skip


def test_a_vision_language_engine_patches_images_with_the_pil_processor(tmp_path) -> None:
    """Both SGLang releases have ``--image-processor-backend`` (0.5.19 ServerArgs, 0.5.23
    srt/arg_groups); the rollout's processor is the PIL one, so the engine's is too unless set."""
    (tmp_path / "config.json").write_text('{"model_type": "qwen2_5_vl", "vision_config": {}}')
    argv = server_command(
        _engine(hf_checkpoint=str(tmp_path)), "h", 1, engine_rank=0, num_gpus=1, nccl_port=2
    )
    assert argv[argv.index("--image-processor-backend") + 1] == "pil"
    mine = _engine(hf_checkpoint=str(tmp_path), server_args=(("image_processor_backend", "auto"),))
    argv = server_command(mine, "h", 1, engine_rank=0, num_gpus=1, nccl_port=2)
    assert argv[argv.index("--image-processor-backend") + 1] == "auto"
    plain = server_command(_engine(), "h", 1, engine_rank=0, num_gpus=1, nccl_port=2)
    assert "--image-processor-backend" not in plain
    for release in ("0.5.19", "0.5.23"):
        files = [*source(release).glob("server_args.py"), *source(release).glob("arg_groups/*.py")]
        assert any("image_processor_backend" in f.read_text() for f in files), release


def test_two_node_engine_command_lines_meet_at_node_zero() -> None:
    args = _engine(colocate=True, server_args=(("log_level", "warning"),))
    placement = {"engine_rank": 0, "num_gpus": 16, "nccl_port": 30002, "nnodes": 2}
    lines = [
        server_command(args, host, 30001, node_rank=rank, dist_init_addr="10.0.0.1:5000", **placement)
        for rank, host in enumerate(["10.0.0.1", "10.0.0.2"])
    ]
    for rank, argv in enumerate(lines):
        tail = argv[argv.index("--tp-size") :]
        assert tail == [
            "--tp-size", "16", "--base-gpu-id", "0", "--random-seed", "42",
            "--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr", "10.0.0.1:5000",
            "--enable-memory-saver", "--log-level", "warning",
        ]  # fmt: skip
    with pytest.raises(ValueError, match="spans 2 nodes"):
        server_command(args, "h", 1, engine_rank=0, num_gpus=16, nccl_port=2, nnodes=2, node_rank=1)


def test_engine_command_switches_backends() -> None:
    args = _engine(server_args=(("max_running_requests", "8"),))
    sglang = engine_command(args, "127.0.0.1", 1234, EngineNode(0, 1, 0))
    assert sglang[1:3] == ["-m", "sglang.launch_server"] and int(sglang[sglang.index("--nccl-port") + 1]) > 0
    torch = engine_command(dataclasses.replace(args, backend="torch"), "127.0.0.1", 1234, EngineNode(1, 1, 0))
    assert torch[1:3] == ["-m", "slime.backends.torch_engine"]
    assert torch[torch.index("--random-seed") + 1] == "43" and "--max-running-requests" in torch
    assert torch[torch.index("--sglang-release") + 1] == "0.5.23"  # the protocol it mirrors


def _node(ip: str, gpus: list[int], first_index: int) -> list[BundleLocation]:
    return [BundleLocation(first_index + i, ip, gpu) for i, gpu in enumerate(gpus)]


def test_engines_pack_by_node_and_gpu_index() -> None:
    # Ray numbered the four rollout bundles out of GPU order.
    indices, gpus = [4, 5, 6, 7], [6, 4, 7, 5]
    locations = [BundleLocation(i, "10.0.0.1", gpu) for i, gpu in zip(indices, gpus, strict=True)]
    engines = plan_engine_nodes(locations, per_engine=2, gpus_per_node=8)
    assert engines == [[EngineNode(0, 2, 5, 1, 0, (4, 5))], [EngineNode(1, 2, 4, 1, 0, (6, 7))]]


def test_an_engine_larger_than_a_node_takes_whole_nodes() -> None:
    locations = _node("10.0.0.2", [7, 6, 5, 4, 3, 2, 1, 0], 8) + _node("10.0.0.1", list(range(8)), 0)
    (engine,) = plan_engine_nodes(locations, per_engine=16, gpus_per_node=8)
    assert [(n.node_rank, n.nnodes, n.num_gpus, n.bundle_index, n.gpu_ids) for n in engine] == [
        (0, 2, 16, 0, tuple(range(8))),
        (1, 2, 16, 15, tuple(range(8))),
    ]


def test_an_engine_straddling_nodes_is_refused() -> None:
    locations = _node("10.0.0.1", [6, 7], 0) + _node("10.0.0.2", [0, 1], 2)
    with pytest.raises(EngineStartError, match=r"engine 0 needs 4 GPUs on 1 node\(s\), 4 per node"):
        plan_engine_nodes(locations, per_engine=4, gpus_per_node=8)


@dataclasses.dataclass
class ServerArgsWithUnresolvable:
    """An annotation naming a type imported only for type checkers must not hide the other fields."""

    port: int = 30000
    enable_metrics: bool = False
    tokenizer: NotImportedHere | None = None  # type: ignore[name-defined]  # noqa: F821


def test_an_unresolvable_annotation_leaves_that_flag_unchecked_and_the_rest_typed() -> None:
    flags = sa.derive_server_flags(ServerArgsWithUnresolvable)
    assert flags["tokenizer"].kind == "any"
    assert (flags["port"].parse, flags["enable_metrics"].kind) == (int, "switch")
