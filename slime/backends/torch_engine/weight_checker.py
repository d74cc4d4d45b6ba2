"""SGLang's ``/weights_checker`` (``srt/utils/weight_checker.py``, 0.5.19 and 0.5.23): a debugging aid
that proves a weight push restores the checkpoint bit for bit. ``snapshot`` copies every parameter,
``reset_tensors`` overwrites them with noise, a push follows, and ``compare`` fails with the tensors that
differ from the snapshot. ``--check-weight-update-equal`` drives it (``slime.ray.session``).

The torch engine implements these three actions with SGLang's replies (``{"success": true, "message":
"Success."}``, or ``false`` with the error text and HTTP 400); its ``checksum`` action, whose payload
differs between the releases, is refused in the same shape. A LoRA adapter lives outside the model's
parameters (``slime.backends.torch_engine.lora``), so it is neither snapshotted nor reset.
"""

from __future__ import annotations

import torch

ACTIONS = ("snapshot", "reset_tensors", "compare")


class WeightChecker:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._snapshot: dict[str, torch.Tensor] | None = None

    def handle(self, action: str, skip_tensor_list: list[str] | None = None) -> None:
        """Runs ``action``; raises with SGLang's message when it is unknown or a comparison fails."""
        if action == "snapshot":
            self._snapshot = {name: p.detach().to("cpu", copy=True) for name, p in self._params(None)}
        elif action == "reset_tensors":
            with torch.no_grad():
                for _, param in self._params(skip_tensor_list):
                    param.copy_(torch.rand_like(param, dtype=torch.float32).to(param.dtype))
        elif action == "compare":
            self._compare(skip_tensor_list)
        else:
            raise ValueError(f"Unsupported action={action!r}")

    def _params(self, skip_tensor_list: list[str] | None) -> list[tuple[str, torch.Tensor]]:
        return [
            (name, param)
            for name, param in self.model.named_parameters()
            if not any(pattern in name for pattern in skip_tensor_list or ())
        ]

    def _compare(self, skip_tensor_list: list[str] | None) -> None:
        if self._snapshot is None:
            raise ValueError("compare needs a snapshot first (action=snapshot)")
        errors = []
        for name, param in self._params(skip_tensor_list):
            expected, actual = self._snapshot[name], param.detach().cpu()
            if not torch.equal(expected, actual):
                error = (expected.float() - actual.float()).abs()
                max_err, mean_err = error.max().item(), error.mean().item()
                errors.append(f"name={name} max_abs_err={max_err} mean_abs_err={mean_err}")
        if errors:
            raise ValueError("check tensor equality failed:\n" + "\n".join(errors))
