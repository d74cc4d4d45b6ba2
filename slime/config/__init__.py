"""Command-line configuration: one parser, three flag families, validation before anything starts.

``parse_args()`` is what entry points call. It never imports torch, Megatron or Ray: it runs
before anything starts and must be fast.
"""

from slime.config.errors import ConfigError
from slime.config.parser import build_parser, configure, parse_args
from slime.config.sglang_args import collect_sglang_args
from slime.config.slime_args import PLUGIN_FLAGS
from slime.config.validate import split_data_path

__all__ = [
    "PLUGIN_FLAGS",
    "ConfigError",
    "build_parser",
    "collect_sglang_args",
    "configure",
    "parse_args",
    "split_data_path",
]
