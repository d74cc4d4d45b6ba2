"""Plugins in upstream slime's and the usage guide's forms; the ``upstream_*`` ones log each call."""

import json
import os


def log_call(args, entry: dict) -> None:
    """Appends ``entry`` to ``compat.jsonl`` in the run's ``--tb-dir`` (when it has one): the plugins
    run in the rollout manager's Ray worker, which shares no environment with the test."""
    if args.tb_dir:
        with open(os.path.join(args.tb_dir, "compat.jsonl"), "a") as f:
            f.write(json.dumps(entry) + "\n")
