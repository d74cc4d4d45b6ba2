"""Packed (THD) micro-batches and dynamic, token-budgeted micro-batches.

Pure parts: the bin partition and the packed layout. On Ray: packed equals padded (log-probs, loss,
grad norm) on one rank, and with ``--use-dynamic-batch-size`` two data-parallel ranks whose samples
need different numbers of micro-batches run the same number and give the fixed-micro-batch loss.
"""

from __future__ import annotations

import random

import pytest
import torch

from slime.backends.megatron.batching import (
    consecutive_groups,
    even_groups,
    interleaved_count,
    make_micro_batches,
    min_bin_count,
    pad_to_shape,
    partition_by_token_budget,
)
from slime.config import ConfigError
from slime.ray.trainer_group import check_token_budget
from tests.support.packing import shared_prompt_data
from tests.support.trainers import make_group, sft_data, trainer_args

# ---- the bin partition ---------------------------------------------------------------------------


def assert_valid_partition(bins, lengths, budget, num_bins):
    assert len(bins) == num_bins
    assert all(bins) and all(b == sorted(b) for b in bins)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= budget for b in bins)


def test_partition_gives_exactly_the_requested_bins_under_the_budget():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 50) for _ in range(rng.randint(1, 16))]
        budget = rng.randint(max(lengths), 120)
        needed = min_bin_count(lengths, budget)
        assert needed >= -(-sum(lengths) // budget)
        for num_bins in range(needed, len(lengths) + 1):
            bins = partition_by_token_budget(lengths, budget, num_bins)
            assert_valid_partition(bins, lengths, budget, num_bins)


def test_partition_balances_tokens_and_falls_back_when_balancing_overflows():
    # longest-first into the least-loaded bin: loads 12 and 12
    assert partition_by_token_budget([8, 4, 6, 6], 12, 2) == [[0, 1], [2, 3]]
    # balancing would give 5+4 and 5+3+3 = 11 > 10; first-fit decreasing fits 5+5 and 4+3+3
    assert partition_by_token_budget([5, 5, 4, 3, 3], 10, 2) == [[0, 1], [2, 3, 4]]
    # more bins than first-fit needs: its bins are split, largest first
    assert_valid_partition(partition_by_token_budget([5, 5, 4, 3, 3], 10, 4), [5, 5, 4, 3, 3], 10, 4)


def test_min_bin_count_and_partition_refusals():
    assert min_bin_count([5, 5, 4, 3, 3], 10) == 2
    assert min_bin_count([5, 5, 4, 3, 3], 5) == 5
    with pytest.raises(ValueError, match="exceeds"):
        min_bin_count([11, 2], 10)
    with pytest.raises(ValueError, match="non-empty"):
        partition_by_token_budget([1, 2], 10, 3)
    with pytest.raises(ValueError, match="need 5 micro-batches"):
        partition_by_token_budget([5, 5, 4, 3, 3], 5, 4)


def test_token_budget_below_the_longest_sample_is_one_config_error():
    check_token_budget([[1] * 7, [1] * 3], 7)
    check_token_budget([[1] * 70], None)
    with pytest.raises(ConfigError) as error:
        check_token_budget([[1] * 7, [1] * 9], 8)
    assert error.value.line() == (
        "error: --max-tokens-per-gpu: 8 is below the longest sample (9 tokens); raise it to at least 9"
    )


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (["--use-dynamic-batch-size"], "--use-dynamic-batch-size"),
        (["--max-tokens-per-gpu", "64"], "--max-tokens-per-gpu"),
        (["--use-dynamic-batch-size", "--max-tokens-per-gpu", "0"], "--max-tokens-per-gpu"),
    ],
)
def test_dynamic_batch_flags_come_together(tiny_models, capsys, extra, flag):
    with pytest.raises(SystemExit) as exc:
        trainer_args(tiny_models["qwen2"], extra=extra)
    assert exc.value.code == 2
    assert capsys.readouterr().err.startswith(f"error: {flag}: ")


# ---- the packed layout ---------------------------------------------------------------------------


def layout_data():
    data = sft_data(5)
    data["loss_weights"] = [1.0] * 5
    return data


