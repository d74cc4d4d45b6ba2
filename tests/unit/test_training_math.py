"""Pure pieces of the training path, against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from slime.algorithms.aggregation import FlatTokens, loss_weights, weighted_token_sum
from slime.algorithms.losses import sft_loss
from slime.backends.megatron.batching import consecutive_groups, make_micro_batches
from slime.backends.megatron.conversion import get_converter
from slime.backends.megatron.conversion.base import ModelShape
from slime.backends.megatron.policy_inputs import step_shard

MASKS = [[1, 1, 0], [1], [0, 0], [1, 1, 1, 1]]  # 2, 1, 0 and 4 unmasked tokens


def test_token_mean_weights_every_unmasked_token_equally():
    assert loss_weights(MASKS, "token_mean") == [1 / 7] * 4


def test_seq_mean_token_mean_averages_within_then_across_samples():
    assert loss_weights(MASKS, "seq_mean_token_mean") == [1 / 8, 1 / 4, 0.0, 1 / 16]


def test_seq_mean_token_sum_ignores_lengths():
    assert loss_weights(MASKS, "seq_mean_token_sum") == [1 / 4, 1 / 4, 0.0, 1 / 4]


def test_unknown_aggregation_mode_names_the_choices():
    with pytest.raises(ValueError, match="token_mean"):
        loss_weights(MASKS, "mean")


def test_weighted_token_sum_and_sft_loss_by_hand():
    values = [torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-4.0])]
    masks = [torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0])]
    # token mean over the 3 unmasked tokens: (1 + 2 + 4) / 3
    assert weighted_token_sum(values, masks, [1 / 3, 1 / 3]).item() == pytest.approx(-7 / 3)
    tokens = FlatTokens.of(masks, [1 / 3, 1 / 3])
    assert tokens.sample.tolist() == [0, 0, 0, 1] and tokens.weight.tolist() == pytest.approx([1 / 3] * 4)
    assert tokens.aggregate(torch.cat(values)).item() == pytest.approx(-7 / 3)
    assert sft_loss(torch.cat(values), tokens).item() == pytest.approx(7 / 3)
    assert tokens.sums(torch.cat(values)).tolist() == [-6.0, -4.0]


def rollout(n):
    return {
        "tokens": [[i] * (i + 2) for i in range(n)],
        "response_lengths": [1 + i % 2 for i in range(n)],
        "loss_masks": [[1] * (1 + i % 2) for i in range(n)],
    }


def test_step_shards_cover_each_step_once_and_share_its_weights():
    data = rollout(8)  # 2 steps × 2 DP ranks × 2 samples
    seen = []
    for step in range(2):
        total_weight = 0.0
        for rank in range(2):
            shard = step_shard(data, step, 2, rank, 2)
            seen.extend(t[0] for t in shard["tokens"])
            total_weight += sum(
                w * len(m) for w, m in zip(shard["loss_weights"], shard["loss_masks"], strict=True)
            )
        assert total_weight == pytest.approx(1.0)  # token mean: weights sum to one over a step
    assert seen == list(range(8))


def test_step_shard_rejects_uneven_splits():
    with pytest.raises(ValueError, match="do not split"):
        step_shard(rollout(6), 0, 2, 0, 2)


def test_micro_batches_pad_right_and_slice_responses():
    data = {**rollout(3), "loss_weights": [1.0, 1.0, 1.0]}
    batches = make_micro_batches(data, consecutive_groups(3, 2), torch.device("cpu"), packed=False)
    assert [b.tokens.shape for b in batches] == [torch.Size([2, 3]), torch.Size([1, 4])]
    assert batches[0].tokens.tolist() == [[0, 0, 0], [1, 1, 1]]  # sample 0 padded with id 0
    per_position = torch.arange(2 * 3).reshape(2, 3).float()  # values at positions 0..2 of each row
    # sample 0: length 2, 1 response token -> position 0; sample 1: length 3, 2 tokens -> positions 0..1
    assert [s.tolist() for s in batches[0].response_slices(per_position)] == [[0.0], [3.0, 4.0]]


def shape(**kw):
    base = dict(
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=3,
        hidden_size=5,
        vocab_size=7,
        padded_vocab_size=8,
        tie_word_embeddings=True,
    )
    return ModelShape(**{**base, **kw})


def test_qkv_fusion_groups_query_heads_with_their_kv_head():
    conv = get_converter("qwen2", shape=shape())
    q = torch.arange(12.0).reshape(12, 1)  # 4 heads × 3 dims
    k = 100 + torch.arange(6.0).reshape(6, 1)  # 2 groups × 3
    v = 200 + torch.arange(6.0).reshape(6, 1)
    hf = {f"model.layers.0.self_attn.{p}_proj.weight": t for p, t in zip("qkv", (q, k, v), strict=True)}
    fused = conv.megatron_from_hf("decoder.layers.0.self_attention.linear_qkv.weight", hf.__getitem__)
    expected_group0 = [*range(6), 100, 101, 102, 200, 201, 202]
    assert fused[:12, 0].tolist() == expected_group0
    back = dict(conv.hf_from_megatron("decoder.layers.0.self_attention.linear_qkv.weight", fused))
    assert all(torch.equal(back[name], hf[name]) for name in hf)


def test_vocab_padding_round_trips_and_tied_output_is_not_exported_twice():
    conv = get_converter("llama", shape=shape())
    embed = torch.randn(7, 5)
    padded = conv.megatron_from_hf(
        "embedding.word_embeddings.weight", {"model.embed_tokens.weight": embed}.get
    )
    assert padded.shape == (8, 5) and torch.equal(padded[7], torch.zeros(5))
    assert torch.equal(
        dict(conv.hf_from_megatron("embedding.word_embeddings.weight", padded))["model.embed_tokens.weight"],
        embed,
    )
    assert conv.hf_from_megatron("output_layer.weight", padded) == []


def test_unknown_architecture_lists_supported_ones():
    with pytest.raises(ValueError, match="llama, qwen2, qwen2_5_vl, qwen2_moe, qwen3, qwen3_moe"):
        get_converter("gpt2", shape=shape())


def test_weight_buckets_respect_the_byte_budget_and_keep_order():
    from slime.weight_sync.bucketing import iter_buckets

    tensors = [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([10, 10, 30, 5, 1])]
    buckets = list(iter_buckets(tensors, max_bytes=80))  # 20 floats per bucket; t2 (30) travels alone
    assert [[name for name, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3", "t4"]]


def test_the_trainer_takes_log_probs_at_the_rollout_temperature_and_greedy_at_one() -> None:
    from slime.config.settings.trainer import training_temperature

    assert training_temperature(0.7) == 0.7
    assert training_temperature(1.0) == 1.0
    assert training_temperature(0.0) == 1.0  # SGLang samples greedy as top-k 1 at T = 1


def test_the_reference_snapshot_holds_persistent_buffers_such_as_the_expert_bias():
    """A reference policy kept as parameters only would route with the current policy's MoE
    ``expert_bias`` (a persistent buffer the load balancing updates every step)."""
    from slime.backends.megatron.trainer import model_state_tensors

    class Router(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(4, 2))
            self.register_buffer("expert_bias", torch.zeros(4))
            self.register_buffer("local_tokens_per_expert", torch.zeros(4), persistent=False)

    chunk = torch.nn.Sequential(Router(), torch.nn.Linear(2, 2))
    tensors = model_state_tensors([chunk])
    router = chunk[0]
    assert any(t is router.expert_bias for t in tensors)
    assert not any(t is router.local_tokens_per_expert for t in tensors)  # a counter, not state
    assert sum(t.numel() for t in tensors) == 8 + 4 + 6


def test_log_probs_in_pieces_equal_the_whole_in_value_and_gradient():
    """``token_logprobs_and_entropy`` computes (and under autograd checkpoints, when a piece is large)
    ``chunk_tokens`` positions at a time, so its fp32 temporaries are per piece; the values and
    gradients must be those of one piece over every position, checkpointed or not (vocab padded:
    13 real ids of 16 rows)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from slime.backends.megatron.logprobs import token_logprobs_and_entropy
    from slime.utils.http import free_port

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    mpu.initialize_model_parallel()  # one rank: the tensor-parallel reductions are real and trivial
    try:
        generator = torch.Generator().manual_seed(0)
        logits = torch.randn(2, 11, 16, generator=generator)
        targets = torch.randint(0, 13, (2, 11), generator=generator)
        results = []
        # Pieces of 3 checkpointed, of 3 kept, and one piece kept (the default for these few logits).
        for chunk, min_elements in ((3, 0), (3, 10**9), (1024, None)):
            leaf = logits.clone().requires_grad_(True)
            sizes = {"chunk_tokens": chunk}
            if min_elements is not None:
                sizes["checkpoint_min_elements"] = min_elements
            logprobs, entropy = token_logprobs_and_entropy(leaf, targets, 13, 0.7, **sizes)
            (logprobs.sum() + 0.3 * entropy.sum()).backward()
            results.append((logprobs.detach(), entropy.detach(), leaf.grad))
        for checkpointed, kept, whole in zip(*results, strict=True):
            assert torch.allclose(checkpointed, whole, atol=1e-6) and torch.equal(checkpointed, kept)
        reference = torch.log_softmax(logits[..., :13] / 0.7, dim=-1).gather(-1, targets.unsqueeze(-1))
        assert torch.allclose(results[0][0], reference.squeeze(-1), atol=1e-6)
        with torch.no_grad():
            no_grad, none = token_logprobs_and_entropy(
                logits, targets, 13, 0.7, with_entropy=False, chunk_tokens=4
            )
        assert none is None and torch.allclose(no_grad, results[2][0], atol=1e-6)
    finally:
        mpu.destroy_model_parallel()
        dist.destroy_process_group()
