"""The TRL side of ``bench/peer_trl.py``: ``trl.GRPOTrainer`` on the quickstart task, run in TRL's venv.

Not meant to be run by hand (``peer_trl.py`` starts it with the TRL venv's python and reads the JSON it
writes), but it can be:

    .venv-peer-trl/bin/python bench/peer_trl_trainer.py --model SFT_DIR --train-data train.jsonl \\
        --output-dir OUT --num-steps 3 --result OUT/result.json

It imports nothing from slime except the exact-match reward, which it loads straight from
``slime/rollout/rewards/text.py`` (a file with no dependencies) so both contenders score alike. Every
GRPOConfig argument is set explicitly in ``grpo_config_kwargs`` (and written to the result JSON), the
ones equal to TRL's defaults included, so the comparison does not depend on a default moving.

Per optimizer step it records the wall-clock (between consecutive ``on_step_end`` callbacks, the first
from ``on_train_begin``), the time spent in generation + reward + advantages
(``_generate_and_score_completions``, timed by a subclass), and TRL's own log line (reward, loss,
grad norm, learning rate, completion lengths, ...).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
REWARD_FILE = REPO / "slime/rollout/rewards/text.py"

PROMPTS_PER_STEP = 16
SAMPLES_PER_PROMPT = 8
MICRO_BATCH = 32


def load_exact_score() -> Any:
    """slime's ``exact_score`` (response.strip() == label.strip()), loaded without importing slime."""
    spec = importlib.util.spec_from_file_location("slime_text_rewards", REWARD_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.exact_score


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def grpo_config_kwargs(
    output_dir: Path, num_steps: int, seed: int, max_completion_length: int = 8
) -> dict[str, Any]:
    """The GRPOConfig matching the quickstart's GRPO phase (see peer_trl.py's docstring)."""
    samples = PROMPTS_PER_STEP * SAMPLES_PER_PROMPT
    return {
        "output_dir": str(output_dir),
        # Batch: one generation batch of 16 prompts x 8 samples = exactly one optimizer step.
        "num_generations": SAMPLES_PER_PROMPT,
        "per_device_train_batch_size": MICRO_BATCH,
        "gradient_accumulation_steps": samples // MICRO_BATCH,
        "num_iterations": 1,
        "max_steps": num_steps,
        "shuffle_dataset": True,
        # Sampling: plain temperature-1 sampling of at most 8 tokens (the quickstart's limit).
        "max_completion_length": max_completion_length,
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": None,
        "repetition_penalty": 1.0,
        # Objective: group-normalised advantages, PPO clip 0.2, no KL, token mean over the global batch.
        "scale_rewards": "group",
        "loss_type": "dapo",
        "epsilon": 0.2,
        "epsilon_high": 0.2,
        "beta": 0.0,
        "mask_truncated_completions": False,
        "importance_sampling_level": "token",
        "top_entropy_quantile": 1.0,
        "entropy_coef": 0.0,
        # Optimizer: AdamW(beta2 0.98, no weight decay), lr 1e-4 after 10 linear warm-up steps, clip 1.0.
        "learning_rate": 1e-4,
        "lr_scheduler_type": "constant_with_warmup",
        "warmup_steps": 10,
        "optim": "adamw_torch_fused",  # transformers' default with torch >= 2.8 (CPU has a fused AdamW)
        "adam_beta1": 0.9,
        "adam_beta2": 0.98,
        "adam_epsilon": 1e-8,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        # Precision and memory: fp32 as the slime run (TRL defaults bf16 on and gradient checkpointing on).
        "bf16": False,
        "fp16": False,
        "gradient_checkpointing": False,
        "disable_dropout": False,
        # Machine, logging, saving.
        "use_cpu": True,
        "seed": seed,
        "report_to": "none",
        "logging_strategy": "steps",
        "logging_steps": 1,
        "save_strategy": "no",
        "disable_tqdm": True,
        "log_completions": False,
        "dataloader_num_workers": 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="HF checkpoint to start from (the SFT one)")
    parser.add_argument("--train-data", type=Path, required=True, help="JSONL with prompt and label")
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--num-steps", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--max-completion-length", type=int, default=8, help="new tokens per completion")
    parser.add_argument("--no-save", action="store_true", help="skip saving the final checkpoint")
    opts = parser.parse_args()
    process_start = time.perf_counter()

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    exact_score = load_exact_score()

    def exact(completions: list[str], label: list[str], **_: Any) -> list[float]:
        """slime's --rm-type exact on the decoded completion (special tokens skipped, as the rollout does)."""
        return [
            exact_score(completion, answer) for completion, answer in zip(completions, label, strict=True)
        ]

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.step_times: list[float] = []
            self.logs: list[dict[str, Any]] = []
            self._last = 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            self._last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.step_times.append(now - self._last)
            self._last = now

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs is not None:
                self.logs.append({"step": state.global_step, **logs})

    class TimedGRPOTrainer(GRPOTrainer):
        """Records the seconds of each generation batch (generate, decode, reward, advantages)."""

        generation_times: list[float]

        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            result = super()._generate_and_score_completions(inputs)
            self.generation_times.append(time.perf_counter() - start)
            return result

    rows = read_jsonl(opts.train_data)
    dataset = Dataset.from_list([{"prompt": row["prompt"], "label": row["label"]} for row in rows])
    config_kwargs = grpo_config_kwargs(
        opts.output_dir / "run", opts.num_steps, opts.seed, opts.max_completion_length
    )
    clock = StepClock()
    trainer = TimedGRPOTrainer(
        model=str(opts.model),
        reward_funcs=exact,
        args=GRPOConfig(**config_kwargs),
        train_dataset=dataset,
        callbacks=[clock],
    )
    trainer.generation_times = []
    tokenizer = trainer.processing_class
    # What slime's rollout feeds the engine: AutoTokenizer's ids with add_special_tokens=False. TRL
    # calls its processing class (AutoProcessor's pick) with the tokenizer's defaults.
    prompts = [row["prompt"] for row in rows]
    slime_ids = AutoTokenizer.from_pretrained(str(opts.model))(prompts, add_special_tokens=False)["input_ids"]
    same_ids = tokenizer(text=prompts)["input_ids"] == slime_ids

    setup_s = time.perf_counter() - process_start
    train_start = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - train_start
    final = None if opts.no_save else opts.output_dir / "final"
    if final is not None:
        trainer.save_model(str(final))
        tokenizer.save_pretrained(str(final))

    step_logs = [log for log in clock.logs if "reward" in log]
    result = {
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "torch_threads": torch.get_num_threads(),
        "tokenizer_class": type(tokenizer).__name__,
        "config": config_kwargs,
        "eos_token_ids": list(trainer.eos_token_ids),
        "pad_token_id": tokenizer.pad_token_id,
        "prompt_ids_match_slime": bool(same_ids),
        "setup_s": setup_s,
        "train_s": train_s,
        "global_steps": trainer.state.global_step,
        "step_times_s": clock.step_times,
        "generation_times_s": trainer.generation_times,
        "rewards": [log["reward"] for log in step_logs],
        "losses": [log.get("loss") for log in step_logs],
        "grad_norms": [log.get("grad_norm") for log in step_logs],
        "lr_of_step": [log.get("learning_rate") for log in step_logs],
        "mean_completion_lengths": [log.get("completions/mean_length") for log in step_logs],
        "clipped_ratios": [log.get("completions/clipped_ratio") for log in step_logs],
        "logs": clock.logs,
        "final_checkpoint": None if final is None else str(final),
    }
    opts.result.parent.mkdir(parents=True, exist_ok=True)
    opts.result.write_text(json.dumps(result, indent=2) + "\n")
    print(f"trl: {trainer.state.global_step} steps in {train_s:.1f} s; wrote {opts.result}", flush=True)


if __name__ == "__main__":
    main()