def test_packed_row_has_no_padding_between_sequences_and_restarts_positions():
    data = layout_data()
    lengths = [len(t) for t in data["tokens"]]
    (batch,) = make_micro_batches(data, [[1, 2, 4]], torch.device("cpu"), packed=True, pad_to_multiple=8)
    real = lengths[1] + lengths[2] + lengths[4]
    pad = -real % 8
    assert batch.tokens.shape == (1, real + pad)
    assert batch.tokens[0, :real].tolist() == data["tokens"][1] + data["tokens"][2] + data["tokens"][4]
    bounds = [0, lengths[1], lengths[1] + lengths[2], real] + ([real + pad] if pad else [])
    assert batch.cu_seqlens.tolist() == bounds
    assert batch.max_seqlen == max(lengths[1], lengths[2], lengths[4], pad)
    expected_positions = [p for n in (lengths[1], lengths[2], lengths[4], pad) for p in range(n)]
    assert batch.position_ids[0].tolist() == expected_positions
    assert batch.indices == [1, 2, 4] and batch.samples["tokens"][2] == data["tokens"][4]


class _OneRankGroup:
    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


@pytest.mark.parametrize("interleaved", [False, True])
def test_batched_thd_rope_equals_megatron_s_per_sequence_one(interleaved):
    """``use_batched_thd_rope``: one gather of every token's position gives exactly the frequencies
    megatron-core's baseline slices sequence by sequence (positions restart in each sequence), for
    a packed row with a trailing pad segment, forward and backward."""
    from megatron.core.models.common.embeddings import rope_utils

    from slime.backends.megatron.packed_attention import use_batched_thd_rope

    use_batched_thd_rope()
    batched = rope_utils._apply_rotary_pos_emb_thd
    reference = batched.baseline
    gen = torch.Generator().manual_seed(0)
    cu_seqlens = torch.tensor([0, 5, 6, 13, 16], dtype=torch.int32)  # the last: padding
    freqs = torch.rand(20, 1, 1, 8, generator=gen) * 3
    t = torch.randn(16, 2, 8, generator=gen)
    outputs = []
    for fn in (batched, reference):
        leaf = t.clone().requires_grad_()
        out = fn(leaf, cu_seqlens, freqs, rotary_interleaved=interleaved, cp_group=_OneRankGroup())
        out.square().sum().backward()
        outputs.append((out.detach(), leaf.grad))
    torch.testing.assert_close(outputs[0][0], outputs[1][0], rtol=0, atol=0)
    torch.testing.assert_close(outputs[0][1], outputs[1][1], rtol=0, atol=0)


def test_interleaved_schedule_gets_a_multiple_of_the_pipeline_size():
    assert [interleaved_count(c, 8, 2) for c in (1, 2, 3, 4)] == [2, 2, 4, 4]
    assert interleaved_count(3, 3, 2) == 2  # no sample for a fourth: round down
    assert interleaved_count(5, 7, 4) == 4
    with pytest.raises(ValueError, match="virtual pipeline"):
        interleaved_count(1, 1, 2)
    assert even_groups(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert even_groups(4, 4) == [[0], [1], [2], [3]]


@pytest.mark.parametrize("packed", [True, False])
def test_padding_to_one_shape_keeps_every_response(packed):
    """Virtual pipeline stages pad every micro-batch of a step to one shape; no sample reads the pad."""
    data = layout_data()
    batches = make_micro_batches(data, [[0, 1, 2], [3, 4]], torch.device("cpu"), packed=packed)
    rows = max(b.tokens.shape[0] for b in batches)
    length = max(b.tokens.shape[1] for b in batches) + 3
    for batch in (pad_to_shape(b, rows, length) for b in batches):
        assert tuple(batch.tokens.shape) == (rows, length) == tuple(batch.position_ids.shape)
        if packed:
            assert batch.cu_seqlens[-1] == length and batch.position_ids[0, -3:].tolist()[-1] >= 2
        for index, got in zip(batch.indices, batch.response_slices(next_tokens(batch)), strict=True):
            assert got.tolist() == data["tokens"][index][-data["response_lengths"][index] :]


def next_tokens(batch):
    """Each position's next token in its row (the last position's wraps around and is never read)."""
    return torch.roll(batch.tokens, -1, dims=1)


@pytest.mark.parametrize("packed", [True, False])
def test_response_slices_select_each_samples_response_tokens(packed):
    """Position p predicts token p + 1: the next tokens at each sample's predictors, and its targets,
    must be its response, in either layout."""
    data = layout_data()
    batches = make_micro_batches(data, consecutive_groups(5, 3), torch.device("cpu"), packed=packed)
    assert [b.packed for b in batches] == [packed, packed]
    assert [len(b.indices) for b in batches] == [3, 2]
    for batch in batches:
        assert batch.response_blocks is None
        slices = batch.response_slices(next_tokens(batch))
        targets = batch.split_responses(batch.targets)
        for index, got, target in zip(batch.indices, slices, targets, strict=True):
            response = data["response_lengths"][index]
            assert got.tolist() == target.tolist() == data["tokens"][index][-response:]


def test_shared_prompt_segments_hold_each_prompt_once_at_its_own_positions():
    """Hand-laid: each prompt once, its responses after it at the positions they have unpacked; every
    sample's first token is predicted by its prompt's last position, the rest by its own tokens."""
    data = shared_prompt_data()
    (batch,) = make_micro_batches(
        data, [list(range(6))], torch.device("cpu"), pad_to_multiple=4, share_prompts=True
    )
    assert batch.tokens[0].tolist() == [5, 6, 7, 10, 11, 13, 14, 15, 16, 8, 9, 12, 17, 18, 4, 19, 20, 0, 0, 0]
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 4, 3, 4, 5, 3, 0, 1, 2, 2, 3, 0, 1, 2, 0, 1, 2]
    assert batch.response_blocks.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 3, 0, 0, 1, 2, 2, 0, 1, 1, 0, 0, 0]
    assert batch.cu_seqlens.tolist() == [0, 9, 14, 17, 20] and batch.max_seqlen == 9
    predictors = [c.tolist() for c in batch.split_responses(batch.predictor_columns)]
    assert predictors == [[2, 3], [10], [2, 5, 6], [2], [10, 12], [14, 15]]
    assert batch.split_responses(batch.targets)[2].tolist() == [13, 14, 15]
    assert batch.indices == list(range(6)) and batch.total_lengths == [5, 3, 6, 4, 4, 3]


