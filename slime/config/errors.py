"""The one exception type of the config package.

Every validation failure names the flag the user has to change and the change to make, so that
``parse_args`` can turn it into a single ``error: <flag>: <what is wrong>; <what to do>`` line
before any process, placement group or engine exists.
"""

from __future__ import annotations


class ConfigError(Exception):
    """A command line that cannot run, with the flag to fix and how to fix it.

    ``message`` reads ``<what is wrong>; <what to do>`` so that the whole error fits on one line.
    """

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag}: {message}")
        self.flag = flag
        self.message = message

    def line(self) -> str:
        """The one line ``parse_args`` prints to stderr."""
        return f"error: {self.flag}: {self.message}"
