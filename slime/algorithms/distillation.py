"""On-policy distillation (Agarwal et al. 2024; Thinking Machines' "on-policy distillation", 2025): the
student samples, a teacher scores every sampled token, and the per-token reverse KL estimate
``log π_student(a_t) − log π_teacher(a_t)`` is a penalty on that token's advantage.

It is applied after the advantage estimator, whichever it is, so GRPO, PPO, GSPO or REINFORCE++ keep
their own credit assignment and the teacher adds a dense per-token signal on top. With the task
reward set to 0 (``--opd-only``) the group-normalised advantages vanish and only the teacher trains.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def reverse_kl_per_token(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """The sampled-token estimate of KL(π_student ‖ π_teacher) at each token: its expectation under the
    student's own samples is the reverse KL, which penalises mass the teacher would not put there."""
    return student.float() - teacher.float()


def opd_advantages(
    advantages: Sequence[torch.Tensor | Sequence[float]],
    student_log_probs: Sequence[torch.Tensor],
    teacher_log_probs: Sequence[torch.Tensor | Sequence[float]],
    loss_masks: Sequence[torch.Tensor | Sequence[int]],
    coef: float,
) -> list[torch.Tensor]:
    """``A_t − coef · (log π_student(a_t) − log π_teacher(a_t))`` per sample; a token with loss mask 0
    (not the policy's: tool output, an observation) keeps its advantage."""
    shaped = []
    rows = zip(advantages, student_log_probs, teacher_log_probs, loss_masks, strict=True)
    for adv, student, teacher, mask in rows:
        penalty = reverse_kl_per_token(torch.as_tensor(student), torch.as_tensor(teacher))
        kept = torch.as_tensor(mask, dtype=torch.float32)
        shaped.append(torch.as_tensor(adv, dtype=torch.float32) - coef * penalty * kept)
    return shaped