def test_shared_prompt_mask_lets_a_response_see_its_prompt_and_itself():
    from slime.backends.megatron.packed_attention import rows_of

    (batch,) = make_micro_batches(
        shared_prompt_data(), [list(range(6))], torch.device("cpu"), share_prompts=True
    )
    rows = rows_of(batch.cu_seqlens, batch.position_ids[0], batch.response_blocks)
    assert rows.shared and rows.hidden.shape == (3, 1, 9, 9)
    seen = ~rows.hidden[0, 0]  # segment 0: prompt 0..2, responses at 3..4, 5..7 and 8
    assert seen[7].nonzero().flatten().tolist() == [0, 1, 2, 5, 6, 7]
    assert seen[8].nonzero().flatten().tolist() == [0, 1, 2, 8]
    assert seen[2].nonzero().flatten().tolist() == [0, 1, 2]
    # the lone sample's segment (2 of 3) is plain causal over its 3 tokens
    assert (~rows.hidden[2, 0, :3, :3]).tolist() == torch.ones(3, 3).tril().bool().tolist()


# ---- on Ray: packed vs padded, dynamic batches over two data-parallel ranks -----------------------

# Ranks take contiguous halves: rank 0 gets four short samples (one micro-batch would do),
# rank 1 four long ones (one micro-batch each), so balancing must give rank 0 four micro-batches too.
LENGTHS = [6, 5, 7, 6, 19, 22, 20, 21]
BUDGET = 24


def varied_data():
    gen = torch.Generator().manual_seed(3)
    data = {"tokens": [], "response_lengths": [], "loss_masks": []}
    for i, length in enumerate(LENGTHS):
        response = 2 + i % 4
        data["tokens"].append(torch.randint(3, 99, (length,), generator=gen).tolist())
        data["response_lengths"].append(response)
        data["loss_masks"].append([1] * (response - 1) + [i % 2])
    return data


def grouped_data():
    """Three prompts with three, three and two samples each (of 2..5 response tokens), in order."""
    gen = torch.Generator().manual_seed(5)
    data = {"tokens": [], "response_lengths": [], "loss_masks": []}
    for i, size in enumerate([3, 3, 2]):
        prompt = torch.randint(3, 99, (6 + 3 * i,), generator=gen).tolist()
        for j in range(size):
            response = 2 + (i + j) % 4
            data["tokens"].append(prompt + torch.randint(3, 99, (response,), generator=gen).tolist())
            data["response_lengths"].append(response)
            data["loss_masks"].append([1] * (response - 1) + [j % 2])
    return data


