"""The usage guide's custom reward model, as a user copies it: a class built from ``model_path``
(here a directory holding its "weights", a JSON file) whose ``compute_reward(prompts, responses)``
scores a batch. Each construction and call is appended to ``calls.jsonl`` in ``model_path``, so
that a test sees how often it was built and how it was called."""

from __future__ import annotations

import json
import os


class CustomRewardModel:
    def __init__(self, model_path):
        self.model_path = model_path
        with open(os.path.join(model_path, "weights.json")) as f:
            self.weight = json.load(f)["weight"]
        self._log({"event": "init"})

    def _log(self, record):
        with open(os.path.join(self.model_path, "calls.jsonl"), "a") as f:
            f.write(json.dumps({**record, "pid": os.getpid()}) + "\n")

    def compute_reward(self, prompts, responses):
        self._log({"event": "compute_reward", "prompts": len(prompts), "responses": len(responses)})
        return [self.weight * min(len(response), 4) / 4 for response in responses]
