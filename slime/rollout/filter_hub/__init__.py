"""Upstream slime's dynamic-sampling filters (``slime.rollout.filter_hub``), over ``filters``."""
