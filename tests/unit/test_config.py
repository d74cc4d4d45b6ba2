"""slime.config: one parser for three flag families, validated before anything starts."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from slime.cli import check_implemented
from slime.config import (
    ConfigError,
    build_parser,
    collect_sglang_args,
    configure,
    parse_args,
    split_data_path,
)
from slime.config.eval_config import EvalSetSettings
from slime.config.parser import configure_steps, explicit_dests
from tests.support.configs import base, expect_error, make_hf

# The flags scripts/models/<tiny qwen2>.sh would carry: all consistent with TINY_QWEN2.
TINY_MODEL_ARGS = [
    "--num-layers", "2", "--hidden-size", "128", "--ffn-hidden-size", "512",
    "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
    "--kv-channels", "32", "--vocab-size", "64", "--max-position-embeddings", "512",
    "--use-rotary-position-embeddings", "--rotary-base", "10000", "--normalization", "RMSNorm",
    "--norm-epsilon", "1e-6", "--swiglu", "--disable-bias-linear", "--add-qkv-bias",
]  # fmt: skip


@pytest.fixture
def hf(tmp_path: Path) -> str:
    return make_hf(tmp_path)


@pytest.fixture
def data(tmp_path: Path) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"input": "1 + 1 =", "label": "2"}\n')
    return str(path)


def namespace(hf: str, *extra: str):
    """A parsed but not yet configured Namespace, for direct configure calls."""
    args = build_parser().parse_args(base(hf, *extra))
    args.sglang_server_args = {}
    return args


# --- parsing and dests -------------------------------------------------------------------------


def test_realistic_command_keeps_megatron_dests_and_values(hf: str, data: str) -> None:
    argv = [
        *TINY_MODEL_ARGS,
        *base(hf, "--actor-num-gpus-per-node", "4", "--tensor-model-parallel-size", "2"),
        "--prompt-data", data, "--input-key", "input", "--label-key", "label", "--apply-chat-template",
        "--rollout-max-response-len", "8", "--rollout-stop", "</s>", "\n\n",
        "--rollout-stop-token-ids", "1", "2", "--advantage-estimator", "gspo", "--use-kl-loss",
        "--kl-loss-type", "low_var_kl", "--kl-loss-coef", "0.01",
        "--bf16", "--no-rope-fusion", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
        "--no-persist-layer-norm", "--attention-backend", "flash", "--adam-beta2", "0.98",
        "--lr-decay-style", "constant", "--load", "/nonexistent/ckpt", "--no-load-optim",
    ]  # fmt: skip
    args = parse_args(argv)
    assert (args.num_layers, args.hidden_size, args.ffn_hidden_size, args.vocab_size) == (2, 128, 512, 64)
    assert args.group_query_attention and args.num_query_groups == 2 and args.kv_channels == 32
    assert args.position_embedding_type == "rope" and args.rotary_base == 10000
    assert args.normalization == "RMSNorm" and args.norm_epsilon == 1e-6 and args.swiglu
    assert args.add_bias_linear is False and args.add_qkv_bias and not args.qk_layernorm
    assert args.apply_rope_fusion is False and args.gradient_accumulation_fusion is False
    assert args.masked_softmax_fusion is False and args.bias_dropout_fusion is True
    assert (
        args.no_persist_layer_norm
        and not args.persist_layer_norm
        and args.attention_backend == "flash"
        and args.transformer_impl == "local"
    )
    assert args.attention_dropout == 0.0 and args.hidden_dropout == 0.0
    assert args.bf16 and not args.fp16 and args.adam_beta2 == 0.98 and args.lr == 1e-6
    assert args.load == "/nonexistent/ckpt" and args.no_load_optim is True and args.no_save_optim is None
    assert args.rollout_stop == ["</s>", "\n\n"] and args.rollout_stop_token_ids == [1, 2]
    assert args.advantage_estimator == "gspo" and args.kl_loss_type == "low_var_kl" and args.use_kl_loss
    assert args.label_key == "label" and args.apply_chat_template and args.prompt_data == data
    assert args.sglang_server_args == {}


def test_megatron_defaults_where_the_brief_keeps_them() -> None:
    args = build_parser().parse_args([])
    assert args.add_bias_linear is True and args.apply_rope_fusion is True
    assert args.position_embedding_type == "learned_absolute" and args.normalization == "LayerNorm"
    assert (args.rotary_base, args.norm_epsilon, args.make_vocab_size_divisible_by) == (10000, 1e-5, 128)
    assert (args.seed, args.clip_grad, args.adam_beta1, args.adam_beta2, args.adam_eps) == (
        1234,
        1.0,
        0.9,
        0.999,
        1e-8,
    )
    assert (args.lr_decay_style, args.min_lr, args.ckpt_format) == ("linear", 0.0, "torch_dist")
    assert (args.moe_router_topk, args.moe_token_dispatcher_type, args.distributed_timeout_minutes) == (
        2,
        "allgather",
        10,
    )
    assert args.rollout_function_path == "slime.rollout.sglang_rollout.generate_rollout"
    assert args.update_weight_buffer_size == 512 * 1024**2 and args.rollout_top_k == -1


def test_hf_checkpoint_alone_fills_every_model_flag(hf: str) -> None:
    args = parse_args(base(hf))
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (2, 128, 4)
    assert (args.ffn_hidden_size, args.vocab_size, args.max_position_embeddings) == (512, 64, 512)
    assert args.group_query_attention and args.num_query_groups == 2 and args.kv_channels == 32
    assert args.position_embedding_type == "rope" and args.normalization == "RMSNorm"
    assert args.norm_epsilon == 1e-6 and args.swiglu and args.add_qkv_bias and not args.add_bias_linear
    assert args.untie_embeddings_and_output_weights is False  # tie_word_embeddings: true
    assert args.qk_layernorm is False


def test_derived_values_are_set_on_args(hf: str, tmp_path: Path, data: str) -> None:
    argv = base(hf, "--actor-num-gpus-per-node", "4", "--tensor-model-parallel-size", "2")
    args = parse_args(
        [*argv, "--eval-prompt-data", "math", data, "other", f"{data}@[0:1]", "--eval-top-p", "0.5"]
    )
    assert (args.world_size, args.data_parallel_size, args.rollout_num_gpus) == (4, 2, 4)
    assert (args.global_batch_size, args.num_steps_per_rollout, args.over_sampling_batch_size) == (32, 1, 4)
    assert args.eps_clip_high == args.eps_clip == 0.2
    assert args.expert_tensor_parallel_size == 2
    assert [(s.name, s.path) for s in args.eval_sets] == [("math", data), ("other", f"{data}@[0:1]")]
    assert (args.eval_top_p, args.eval_temperature, args.eval_max_response_len) == (0.5, 1.0, 1024)
    assert args.eval_input_key == "input"


def test_rope_theta_under_rope_parameters_and_missing_tie_means_untied(tmp_path: Path) -> None:
    hf = make_hf(tmp_path, rope_theta=None, rope_parameters={"rope_theta": 1e6}, tie_word_embeddings=None)
    args = parse_args(base(hf))
    assert args.rotary_base == 1_000_000 and args.untie_embeddings_and_output_weights is True


def test_llama3_rope_scaling_is_filled_and_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    hf = make_hf(tmp_path, model_type="llama", rope_scaling=scaling)
    args = parse_args(base(hf))
    assert args.use_rope_scaling and args.rope_scaling_factor == 8.0
    expect_error(capsys, base(hf, "--rope-scaling-factor", "4"), "--rope-scaling-factor")
    (tmp_path / "plain").mkdir()
    plain = make_hf(tmp_path / "plain", model_type="llama")
    assert not parse_args(base(plain)).use_rope_scaling
    assert "--use-rope-scaling" in expect_error(
        capsys, base(plain, "--use-rope-scaling"), "--use-rope-scaling"
    )


def test_ffn_and_kv_channels_fall_back_to_megatron_rules(tmp_path: Path) -> None:
    hf = make_hf(tmp_path, intermediate_size=None, head_dim=None, hidden_act=None)
    args = parse_args(base(hf))
    assert args.ffn_hidden_size == 4 * 128 and args.kv_channels == 128 // 4


def test_moe_fields_are_filled_from_config(tmp_path: Path) -> None:
    hf = make_hf(
        tmp_path, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64
    )
    args = parse_args(base(hf))
    assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size) == (8, 2, 64)
    assert args.qk_layernorm and not args.add_qkv_bias


def test_load_debug_rollout_data_implies_train_only_and_skips_existence(hf: str) -> None:
    argv = base(hf, "--load-debug-rollout-data", "/nowhere/rollout_{rollout_id}.pt")
    argv.remove("--colocate")
    args = parse_args(argv)
    assert args.debug_train_only and args.rollout_num_gpus == 0


OUTPUT_FLAGS = ["--save", "--critic-save", "--save-hf", "--eval-output-dir", "--tb-dir"]


@pytest.mark.parametrize("flag", [*OUTPUT_FLAGS, "--update-weight-disk-dir", "--save-debug-rollout-data"])
def test_an_output_directory_that_cannot_be_written_is_refused_before_anything_starts(
    hf: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    """Before, ``--save`` there started every process and ended in the trainer's FileNotFoundError."""
    in_the_way = tmp_path / "a_file"
    in_the_way.write_text("")
    file_in_the_way = f"cannot create {in_the_way}/ckpt: {in_the_way} is a file; pass a directory path"
    # root passes os.access on /proc, where no directory can be made
    no_dir = (
        "cannot write /proc/slime/ckpt (No such file or directory in /proc); pass a directory you can write"
    )
    for directory, problem in [(f"{in_the_way}/ckpt", file_in_the_way), ("/proc/slime/ckpt", no_dir)]:
        value = f"{directory}/rollout_{{rollout_id}}.pt" if flag == "--save-debug-rollout-data" else directory
        assert expect_error(capsys, base(hf, flag, value), flag) == f"error: {flag}: {problem}"


