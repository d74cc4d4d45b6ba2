"""The usage guide's commands, verbatim, parse (issue 33 item 6).

The guide is the slime usage guide users follow ("slime: LLM Post-Training Framework for RL Scaling",
the slime SKILL.md of Orchestra-Research/AI-Research-SKILLs, written for THUDM/slime). Its commands are
quoted below exactly as the guide prints them. Each is run through ``slime.config.parse_args`` and the
checks its entry point adds, with what the guide leaves to the user filled in:

* ``${MODEL_ARGS[@]}`` becomes the tiny model's flags (``scripts/models/tiny-qwen2.sh``) plus what
  upstream's run scripts keep in the arrays beside it (``CKPT_ARGS``, ``OPTIMIZER_ARGS``): the tiny
  checkpoint, a ``--save`` directory and ``--lr``; ``${CKPT_ARGS[@]}`` is then empty.
* ``/path/to/<file>.jsonl`` becomes a file in ``tmp_path`` holding the guide's own example rows.
* A block of flags that is not a command (configuration reference, common issues, multi-task
  evaluation, the custom reward model) is added to the guide's Quick Start command.

Commands the guide prints without a flag a run cannot do without are refused in one line that names
the flag to add; those refusals are pinned here too.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from pathlib import Path

import pytest

from slime.cli import check_implemented, check_overlappable
from slime.config import parse_args
from tests.support.models import model_args

QUICK_START = """\
python train.py \\
    --actor-num-nodes 1 \\
    --actor-num-gpus-per-node 4 \\
    --rollout-num-gpus 4 \\
    --advantage-estimator grpo \\
    --use-kl-loss --kl-loss-coef 0.001 \\
    --rollout-batch-size 32 \\
    --n-samples-per-prompt 8 \\
    --global-batch-size 256 \\
    --num-rollout 3000 \\
    --prompt-data /path/to/data.jsonl \\
    ${MODEL_ARGS[@]} ${CKPT_ARGS[@]}"""

WORKFLOW_1 = """\
python train.py \\
    --actor-num-nodes 1 \\
    --actor-num-gpus-per-node 8 \\
    --rollout-num-gpus 8 \\
    --advantage-estimator grpo \\
    --use-kl-loss \\
    --kl-loss-coef 0.001 \\
    --prompt-data /path/to/train.jsonl \\
    --input-key prompt \\
    --label-key label \\
    --apply-chat-template \\
    --rollout-batch-size 32 \\
    --n-samples-per-prompt 8 \\
    --global-batch-size 256 \\
    --num-rollout 3000 \\
    --save-interval 100 \\
    --eval-interval 50 \\
    ${MODEL_ARGS[@]}"""

WORKFLOW_2 = """\
python train_async.py \\
    --actor-num-nodes 1 \\
    --actor-num-gpus-per-node 8 \\
    --rollout-num-gpus 8 \\
    --advantage-estimator grpo \\
    --async-buffer-size 4 \\
    --prompt-data /path/to/train.jsonl \\
    ${MODEL_ARGS[@]}"""

WORKFLOW_2_PARAMETERS = """\
--async-buffer-size 4        # Number of rollouts to buffer
--update-weights-interval 2  # Sync weights every N rollouts"""

WORKFLOW_3 = """\
python train.py \\
    --custom-generate-function-path custom_generate.py \\
    --max-turns 5 \\
    --prompt-data /path/to/agent_data.jsonl \\
    ${MODEL_ARGS[@]}"""

COLOCATION = """\
python train.py \\
    --colocate \\
    --actor-num-gpus-per-node 8 \\
    --sglang-mem-fraction-static 0.4 \\
    ${MODEL_ARGS[@]}"""

# Blocks of flags, each added to the Quick Start command.
MEGATRON_ARGUMENTS = """\
--tensor-model-parallel-size 2
--pipeline-model-parallel-size 1
--num-layers 32
--hidden-size 4096"""

SGLANG_ARGUMENTS = """\
--sglang-mem-fraction-static 0.8
--sglang-context-length 8192
--sglang-log-level INFO"""

