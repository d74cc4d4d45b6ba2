"""TP=2, PP=2, TP=2 x PP=2 and PP=2 x DP=2 on CPU with gloo equal a single rank on the same data.

Compared: HF weights as loaded (bit-exact), response log-probs, loss and grad norm of two SFT steps,
and the HF weights after them (gathered from TP shards and every PP stage).
"""

from __future__ import annotations

import pytest

from tests.support.trainers import (
    TP2,
    assert_layout_matches,
    run_layout,
)

pytestmark = pytest.mark.e2e

PP2 = ["--pipeline-model-parallel-size", "2"]
# (world size, flags); the data-parallel size is what is left of the world.
LAYOUTS = {"tp2": (2, TP2), "pp2": (2, PP2), "tp2pp2": (4, TP2 + PP2), "pp2dp2": (4, PP2)}


@pytest.fixture(scope="module")
def single_rank(ray_cluster, tiny_models):
    return run_layout(tiny_models["qwen2"], 1, [])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_equals_single_rank(single_rank, tiny_models, layout):
    assert_layout_matches(run_layout(tiny_models["qwen2"], *LAYOUTS[layout]), single_rank)