def test_output_directories_to_be_made_are_accepted_and_the_check_leaves_nothing(
    hf: str, tmp_path: Path
) -> None:
    argv = base(hf, "--save-debug-rollout-data", "rollout_{rollout_id}.pt")  # in the working directory
    for flag in OUTPUT_FLAGS:
        argv += [flag, str(tmp_path / "new" / flag.strip("-"))]
    args = parse_args(argv)
    assert args.save == str(tmp_path / "new" / "save") and list(tmp_path.iterdir()) == [tmp_path / "hf"]


# --- SGLang pass-through -----------------------------------------------------------------------


def test_collect_sglang_args_handles_values_switches_lists_and_equals() -> None:
    leftover = [
        "--sglang-mem-fraction-static", "0.8", "--sglang-enable-metrics",
        "--sglang-cuda-graph-bs-decode", "1", "2",
        "--sglang-log-level=warning", "--sglang-random-seed", "-1", "--sglang-disable-radix-cache",
    ]  # fmt: skip
    server_args, unknown = collect_sglang_args(leftover)
    assert server_args == {
        "mem_fraction_static": "0.8",
        "enable_metrics": True,
        "cuda_graph_bs_decode": ["1", "2"],
        "log_level": "warning",
        "random_seed": "-1",
        "disable_radix_cache": True,
    }
    assert unknown == []
    assert collect_sglang_args(["--foo", "x", "--sglang-"]) == ({}, ["--foo", "x", "--sglang-"])


