"""Upstream slime's import path of ``Sample``: plugins written for THUDM/slime import it from here.

There is one ``Sample`` (``slime.rollout.sample``); this module only names it where upstream does.
"""

from slime.rollout.sample import Sample

__all__ = ["Sample"]
