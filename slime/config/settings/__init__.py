"""A run's settings, typed and frozen, one part per component, built once after validation.

``parse_args`` settles and checks the flags; ``RunSettings.from_args`` (``run.py``) then reads them once. From
there on each component receives its own part (the rollout manager ``data``, ``rollout`` and
``eval``; a trainer rank ``trainer``; the updaters ``weight_sync``) and nothing reads the namespace:
what a component depends on is written in its settings class, and a test or a bench builds one by
hand. User plugins are the exception: upstream slime hands them the namespace, so they receive
``plugin_args``, the same values.
"""