SLIME_ARGUMENTS = """\
# Resource allocation
--actor-num-nodes 1
--actor-num-gpus-per-node 8
--rollout-num-gpus 8
--colocate  # Share GPUs between training/inference

# Data
--prompt-data /path/to/data.jsonl
--input-key prompt
--label-key label

# Training loop
--num-rollout 3000
--rollout-batch-size 32
--n-samples-per-prompt 8
--global-batch-size 256

# Algorithm
--advantage-estimator grpo  # or: gspo, ppo, reinforce_plus_plus
--use-kl-loss
--kl-loss-coef 0.001"""

ENGINE_CRASH = """\
# Enable fault tolerance
--use-fault-tolerance

# Increase memory allocation
--sglang-mem-fraction-static 0.85

# Reduce batch size
--rollout-batch-size 16"""

WEIGHT_SYNC_TIMEOUT = """\
# Increase sync interval
--update-weights-interval 5

# Use colocated mode (no network transfer)
--colocate"""

TRAINING_OOM = """\
# Enable gradient checkpointing
--recompute-activations

# Reduce micro-batch size
--micro-batch-size 1

# Enable sequence parallelism
--sequence-parallel"""

SLOW_DATA_LOADING = """\
# Increase data workers
--num-data-workers 4

# Use streaming dataset
--streaming-data"""

CUSTOM_REWARD_MODEL_FLAG = "--custom-rm-path custom_rm.py"

EVALUATION_MULTI_TASK = """\
--eval-prompt-data aime /path/to/aime.jsonl \\
--eval-prompt-data gsm8k /path/to/gsm8k.jsonl \\
--n-samples-per-eval-prompt 16"""

# The guide's data rows (Workflow 1, step 1) and its plugin files, as the guide prints them.
GUIDE_ROWS = [
    {"prompt": "What is 2 + 2?", "label": "4"},
    {"prompt": "Solve: 3x = 12", "label": "x = 4"},
]

CUSTOM_GENERATE_PY = '''\
# custom_generate.py
async def custom_generate(args, samples, evaluation=False):
    """Multi-turn generation with tool calling."""
    for sample in samples:
        conversation = sample.prompt

        for turn in range(args.max_turns):
            # Generate response
            response = await generate_single(conversation)

            # Check for tool call
            tool_call = extract_tool_call(response)
            if tool_call:
                tool_result = execute_tool(tool_call)
                conversation.append({"role": "assistant", "content": response})
                conversation.append({"role": "tool", "content": tool_result})
            else:
                break

        sample.response = response
        sample.reward = compute_reward(sample)

    return samples
'''

CUSTOM_RM_PY = """\
# custom_rm.py
class CustomRewardModel:
    def __init__(self, model_path):
        self.model = load_model(model_path)

    def compute_reward(self, prompts, responses):
        inputs = self.tokenize(prompts, responses)
        scores = self.model(inputs)
        return scores.tolist()
"""

Argv = Callable[..., list[str]]


def guide_tokens(text: str) -> list[str]:
    """The words of a guide command or flag block as bash reads them: line continuations joined,
    ``# ...`` comments dropped, ``python <script>.py`` left out (the test calls the parser itself)."""
    words = shlex.split(text.replace("\\\n", " "), comments=True)
    return words[2:] if words[:1] == ["python"] else words