def test_sglang_flags_pass_through_but_slime_sglang_flags_do_not(hf: str) -> None:
    argv = [
        "--sglang-mem-fraction-static", "0.8", *base(hf), "--sglang-server-concurrency", "64",
        "--sglang-enable-metrics", "--sglang-context-length=4096",
    ]  # fmt: skip
    args = parse_args(argv)
    assert args.sglang_server_concurrency == 64
    assert args.sglang_server_args == {
        "mem_fraction_static": "0.8",
        "enable_metrics": True,
        "context_length": "4096",
    }


# --- one-line parser errors --------------------------------------------------------------------


def test_unrecognized_flag_is_one_line(hf: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = expect_error(capsys, [*base(hf), "--foo", "--sglang-x", "1"], "unrecognized arguments")
    assert err == "error: unrecognized arguments: --foo; see --help"


def test_abbreviations_are_not_guessed(hf: str, capsys: pytest.CaptureFixture[str]) -> None:
    expect_error(capsys, [*base(hf), "--num-lay", "2"], "unrecognized arguments")


def test_bad_value_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    err = expect_error(capsys, ["--num-layers", "two"], "--num-layers")
    assert "invalid int value" in err and err.endswith("; see --help")
    expect_error(capsys, ["--optimizer", "adamw"], "--optimizer")


def test_help_shows_every_family_group() -> None:
    text = build_parser().format_help()
    titles = [
        "Megatron: model", "Megatron: mixture of experts", "Megatron: parallelism",
        "Megatron: training & optimizer", "Megatron: learning-rate schedule", "Megatron: checkpointing",
        "Megatron: kernels & fusions (accepted for script compatibility)",
        "SGLang: --sglang-<flag> pass-through", "slime: cluster", "slime: rollout", "slime: data",
        "slime: algorithm", "slime: reward", "slime: weight sync", "slime: evaluation", "slime: logging",
        "slime: checkpointing", "slime: debug",
    ]  # fmt: skip
    for title in titles:
        assert f"\n{title}:\n" in text, title
    assert "--sglang-mem-fraction-static 0.8" in text
    for action in build_parser()._actions:
        assert action.help, action.option_strings


def test_command_line_errors_without_traceback_and_without_heavy_imports(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import sys
        import slime.config
        heavy = [m for m in ("torch", "megatron", "ray") if m in sys.modules]
        print(",".join(heavy) or "light")
        slime.config.parse_args(["--bogus"])
        """
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=60)
    assert done.stdout.strip() == "light"
    assert done.returncode == 2
    assert done.stderr == "error: unrecognized arguments: --bogus; see --help\n"


# --- validation: required flags, modes, ranges -------------------------------------------------


@pytest.mark.parametrize(
    ("drop", "flag"),
    [
        ("--hf-checkpoint", "--hf-checkpoint"),
        ("--rollout-batch-size", "--rollout-batch-size"),
        ("--num-rollout", "--num-rollout"),
        ("--colocate", "--rollout-num-gpus"),
    ],
)
def test_required_flags(hf: str, capsys: pytest.CaptureFixture[str], drop: str, flag: str) -> None:
    argv = base(hf)
    index = argv.index(drop)
    del argv[index : index + (1 if drop == "--colocate" else 2)]
    expect_error(capsys, argv, flag)


def test_lr_defaults_to_upstream_slimes_1e_6(hf: str) -> None:
    """Upstream slime resets Megatron's ``--lr`` to 1e-6 (``slime/utils/arguments.py``), so its users'
    commands that leave it out train at that rate here too."""
    argv = base(hf)
    del argv[argv.index("--lr") : argv.index("--lr") + 2]
    assert parse_args(argv).lr == 1e-6


@pytest.mark.parametrize(
    ("extra", "flag", "text"),
    [
        (["--bf16", "--fp16"], "--fp16", "--bf16"),
        (["--debug-rollout-only", "--debug-train-only"], "--debug-train-only", "--debug-rollout-only"),
        (["--save-debug-rollout-data", "/tmp/r.pt"], "--save-debug-rollout-data", "{rollout_id}"),
        (["--eps-clip-c", "1.0"], "--eps-clip-c", "> 1"),
        (["--sequence-parallel"], "--sequence-parallel", "tensor-model-parallel-size"),
        (["--micro-batch-size", "0"], "--micro-batch-size", "positive"),
        (["--rollout-top-p", "1.5"], "--rollout-top-p", "(0, 1]"),
        (["--rollout-top-k", "0"], "--rollout-top-k", "-1"),
        (["--loss-type", "custom_loss"], "--loss-type", "--custom-loss-function-path"),
        (["--rm-type", "remote"], "--rm-url", "remote"),
        (["--group-rm"], "--group-rm", "--custom-rm-path"),
        (["--over-sampling-batch-size", "2"], "--over-sampling-batch-size", "at least 4"),
        (["--eval-pass-threshold", "0.5"], "--eval-pass-threshold", "--log-passrate"),
        (["--save-interval", "5"], "--save-interval", "--save"),
        (["--auto-resume", "1"], "--auto-resume", "add --save DIR --save-interval N"),
        (["--auto-resume", "1", "--save", "/tmp/ckpt"], "--auto-resume", "add --save-interval N"),
        (["--auto-resume", "-1"], "--auto-resume", "must not be negative"),
        (["--trainer-call-timeout", "-5"], "--trainer-call-timeout", "must not be negative"),
        (["--rollout-request-retries", "-1"], "--rollout-request-retries", "must not be negative"),
        (["--rollout-health-check-interval", "0"], "--rollout-health-check-interval", "positive"),
        (["--overlap-param-gather"], "--overlap-param-gather", "--use-distributed-optimizer"),
        (["--recompute-granularity", "full"], "--recompute-method", "--recompute-num-layers"),
        (["--lr-warmup-iters", "5", "--lr-warmup-fraction", "0.1"], "--lr-warmup-fraction", "keep one"),
        # megatron-core's scheduler asserted (a bare AssertionError in the trainer) on this before.
        (["--lr-warmup-iters", "3"], "--lr-warmup-iters", "not below the schedule's 3 optimizer steps"),
        (["--lr-warmup-iters", "9", "--lr-decay-iters", "9"], "--lr-warmup-iters", "(--lr-decay-iters)"),
        (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size", "--num-experts"),
        # With the engines' log-probs as the old policy every IS weight is 1: a silent no-op before.
        (["--use-tis", "--use-rollout-logprobs"], "--use-tis", "--use-rollout-logprobs"),
        (["--use-mis", "--use-rollout-logprobs"], "--use-mis", "every weight would be 1"),
    ],
)
def test_inconsistent_flags_fail_with_the_flag_named(
    hf: str, capsys: pytest.CaptureFixture[str], extra: list[str], flag: str, text: str
) -> None:
    assert text in expect_error(capsys, base(hf, *extra), flag)


def test_configure_raises_config_error_directly(hf: str) -> None:
    args = namespace(hf, "--bf16", "--fp16")
    with pytest.raises(ConfigError) as exc:
        configure(args)
    assert exc.value.flag == "--fp16" and exc.value.line().startswith("error: --fp16: ")


# --- validation: batch arithmetic --------------------------------------------------------------


def test_global_batch_size_is_derived_from_rollout_and_steps(hf: str) -> None:
    args = parse_args(base(hf, "--num-steps-per-rollout", "4"))
    assert (args.global_batch_size, args.num_steps_per_rollout) == (8, 4)


def test_num_steps_is_derived_from_global_batch_size(hf: str) -> None:
    args = parse_args(base(hf, "--global-batch-size", "16"))
    assert (args.global_batch_size, args.num_steps_per_rollout) == (16, 2)


def test_global_batch_size_must_divide_the_rollout(hf: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = expect_error(capsys, base(hf, "--global-batch-size", "12"), "--global-batch-size")
    assert "4 × 8 = 32" in err


def test_num_steps_must_divide_the_rollout(hf: str, capsys: pytest.CaptureFixture[str]) -> None:
    expect_error(capsys, base(hf, "--num-steps-per-rollout", "3"), "--num-steps-per-rollout")


def test_batch_equation_mismatch_shows_both_sides_and_the_fix(
    hf: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = base(hf, "--global-batch-size", "48", "--num-steps-per-rollout", "1")
    argv[argv.index("--rollout-batch-size") + 1] = "16"
    err = expect_error(capsys, argv, "--global-batch-size")
    assert "16 × 8 = 128" in err and "48 × 1 = 48" in err and "use --global-batch-size 128" in err


# --- validation: parallel layout ---------------------------------------------------------------

GPUS, ENGINE = "--actor-num-gpus-per-node", "--rollout-num-gpus-per-engine"
TP, PP = "--tensor-model-parallel-size", "--pipeline-model-parallel-size"


@pytest.mark.parametrize(
    ("extra", "flag", "text"),
    [
        ([GPUS, "4", TP, "3"], TP, "4"),
        ([GPUS, "3", "--global-batch-size", "16"], "--global-batch-size", "1 × 3"),
        ([GPUS, "3", PP, "3"], PP, "--num-layers 2"),
        ([GPUS, "8", TP, "8"], TP, "--num-attention-heads 4"),
        ([GPUS, "4", TP, "4"], TP, "--num-query-groups 2"),
        (["--rollout-num-gpus", "2"], "--rollout-num-gpus", "--colocate"),
        ([GPUS, "2", "--rollout-num-gpus-per-engine", "4"], "--rollout-num-gpus", "4"),
        ([GPUS, "12", ENGINE, "12"], ENGINE, "--num-gpus-per-node 8"),
        ([GPUS, "2", "--context-parallel-size", "2"], "--context-parallel-size", "not supported yet"),
        ([GPUS, "2", TP, "2", "--sequence-parallel"], "--sequence-parallel", "Transformer Engine"),
        (["--share-prompts-in-train", "--qkv-format", "bshd"], "--share-prompts-in-train", "packed rows"),
        (
            ["--share-prompts-in-train", "--transformer-impl", "transformer_engine"],
            "--share-prompts-in-train", "--transformer-impl local",
        ),
    ],
)  # fmt: skip
def test_parallel_layout_errors(
    hf: str, capsys: pytest.CaptureFixture[str], extra: list[str], flag: str, text: str
) -> None:
    assert text in expect_error(capsys, base(hf, *extra), flag)


def test_heads_must_be_divisible_by_query_groups(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hf = make_hf(tmp_path, num_key_value_heads=3)
    expect_error(capsys, base(hf), "--num-query-groups")


def test_disaggregated_engines_need_their_own_gpus(hf: str) -> None:
    argv = base(hf, "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2")
    argv.remove("--colocate")
    args = parse_args(argv)
    assert (args.rollout_num_gpus, args.world_size) == (4, 1)


# --- validation: paths -------------------------------------------------------------------------


def test_hf_checkpoint_must_exist_and_hold_config_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expect_error(capsys, base(str(tmp_path / "missing")), "--hf-checkpoint")
    assert "config.json" in expect_error(capsys, base(str(tmp_path)), "--hf-checkpoint")


def test_prompt_data_slice_is_stripped_before_the_existence_check(hf: str, data: str) -> None:
    assert parse_args(base(hf, "--prompt-data", f"{data}@[1:]")).prompt_data == f"{data}@[1:]"
    assert split_data_path(f"{data}@[-5:10]") == (data, slice(-5, 10))
    assert split_data_path("a@b.jsonl") == ("a@b.jsonl", None)


@pytest.mark.parametrize(
    ("extra", "flag", "text"),
    [
        (["--prompt-data", "/nowhere/p.jsonl"], "--prompt-data", "does not exist"),
        (["--prompt-data", "DATA@[a:b]"], "--prompt-data", "bad slice"),
        (["--eval-prompt-data", "math"], "--eval-prompt-data", "NAME PATH"),
        (["--eval-prompt-data", "math", "/nowhere/e.jsonl"], "--eval-prompt-data", "does not exist"),
        (["--eval-prompt-data", "a", "DATA", "a", "DATA"], "--eval-prompt-data", "repeat"),
        (["--eval-prompt-data", "", "DATA"], "--eval-prompt-data", "set 1: 'name' is required"),
        (["--ref-load", "/nowhere/ref"], "--ref-load", "does not exist"),
    ],
)
def test_missing_or_malformed_paths(
    hf: str, data: str, capsys: pytest.CaptureFixture[str], extra: list[str], flag: str, text: str
) -> None:
    extra = [value.replace("DATA", data) for value in extra]
    assert text in expect_error(capsys, base(hf, *extra), flag)


@pytest.mark.parametrize(
    ("extra", "flag", "text"),
    [
        (
            ["--streaming-data", "--data-source-path", "m.C"],
            "--streaming-data",
            "not to a --data-source-path",
        ),
        (["--num-data-workers", "2", "--data-source-path", "m.C"], "--num-data-workers", "reads its own"),
        (["--on-bad-prompt", "skip", "--data-source-path", "m.C"], "--on-bad-prompt", "reads its own"),
        (["--streaming-data"], "--streaming-data", "reads --prompt-data"),
        (["--num-data-workers", "-1"], "--num-data-workers", "must not be negative"),
    ],
)
def test_large_prompt_set_flags_are_checked_before_anything_starts(
    hf: str, capsys: pytest.CaptureFixture[str], extra: list[str], flag: str, text: str
) -> None:
    assert text in expect_error(capsys, base(hf, *extra), flag)


# --- validation: evaluation sets (--eval-config) -------------------------------------------------


def write_eval_config(tmp_path: Path, sets: object) -> str:
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(sets))
    return str(path)


def test_eval_config_keys_win_over_the_eval_flags_which_win_over_the_rollout_flags(
    hf: str, data: str, tmp_path: Path, plugin_module: str
) -> None:
    own = {
        "name": "own", "path": f"{data}@[0:1]", "input_key": "q", "label_key": "ans", "rm_type": "math",
        "n_samples_per_eval_prompt": 4, "temperature": 0, "top_p": 0.5, "top_k": 20,
        "max_response_len": 64, "apply_chat_template": True,
    }  # fmt: skip
    config = write_eval_config(tmp_path, [own, {"name": "inherits", "path": data}])
    args = parse_args(
        base(hf, "--eval-config", config, "--eval-temperature", "0.8", "--rollout-top-p", "0.9",
             "--n-samples-per-eval-prompt", "2", "--eval-label-key", "label", "--rm-type", "exact",
             "--custom-rm-path", f"{plugin_module}.score", "--group-rm")
    )  # fmt: skip
    assert args.eval_sets == [
        EvalSetSettings(**own, custom_rm_path=None, group_rm=False),
        EvalSetSettings(
            name="inherits", path=data, input_key="input", label_key="label", rm_type="exact",
            custom_rm_path=f"{plugin_module}.score", group_rm=True, n_samples_per_eval_prompt=2,
            temperature=0.8, top_p=0.9, top_k=-1, max_response_len=1024, apply_chat_template=False,
        ),
    ]  # fmt: skip
    assert isinstance(args.eval_sets[0].temperature, float)  # YAML's 0 is an int


def test_an_unknown_eval_config_key_is_one_line_naming_the_key_and_the_file(
    hf: str, data: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_eval_config(tmp_path, [{"name": "a", "path": data, "tempreature": 0.6}])
    err = expect_error(capsys, base(hf, "--eval-config", config), "--eval-config")
    assert f"{config}: set 1 (a): unknown key 'tempreature'" in err
    assert "known keys: name, path, input_key" in err


@pytest.mark.parametrize(
    ("sets", "flag", "text"),
    [
        ({"name": "a", "path": "DATA"}, "--eval-config", "non-empty YAML list"),
        ([], "--eval-config", "non-empty YAML list"),
        (["a"], "--eval-config", "set 1 is a str, not a mapping"),
        ([{"name": "a"}], "--eval-config", "set 1 (a): 'path' is required"),
        ([{"name": "a", "path": "DATA", "n_samples_per_eval_prompt": 0}], "--eval-config", "integer >= 1"),
        ([{"name": "a", "path": "DATA", "top_p": 1.5}], "--eval-config", "top_p must be a number in (0, 1]"),
        ([{"name": "a", "path": "DATA", "apply_chat_template": "yes"}], "--eval-config", "true or false"),
        ([{"name": "a", "path": "/nowhere/e.jsonl"}], "--eval-config", "does not exist"),
        ([{"name": "a", "path": "DATA"}, {"name": "a", "path": "DATA"}], "--eval-config", "repeat"),
        ([{"name": "a", "path": "DATA", "custom_rm_path": "no_such_module.fn"}], "--eval-config", "set 'a'"),
        ([{"name": "a", "path": "DATA", "rm_type": "remote"}], "--rm-url", "eval set 'a'"),
    ],
)
def test_bad_eval_configs_are_one_line(
    hf: str, data: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], sets: object, flag: str, text: str
) -> None:
    config = write_eval_config(tmp_path, json.loads(json.dumps(sets).replace("DATA", data)))
    assert text in expect_error(capsys, base(hf, "--eval-config", config), flag)


def test_eval_config_files_that_cannot_be_read_and_both_set_flags_are_refused(
    hf: str, data: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "does not exist" in expect_error(
        capsys, base(hf, "--eval-config", "/nowhere.yaml"), "--eval-config"
    )
    broken = tmp_path / "broken.yaml"
    broken.write_text("- name: a\n  path: [unclosed\n")
    assert "not valid YAML" in expect_error(capsys, base(hf, "--eval-config", str(broken)), "--eval-config")
    config = write_eval_config(tmp_path, [{"name": "a", "path": data}])
    argv = base(hf, "--eval-config", config, "--eval-prompt-data", "b", data)
    assert "cannot be combined with --eval-prompt-data" in expect_error(capsys, argv, "--eval-config")


# --- validation: plugins -----------------------------------------------------------------------


@pytest.fixture
def plugin_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "cfg_test_plugin.py").write_text("def score(*a):\n    return 1.0\n\nNOT_A_FUNCTION = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "cfg_test_plugin"


def test_importable_plugins_pass_and_the_default_rollout_is_not_imported(
    hf: str, plugin_module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(sys.modules, "slime.rollout.sglang_rollout", raising=False)  # other tests import it
    args = parse_args(base(hf, "--custom-rm-path", f"{plugin_module}.score"))
    assert args.custom_rm_path == f"{plugin_module}.score"
    assert "slime.rollout.sglang_rollout" not in sys.modules


@pytest.mark.parametrize(
    ("flag", "path", "text"),
    [
        ("--custom-rm-path", "score", "not a dotted path"),
        ("--custom-generate-function-path", "no_such_module_xyz.generate", "ModuleNotFoundError"),
        (
            "--custom-advantage-function-path",
            "PLUGIN.missing",
            "AttributeError: module 'cfg_test_plugin' has no attribute 'missing'",
        ),
        ("--custom-loss-function-path", "PLUGIN.NOT_A_FUNCTION", "not a callable"),
        (
            "--rollout-function-path",
            "no_such_module_xyz.rollout",
            "cannot import module 'no_such_module_xyz'",
        ),
    ],
)
def test_bad_plugin_paths(
    hf: str, plugin_module: str, capsys: pytest.CaptureFixture[str], flag: str, path: str, text: str
) -> None:
    err = expect_error(capsys, base(hf, flag, path.replace("PLUGIN", plugin_module)), flag)
    assert text in err


# --- validation: model flags vs config.json ----------------------------------------------------


def test_query_group_mismatch_message(hf: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = expect_error(
        capsys, base(hf, "--group-query-attention", "--num-query-groups", "4"), "--num-query-groups"
    )
    assert err == (
        f"error: --num-query-groups: 4 does not match num_key_value_heads=2 in {hf}/config.json; "
        "use --num-query-groups 2 (or source the right scripts/models/*.sh)"
    )


@pytest.mark.parametrize(
    ("extra", "overrides", "flag", "text"),
    [
        (["--num-layers", "3"], {}, "--num-layers", "num_hidden_layers=2"),
        (["--hidden-size", "64"], {}, "--hidden-size", "use --hidden-size 128"),
        (["--num-attention-heads", "8"], {}, "--num-attention-heads", "num_attention_heads=4"),
        (["--ffn-hidden-size", "256"], {}, "--ffn-hidden-size", "intermediate_size=512"),
        (["--kv-channels", "16"], {"head_dim": 32}, "--kv-channels", "head_dim=32"),
        (["--vocab-size", "65"], {}, "--vocab-size", "vocab_size=64"),
        (["--rotary-base", "10000"], {"rope_theta": 1e6}, "--rotary-base", "rope_theta=1000000"),
        (["--rotary-base", "500"], {"rope_theta": None, "rope_parameters": {"rope_theta": 1e6}},
         "--rotary-base", "rope_parameters.rope_theta=1000000"),
        (["--untie-embeddings-and-output-weights"], {}, "--untie-embeddings-and-output-weights",
         "tie_word_embeddings=true"),
        (["--norm-epsilon", "1e-5"], {}, "--norm-epsilon", "rms_norm_eps=1e-06"),
        (["--normalization", "LayerNorm"], {}, "--normalization", "use --normalization RMSNorm"),
        (["--qk-layernorm"], {}, "--qk-layernorm", "model_type=qwen2"),
        (["--add-qkv-bias"], {"model_type": "llama", "attention_bias": False}, "--add-qkv-bias",
         "attention_bias=false"),
        (["--num-experts", "4"], {"num_experts": 8}, "--num-experts", "num_experts=8"),
        (["--num-experts", "4"], {"num_local_experts": 8}, "--num-experts", "num_local_experts=8"),
        (["--moe-router-topk", "2"], {"num_experts": 8, "num_experts_per_tok": 4}, "--moe-router-topk",
         "num_experts_per_tok=4"),
        (["--moe-ffn-hidden-size", "32"], {"num_experts": 8, "moe_intermediate_size": 64},
         "--moe-ffn-hidden-size", "moe_intermediate_size=64"),
    ],
)  # fmt: skip
def test_model_flags_must_match_config_json(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    overrides: dict[str, object],
    flag: str,
    text: str,
) -> None:
    hf = make_hf(tmp_path, **overrides)
    err = expect_error(capsys, base(hf, *extra), flag)
    assert text in err and "config.json" in err and "scripts/models" in err


def test_norm_epsilon_matches_to_relative_precision(hf: str) -> None:
    assert parse_args(base(hf, "--norm-epsilon", "0.000001")).norm_epsilon == 1e-6


def test_without_gqa_every_head_is_its_own_group(tmp_path: Path) -> None:
    hf = make_hf(tmp_path, num_key_value_heads=None)
    args = parse_args(base(hf))
    assert not args.group_query_attention and args.num_query_groups == 4


def test_configure_without_explicit_set_fills_flags_left_at_default(tmp_path: Path) -> None:
    hf = make_hf(tmp_path, rope_theta=1e6)
    args = namespace(hf)
    configure(args)
    assert args.rotary_base == 1_000_000 and args.num_layers == 2 and args.sglang_server_args == {}


def test_validating_twice_changes_nothing(hf: str) -> None:
    args = parse_args(base(hf, "--actor-num-gpus-per-node", "2", "--global-batch-size", "16"))
    before = dict(vars(args))
    configure(args)
    assert vars(args) == before


def test_the_checks_only_read_and_the_derivations_are_the_only_writers(
    hf: str, data: str, tmp_path: Path
) -> None:
    """validate.py holds checks only: each of its steps leaves the namespace as it found it, and every
    other step is a derivation (derive.py)."""
    plugin = tmp_path / "reward.py"
    plugin.write_text("def reward(args, sample):\n    return 0.0\n")
    argv = base(
        hf, "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2", "--prompt-data", data,
        "--eval-prompt-data", "aime", data, "--eval-interval", "1", "--custom-rm-path", f"{plugin}:reward",
    )  # fmt: skip
    parser = build_parser()
    args = parser.parse_args(argv)
    steps = configure_steps(args, explicit_dests(parser, argv))
    modules = [getattr(step, "func", step).__module__ for step in steps]
    assert set(modules) == {"slime.config.derive", "slime.config.validate"}
    for step, module in zip(steps, modules, strict=True):
        before = copy.deepcopy(vars(args))
        step(args)
        if module == "slime.config.validate":
            assert vars(args) == before, f"{step.__name__} wrote into args"
    assert args.data_parallel_size == 1 and args.eval_sets[0].custom_rm_path == f"{plugin}:reward"


def test_the_rm_types_validation_accepts_are_the_ones_scoring_maps(
    hf: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from slime.config.reward_types import BUILTIN_REWARD_TYPES
    from slime.rollout.rewards.scoring import BUILTIN_REWARDS

    assert tuple(BUILTIN_REWARDS) == BUILTIN_REWARD_TYPES
    assert parse_args(base(hf, "--rm-type", "boxed_dapo")).rm_type == "boxed_dapo"
    error = expect_error(capsys, base(hf, "--rm-type", "mathh"), "--rm-type")
    assert "choose one of math, exact, f1," in error


def test_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--help"])
    assert exc.value.code == 0 and "slime: debug:" in capsys.readouterr().out


def test_flags_whose_feature_has_not_landed_are_refused_by_name(hf: str) -> None:
    extra, flag = ("--ref-load", "."), "--ref-load"
    args = parse_args(base(hf, *extra))
    with pytest.raises(ConfigError) as exc:
        check_implemented(args)
    assert exc.value.flag == flag and "not implemented" in exc.value.line()


# --- checkpoints to load -----------------------------------------------------------------------


def test_ckpt_step_picks_a_saved_rollout_and_names_the_saved_ones(
    hf: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    for rollout_id in (1, 3):
        (ckpt / f"iter_{rollout_id:07d}").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3")
    assert parse_args(base(hf, "--load", str(ckpt), "--ckpt-step", "1")).ckpt_step == 1
    err = expect_error(capsys, base(hf, "--load", str(ckpt), "--ckpt-step", "2"), "--ckpt-step")
    assert "no checkpoint of rollout 2" in err and "saved rollouts: [1, 3]" in err
    expect_error(capsys, base(hf, "--ckpt-step", "1"), "--ckpt-step")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("5")
    assert "iter_0000005 is missing" in expect_error(capsys, base(hf, "--load", str(ckpt)), "--load")
    # A --load directory without a checkpoint yet is a fresh start (the run's own --save dir).
    assert parse_args(base(hf, "--load", str(tmp_path / "empty"))).load is not None
