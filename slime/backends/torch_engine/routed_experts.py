"""Routed experts (R3): the top-k expert ids every MoE layer picked for every token the engine computes.

SGLang's ``--enable-return-routed-experts`` (0.5.19-0.5.23, ``srt/state_capturer/routed_experts.py``
and ``base.py``) keeps an int32 row ``[num_hidden_layers, num_experts_per_tok]`` per KV slot, written
by each MoE layer's top-k at the layer's index and zero at every dense layer; a request that asked
(``return_routed_experts``) gets the rows of its positions ``[routed_experts_start_len, seqlen - 1)``
as ``meta_info["routed_experts"]``: base64 of the C-order int32 bytes. The last token is never
forwarded, so it has no row.

Here a forward hook on each MoE router module records the indices the router returned, which are the
ones the layer's experts then ran on (DeepSeek-V3 and GLM-4.5's group-limited choice over the
bias-corrected scores included). The scheduler keeps the rows per request (``Request.routes``): a
request whose prompt keys and values were copied from another's gets that request's rows with them,
and a request prefilled again after a retraction records its rows again.
"""

from __future__ import annotations

import base64
import re
from typing import Any

import numpy as np
import torch

# The router modules of the MoE models transformers 5 ships that the engine serves; each returns
# ``(router_logits, routing_weights, expert_indices)`` with indices ``[tokens, num_experts_per_tok]``
# over the flattened batch.
ROUTER_CLASSES = frozenset(
    {"Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "DeepseekV3TopkRouter", "Glm4MoeTopkRouter"}
)
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class RoutedExpertsCapture:
    """Forward hooks on the routers of ``model``; ``record`` turns them on for one forward."""

    def __init__(self, model: torch.nn.Module, text_config: Any) -> None:
        self.num_layers = int(text_config.num_hidden_layers)
        topk = getattr(text_config, "num_experts_per_tok", None)
        routers = [
            (int(match.group(1)), module)
            for name, module in model.named_modules()
            if type(module).__name__ in ROUTER_CLASSES and (match := _LAYER_INDEX.search(name))
        ]
        if not routers or topk is None:
            raise ValueError(
                f"--enable-return-routed-experts: the model ({type(model).__name__}) has no MoE router "
                f"the torch engine knows ({', '.join(sorted(ROUTER_CLASSES))}); drop the flag"
            )
        self.topk = int(topk)
        self.moe_layers = sorted(layer for layer, _ in routers)
        self._rows: torch.Tensor | None = None
        for layer, module in routers:
            module.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int):
        def record(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            if self._rows is not None:
                self._rows[:, layer] = output[2].reshape(-1, self.topk).to("cpu", torch.int32)

        return record

    def start(self, tokens: int) -> None:
        """Record the next forward, of ``tokens`` flattened positions (dense layers' rows stay zero)."""
        self._rows = torch.zeros((tokens, self.num_layers, self.topk), dtype=torch.int32)

    def finish(self) -> torch.Tensor:
        """The rows of the forward since ``start``: ``[tokens, num_layers, topk]`` int32."""
        rows, self._rows = self._rows, None
        assert rows is not None  # start() came first
        return rows


def encode_routes(rows: torch.Tensor | np.ndarray) -> str:
    """``meta_info["routed_experts"]`` as SGLang writes it: base64 of the int32 bytes, C order."""
    array = np.ascontiguousarray(np.asarray(rows, dtype=np.int32))
    return base64.b64encode(array.tobytes()).decode("ascii")