def run_group(tiny_models, world=1, extra=(), make_data=varied_data):
    """Log-probs and one SFT step's metrics, plus every rank's micro-batch count of that step."""
    import ray
    from ray.util.placement_group import remove_placement_group

    group, _, pg = make_group(trainer_args(tiny_models["qwen2"], world=world, extra=list(extra)))
    try:
        log_probs = group.compute_log_probs(make_data())
        metrics = group.train(make_data())[0]
        counts = ray.get([actor.micro_batch_count.remote() for actor in group.actors])
        if world == 2:
            too_long = varied_data()
            too_long["tokens"][0] = too_long["tokens"][0] * 5
            with pytest.raises(ConfigError, match="--max-tokens-per-gpu"):
                group.train(too_long)
        return {"log_probs": log_probs, "metrics": metrics, "counts": counts}
    finally:
        group.shutdown()
        remove_placement_group(pg)


@pytest.fixture(scope="module")
def packed_run(ray_cluster, tiny_models):
    return run_group(tiny_models)


def assert_same_run(ours, ref, loss_rel):
    assert len(ours["log_probs"]) == len(ref["log_probs"])
    for a, b in zip(ours["log_probs"], ref["log_probs"], strict=True):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() <= 1e-6
    assert ours["metrics"]["loss"] == pytest.approx(ref["metrics"]["loss"], rel=loss_rel, abs=1e-6)
    assert ours["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-5)


@pytest.mark.e2e
def test_packed_equals_padded(packed_run, tiny_models):
    padded = run_group(tiny_models, extra=["--qkv-format", "bshd"])
    assert packed_run["counts"] == padded["counts"] == [4]  # --micro-batch-size 2
    assert_same_run(packed_run, padded, loss_rel=1e-6)


@pytest.mark.e2e
def test_dynamic_batches_balance_data_parallel_ranks(packed_run, tiny_models):
    halves = [LENGTHS[:4], LENGTHS[4:]]
    assert [min_bin_count(h, BUDGET) for h in halves] == [1, 4]
    dynamic = run_group(
        tiny_models, world=2, extra=["--use-dynamic-batch-size", "--max-tokens-per-gpu", str(BUDGET)]
    )
    assert dynamic["counts"] == [4, 4]
    assert_same_run(dynamic, packed_run, loss_rel=1e-6)


def long_response_data():
    """Two 2-token prompts with four samples each of 30..33 response tokens: segments of about 130
    tokens, where the fused attention runs unit by unit (``PackedRows.by_units``)."""
    gen = torch.Generator().manual_seed(7)
    data = {"tokens": [], "response_lengths": [], "loss_masks": []}
    for _ in range(2):
        prompt = torch.randint(3, 99, (2,), generator=gen).tolist()
        for j in range(4):
            response = 30 + j
            data["tokens"].append(prompt + torch.randint(3, 99, (response,), generator=gen).tolist())
            data["response_lengths"].append(response)
            data["loss_masks"].append([1] * (response - 1) + [j % 2])
    return data


@pytest.mark.e2e
@pytest.mark.parametrize(
    "make_data, micro_batch, by_units", [(grouped_data, 4, False), (long_response_data, 8, True)]
)
def test_shared_prompts_give_the_plain_packed_log_probs_loss_and_gradient(
    ray_cluster, tiny_models, make_data, micro_batch, by_units
):
    """Micro-batches of 4 over groups of 3, 3 and 2 samples: one segment holds a whole micro-batch
    (its RoPE must still take the layout's positions), the other mixes prompts; the shared run also
    recomputes its activations, so the backward pass asks for the layouts again. Long responses: the
    same through the attention's units."""
    from slime.backends.megatron.packed_attention import rows_of

    data = make_data()
    laid_out = {**data, "loss_weights": [1.0] * len(data["tokens"])}
    (batch,) = make_micro_batches(
        laid_out, [list(range(micro_batch))], torch.device("cpu"), share_prompts=True
    )
    assert rows_of(batch.cu_seqlens, batch.position_ids[0], batch.response_blocks).by_units is by_units
    flags = ["--micro-batch-size", str(micro_batch)]
    plain = run_group(tiny_models, extra=flags, make_data=make_data)
    shared = run_group(
        tiny_models,
        extra=[*flags, "--share-prompts-in-train", "--recompute-activations"],
        make_data=make_data,
    )
    assert plain["counts"] == shared["counts"] == [len(data["tokens"]) // micro_batch]
    assert_same_run(shared, plain, loss_rel=1e-6)
