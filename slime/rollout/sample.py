"""``Sample``: the one record that crosses from rollout to training.

The data source creates it (prompt, label, metadata), the generate function fills the response side
(tokens, loss mask, log-probs, status), the reward function sets ``reward``, and the trainer reads the
token-level fields. Keeping every stage on one small typed record is what lets users swap any stage
(generate, reward, filter) by dotted path without a translation layer in between.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

import numpy as np


@dataclass
class Sample:
    """One prompt and (once generated) one response, with everything training needs from it."""

    class Status(str, Enum):
        """Where the sample is in its life; decides whether it is trained on, retried or dropped."""

        PENDING = "pending"  # created by the data source, not generated yet
        COMPLETED = "completed"  # the engine stopped on EOS or a stop string
        TRUNCATED = "truncated"  # the engine hit max_new_tokens: trainable, but the answer may be cut
        ABORTED = "aborted"  # generation was interrupted (weight update, over-sampling): can be resumed
        FAILED = "failed"  # generation or reward raised; ``metadata["error"]`` says why

    group_index: int | None = None
    """Which prompt group this belongs to: group-relative advantages (GRPO) normalise within it."""
    index: int | None = None
    """Unique, increasing id of this sample over the whole run: names it in logs and debug dumps."""
    prompt: str | list[dict[str, Any]] = ""
    """The prompt as given to generation: rendered text, or chat messages for a custom generate fn."""
    tokens: list[int] = field(default_factory=list)
    """Prompt ids followed by response ids: exactly the sequence the trainer recomputes log-probs on."""
    response: str = ""
    """Decoded response text: what reward functions read."""
    response_length: int = 0
    """Number of response tokens at the end of ``tokens``; the rest is prompt."""
    label: str | None = None
    """Reference answer for the reward function (``--label-key``)."""
    reward: float | dict[str, Any] | None = None
    """What the reward function returned; a dict is read through ``--reward-key`` (``reward_value``)."""
    loss_mask: list[int] | None = None
    """One 0/1 per response token: 0 for tokens the policy did not produce (tool output, multi-turn)."""
    rollout_log_probs: list[float] | None = None
    """Engine log-probs of the response tokens: for off-policy correction and the logprob-diff check."""
    teacher_log_probs: list[float] | None = None
    """``--use-opd``: the teacher's log-probs of the response tokens (a prefill of ``tokens`` on the
    teacher engine), parallel to ``loss_mask``. Upstream slime's name."""
    rollout_routed_experts: Any = None
    """``--use-rollout-routing-replay``: the experts the engine routed each token to, an int32 array
    ``[len(tokens) - 1, layers, topk]`` (row ``t``: the forward of token ``t``; the last token is never
    forwarded). Each row comes from the same forward as the log-prob it explains. Upstream's name."""
    status: Sample.Status = Status.PENDING
    """Outcome of generation and scoring; see ``Sample.Status``."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Per-sample data from ``--metadata-key`` plus notes stages leave for later ones (e.g. errors)."""
    weight_versions: list[str] = field(default_factory=list)
    """Engine weight version of each generation turn: shows how off-policy a sample is."""
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    """``[start, end)`` of the response tokens each generation turn produced, parallel to
    ``weight_versions``: which tokens an older policy sampled (``--mask-offpolicy-in-partial-rollout``)."""
    # Upstream slime's field names (docs/guides/upstream-compat.md): plugins written for it set or read them.
    multimodal_inputs: dict[str, Any] | None = None
    """Raw media of the prompt, as upstream names them: ``{"image": [item, ...]}`` in placeholder order
    (``--multimodal-keys``), each item as the data file gave it (a path, made absolute; a base64 string,
    with or without its ``data:`` prefix; or ``{"image": ..., "min_pixels": N, "max_pixels": N}``).
    Checked but not decoded when read: decoding and resizing happen on the rollout side. None for a
    text-only prompt."""
    multimodal_train_inputs: dict[str, Any] | None = None
    """Upstream's name for what the model's processor makes of ``multimodal_inputs`` for training
    (e.g. ``pixel_values``, ``image_grid_thw``; its outputs minus ``input_ids`` / ``attention_mask``).
    Filled by the processor on the rollout side, later; None until then and for text-only prompts."""
    remove_sample: bool = False
    """Upstream's flag for a sample to leave out of the loss: it keeps its place and reward, and its
    loss mask becomes zeros (``slime.rollout.train_data``)."""
    train_metadata: dict[str, Any] | None = None
    """Upstream's per-sample training settings (e.g. which loss); carried, not read by our trainer."""
    session_id: str | None = None
    """Upstream's routing key for consistent-hashing routers; carried with the sample."""

    @property
    def prompt_length(self) -> int:
        """Number of prompt tokens at the start of ``tokens`` (derived, so it can never disagree)."""
        return len(self.tokens) - self.response_length

    @property
    def finished(self) -> bool:
        """Generation is over for good (trainable or failed), as opposed to not started or interrupted."""
        return self.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED, Sample.Status.FAILED)

    def reset_response(self) -> None:
        """Back to the prompt alone (PENDING), e.g. an interrupted sample that will not be resumed.

        ``metadata`` is kept: it holds the data set's fields as well as notes of the discarded attempt.
        """
        del self.tokens[self.prompt_length :]
        self.response, self.response_length = "", 0
        self.loss_mask = self.rollout_log_probs = self.reward = None
        self.teacher_log_probs = self.rollout_routed_experts = None
        self.weight_versions, self.turn_spans = [], []
        self.status = Sample.Status.PENDING

    def reward_value(self, reward_key: str | None = None) -> float:
        """The scalar reward: ``reward`` itself, or ``reward[reward_key]`` when the function returned a dict.

        Raises ``ValueError`` when there is no reward or a dict cannot be read without a key.
        """
        if self.reward is None:
            raise ValueError(f"sample {self.index} has no reward yet")
        if isinstance(self.reward, dict):
            if reward_key is None:
                raise ValueError(
                    f"reward of sample {self.index} is a dict with keys {sorted(self.reward)}; "
                    "pass --reward-key to pick one"
                )
            if reward_key not in self.reward:
                raise ValueError(
                    f"--reward-key {reward_key!r} not in the reward of sample {self.index}; "
                    f"keys present: {', '.join(sorted(self.reward))}"
                )
            return float(self.reward[reward_key])
        return float(self.reward)

    def get_reward_value(self, args: argparse.Namespace) -> float:
        """Upstream slime's spelling of ``reward_value``: plugins written for it call this."""
        return self.reward_value(args.reward_key)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (status as its string value), for debug dumps and the saved
        buffer. ``multimodal_train_inputs`` (tensors) is left out: the processor remakes it from
        ``multimodal_inputs`` (``slime.rollout.generate_utils.request_images``). Routed experts become
        nested lists."""
        routes = routes_array(self.rollout_routed_experts)
        data = dataclasses.asdict(replace(self, multimodal_train_inputs=None, rollout_routed_experts=None))
        data["rollout_routed_experts"] = None if routes is None else routes.tolist()
        data["status"] = self.status.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        """Inverse of ``to_dict``; unknown keys raise ``TypeError`` so a stale dump fails loudly."""
        data = dict(data)
        if "status" in data:
            data["status"] = cls.Status(data["status"])
        if "turn_spans" in data:  # JSON turns the pairs into lists
            data["turn_spans"] = [tuple(span) for span in data["turn_spans"]]
        if "rollout_routed_experts" in data:
            data["rollout_routed_experts"] = routes_array(data["rollout_routed_experts"])
        return cls(**data)


def routes_array(routes: Any) -> np.ndarray | None:
    """``rollout_routed_experts`` in any form a generate function may leave it (our int32 array, upstream
    slime's int32 torch tensor, nested lists) as an int32 array ``[positions, layers, topk]``."""
    if routes is None:
        return None
    if hasattr(routes, "detach"):  # a torch tensor, as upstream slime stores it
        routes = routes.detach().cpu().numpy()
    array = np.asarray(routes, dtype=np.int32)
    if array.ndim != 3:
        raise ValueError(f"rollout_routed_experts must be [positions, layers, topk], got shape {array.shape}")
    return array