@pytest.fixture
def argv(tmp_path: Path, tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> Argv:
    """``argv(*guide_texts, model=True)``: the guide's texts as one argv, with the substitutions of
    the module docstring; ``model=False`` leaves out what upstream keeps beside ``${MODEL_ARGS[@]}``
    (``--save``, ``--lr``), to see what the guide's words alone get. Runs in ``tmp_path``, where the
    guide's relative plugin files are written."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "custom_generate.py").write_text(CUSTOM_GENERATE_PY)
    (tmp_path / "custom_rm.py").write_text(CUSTOM_RM_PY)
    rows = "".join(json.dumps(row) + "\n" for row in GUIDE_ROWS)
    companions = ["--save", str(tmp_path / "ckpt"), "--lr", "1e-6"]

    def build(*texts: str, model: bool = True) -> list[str]:
        tiny = [*model_args("tiny-qwen2.sh"), "--hf-checkpoint", str(tiny_models["qwen2"])]
        out: list[str] = []
        for word in (w for text in texts for w in guide_tokens(text)):
            if word == "${MODEL_ARGS[@]}":
                out += tiny + (companions if model else [])
            elif word == "${CKPT_ARGS[@]}":
                continue
            elif word.startswith("/path/to/"):
                path = tmp_path / word.removeprefix("/path/to/")
                path.write_text(rows)
                out.append(str(path))
            else:
                out.append(word)
        return out

    return build


def refusal(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """The one line the parser refuses ``argv`` with (exit code 2)."""
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_quick_start_parses(argv: Argv) -> None:
    args = parse_args(argv(QUICK_START))
    check_implemented(args)
    assert (args.rollout_batch_size, args.n_samples_per_prompt, args.global_batch_size) == (32, 8, 256)
    assert args.num_steps_per_rollout == 1


def test_workflow_1_runs_with_one_warning_and_evaluation_off(
    argv: Argv, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--eval-interval 50`` with no eval data: upstream runs it without evaluating, and so does
    this (it was refused before), saying so once."""
    args = parse_args(argv(WORKFLOW_1))
    check_implemented(args)
    warnings = capsys.readouterr().err.strip().splitlines()
    assert len(warnings) == 1 and warnings[0].startswith("warning: --eval-interval: "), warnings
    assert "evaluation is off" in warnings[0]
    assert args.eval_interval is None and args.eval_sets == []
    assert (args.input_key, args.label_key, args.apply_chat_template) == ("prompt", "label", True)


def test_workflow_1_without_its_checkpoint_array_names_the_missing_flag(
    argv: Argv, capsys: pytest.CaptureFixture[str]
) -> None:
    """The guide's command alone saves every 100 rollouts with nowhere to save: one line naming the
    flag to add (the guide's Quick Start keeps it in ``CKPT_ARGS``). ``--lr`` may be left out: it
    defaults to upstream's 1e-6."""
    words = argv(WORKFLOW_1, model=False)
    assert refusal(capsys, words) == "error: --save-interval: given without --save; add --save DIR"


def test_workflow_2_parses_for_train_async(argv: Argv, capsys: pytest.CaptureFixture[str]) -> None:
    """As printed, the async command has no batch size (upstream's ``--rollout-batch-size`` is a
    required flag too): one line naming it. With the Quick Start's loop flags and the workflow's
    parameters block it parses, and train_async.py's own check passes."""
    assert refusal(capsys, argv(WORKFLOW_2)).startswith("error: --rollout-batch-size: required")
    loop = "--rollout-batch-size 32 --n-samples-per-prompt 8 --global-batch-size 256 --num-rollout 3000"
    args = parse_args(argv(WORKFLOW_2, WORKFLOW_2_PARAMETERS, loop))
    check_overlappable(args)
    check_implemented(args)
    assert (args.async_buffer_size, args.update_weights_interval) == (4, 2)


def test_workflow_3_bare_generate_file_parses(argv: Argv, capsys: pytest.CaptureFixture[str]) -> None:
    """``--custom-generate-function-path custom_generate.py``: the guide's bare file, resolved to its
    ``custom_generate``. As printed the command has no batch size: one line naming it; added to the
    Quick Start it parses."""
    assert refusal(capsys, argv(WORKFLOW_3)).startswith("error: --rollout-batch-size: required")
    args = parse_args(argv(QUICK_START, guide_command_flags(WORKFLOW_3)))
    check_implemented(args)
    assert args.max_turns == 5
    assert args.custom_generate_function_path.endswith("custom_generate")


def test_colocation_command_parses_with_workflow_1(argv: Argv, capsys: pytest.CaptureFixture[str]) -> None:
    """As printed it has no batch size: one line naming it. Added to Workflow 1 (8 trainer GPUs,
    the same 8 for the engines) it parses."""
    assert refusal(capsys, argv(COLOCATION)).startswith("error: --rollout-batch-size: required")
    args = parse_args(argv(WORKFLOW_1, guide_command_flags(COLOCATION)))
    check_implemented(args)
    assert args.colocate and float(args.sglang_server_args["mem_fraction_static"]) == 0.4


def guide_command_flags(command: str) -> str:
    """A guide command without its script and ``${MODEL_ARGS[@]}``: its flags, to add to another."""
    return shlex.join(w for w in guide_tokens(command) if w != "${MODEL_ARGS[@]}")


@pytest.mark.parametrize(
    "block",
    [
        pytest.param(SGLANG_ARGUMENTS, id="sglang-arguments"),
        pytest.param(SLIME_ARGUMENTS, id="slime-arguments"),
        pytest.param(SLOW_DATA_LOADING, id="issue-slow-data-loading"),
    ],
)
def test_flag_blocks_parse_added_to_the_quick_start(argv: Argv, block: str) -> None:
    args = parse_args(argv(QUICK_START, block))
    check_implemented(args)


def test_engine_crash_block_names_the_global_batch_to_match(
    argv: Argv, capsys: pytest.CaptureFixture[str]
) -> None:
    """The guide halves ``--rollout-batch-size`` and keeps ``--global-batch-size 256``: 16 x 8 samples
    cannot fill a 256-sample step, one line naming the global batch to use; with it, it parses."""
    line = refusal(capsys, argv(QUICK_START, ENGINE_CRASH))
    assert line.startswith("error: --global-batch-size: ") and "--global-batch-size 128" in line
    args = parse_args(argv(QUICK_START, ENGINE_CRASH, "--global-batch-size 128"))
    check_implemented(args)
    assert args.use_fault_tolerance and float(args.sglang_server_args["mem_fraction_static"]) == 0.85


def test_megatron_block_parses_as_the_model_it_describes(
    argv: Argv, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reference's Megatron block names a 32-layer, 4096-wide model: against the tiny checkpoint's
    config.json that is one line naming the mismatch; its parallel flags alone parse."""
    line = refusal(capsys, argv(QUICK_START, MEGATRON_ARGUMENTS))
    assert line.startswith(("error: --num-layers: ", "error: --hidden-size: ")), line
    parallel = "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1"
    args = parse_args(argv(QUICK_START, parallel))
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 1)


def test_weight_sync_timeout_block_is_two_alternatives(
    argv: Argv, capsys: pytest.CaptureFixture[str]
) -> None:
    """The guide offers a longer sync interval or co-location; together they cannot work (co-located
    engines hand their memory to the trainer every rollout): one line saying to drop the interval.
    Each alone parses."""
    line = refusal(capsys, argv(QUICK_START, WEIGHT_SYNC_TIMEOUT))
    assert line.startswith("error: --update-weights-interval: must be 1 with --colocate"), line
    interval, colocate = WEIGHT_SYNC_TIMEOUT.split("\n\n")
    assert parse_args(argv(QUICK_START, interval)).update_weights_interval == 5
    assert parse_args(argv(QUICK_START, colocate)).colocate


def test_training_oom_block_parses_with_tensor_parallelism(
    argv: Argv, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--sequence-parallel`` only means something with TP > 1 and Transformer Engine's norms: each
    missing one is one line naming the flag to add; with both it parses."""
    line = refusal(capsys, argv(QUICK_START, TRAINING_OOM))
    assert line.startswith("error: --sequence-parallel: ") and "tensor-model-parallel-size" in line
    line = refusal(capsys, argv(QUICK_START, TRAINING_OOM, "--tensor-model-parallel-size 2"))
    assert line.startswith("error: --sequence-parallel: ") and "--transformer-impl transformer_engine" in line
    te = "--tensor-model-parallel-size 2 --transformer-impl transformer_engine"
    args = parse_args(argv(QUICK_START, TRAINING_OOM, te))
    check_implemented(args)
    assert args.sequence_parallel and args.micro_batch_size == 1


def test_custom_reward_model_class_without_model_path_names_the_flag(
    argv: Argv, capsys: pytest.CaptureFixture[str]
) -> None:
    """The guide's ``CustomRewardModel(model_path)`` needs a model path the guide never passes: one
    line naming ``--custom-rm-model-path``; with it, the bare file resolves to the class."""
    line = refusal(capsys, argv(QUICK_START, CUSTOM_REWARD_MODEL_FLAG))
    assert "--custom-rm-model-path" in line, line
    args = parse_args(argv(QUICK_START, CUSTOM_REWARD_MODEL_FLAG, "--custom-rm-model-path /tmp/rm"))
    check_implemented(args)
    assert args.custom_rm_path.endswith("CustomRewardModel")


def test_evaluation_multi_task_block_parses(argv: Argv) -> None:
    """A repeated --eval-prompt-data adds a set each (action extend): the guide's 'aime' is kept."""
    args = parse_args(argv(QUICK_START, EVALUATION_MULTI_TASK))
    check_implemented(args)
    assert args.n_samples_per_eval_prompt == 16
    assert [s.name for s in args.eval_sets] == ["aime", "gsm8k"]
