"""How long each engine call may take: the one timeout policy of ``slime.engine_client``.

A caller that knows better passes its own (``--update-weight-timeout`` for the calls of a weight push
and the memory calls around it, ``--rollout-health-check-timeout`` for the health probe); these are
the defaults, and the bounds of the calls that take none.

- ``CALL_TIMEOUT_S`` (300 s): a POST that may move weights or memory (``calls.post``'s default): an
  engine loads a checkpoint or takes its KV cache back before it answers.
- ``CONTROL_TIMEOUT_S`` (60 s): the rollout manager's ``/pause_generation`` and
  ``/continue_generation``; a pause in ``abort`` mode ends the requests it holds first.
- ``READ_TIMEOUT_S`` (30 s): a read that computes nothing (the protocol probe, ``/get_server_info``,
  the load, ``/v1/models``); an engine that takes longer is hung.
- ``ABORT_POST_TIMEOUT_S`` (5 s): one abort post; a lost one is repeated by the next round or by
  ``abort_all``, so waiting longer only delays the weight update.
- ``END_SESSION_TIMEOUT_S`` (120 s): closing a weight-update session only runs the post-load step,
  so it must not wait as long as a transfer may.
- ``ERROR_PATH_TIMEOUT_S`` (10 s): a clean-up after a failure (closing sessions, destroying the
  update group, resuming generation): an engine may be stuck in a broadcast that never ends, and the
  failure's own error is the one to report, soon.
- ``GENERATE_CONNECT_TIMEOUT_S`` (30 s): opening a connection for ``/generate``; the request itself
  has no total timeout, as a long generation is no error.
"""

CALL_TIMEOUT_S = 300.0
CONTROL_TIMEOUT_S = 60.0
READ_TIMEOUT_S = 30.0
ABORT_POST_TIMEOUT_S = 5.0
END_SESSION_TIMEOUT_S = 120.0
ERROR_PATH_TIMEOUT_S = 10.0
GENERATE_CONNECT_TIMEOUT_S = 30.0
