"""Every HTTP call slime's driver, rollout manager, rollouts and trainers make to the engines.

One home, so that an engine call has one error type (``calls.EngineCallError``), one timeout policy
(``timeouts``) and one place that knows SGLang's routes: ``protocol`` (which API an engine speaks),
``generate`` (the rollouts' async transport), ``control`` (pause, continue, abort, load, context
length), ``memory`` (release and resume), ``weight_updates`` (the calls of a weight push and its
sessions) and ``health`` (the fault-tolerance probe). The engines' own servers (``slime.backends``)
and the router's worker API (``slime.rollout.router``) are not clients of an engine and live there.
"""
