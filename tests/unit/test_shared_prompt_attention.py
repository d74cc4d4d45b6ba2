"""A shared-prompt micro-batch's attention, run unit by unit (each prompt, each response with its
prompt), equals the attention over each whole ``[prompt, response 1, ...]`` segment with its mask."""

from __future__ import annotations

import pytest
import torch

from slime.backends.megatron.batching import make_micro_batches
from slime.backends.megatron.packed_attention import pad_sequences, rows_of, shared_prompt_attention
from tests.support.packing import shared_prompt_data


def layout_rows():
    (batch,) = make_micro_batches(
        shared_prompt_data(), [list(range(6))], torch.device("cpu"), pad_to_multiple=4, share_prompts=True
    )
    return rows_of(batch.cu_seqlens, batch.position_ids[0], batch.response_blocks)


def test_units_are_each_prompt_and_each_response_with_its_prompt():
    """Row [5 6 7 | 10 11 | 13 14 15 | 16 | 8 9 | 12 | 17 18 | 4 | 19 20 | pad pad pad]: 11 units."""
    units = layout_rows().units
    total = 20
    keys = [[i for i in row if i != total] for row in units.key_index.tolist()]
    assert keys == [
        [0, 1, 2],  # prompt [5, 6, 7]
        [0, 1, 2, 3, 4],  # its responses: the prompt, then their own tokens
        [0, 1, 2, 5, 6, 7],
        [0, 1, 2, 8],
        [9, 10],  # prompt [8, 9]
        [9, 10, 11],
        [9, 10, 12, 13],
        [14],  # the lone sample's prompt and response
        [14, 15, 16],
        [17, 18, 19],  # the padding segment: one unit, causal
    ]
    queries = [[i for i in row if i != total] for row in units.query_index.tolist()]
    assert queries == [
        [0, 1, 2],
        [3, 4],
        [5, 6, 7],
        [8],
        [9, 10],
        [11],
        [12, 13],
        [14],
        [15, 16],
        [17, 18, 19],
    ]
    assert units.output_index.tolist()[:9] == [0, 1, 2, 3, 4, 6, 7, 8, 9]  # unit * 3 + offset
    response = units.visible[2, 0]  # [13, 14, 15]: its whole prompt, itself causally
    assert response.tolist() == [
        [True, True, True, True, False, False],
        [True, True, True, True, True, False],
        [True, True, True, True, True, True],
    ]
    short = units.visible[3, 0]  # [16]: its padded query rows see what its one query sees
    assert short.tolist() == [[True, True, True, True, False, False]] * 3
    prompt = units.visible[0, 0]  # a prompt: causal over itself
    assert prompt[:, :3].tolist() == torch.ones(3, 3).tril().bool().tolist() and not prompt[:, 3:].any()


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_unit_attention_equals_the_segment_layout_with_its_mask_values_and_gradients(kv_heads):
    rows = layout_rows()
    total, heads, dim = 20, 4, 8
    gen = torch.Generator().manual_seed(0)
    q0 = torch.randn(total, heads, dim, generator=gen, dtype=torch.float64)
    k0 = torch.randn(total, kv_heads, dim, generator=gen, dtype=torch.float64)
    v0 = torch.randn(total, kv_heads, dim, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(total, heads, dim, generator=gen, dtype=torch.float64)

    def segment_layout(q, k, v):
        padded = [pad_sequences(t, rows).permute(1, 2, 0, 3) for t in (q, k, v)]  # [b, heads, s, dim]
        out = torch.nn.functional.scaled_dot_product_attention(
            *padded, attn_mask=~rows.hidden, scale=0.3, enable_gqa=kv_heads != heads
        )
        return out.permute(2, 0, 1, 3).flatten(0, 1)[rows.index]  # [T, heads, dim]

    results = []
    for attend in (segment_layout, lambda q, k, v: shared_prompt_attention(q, k, v, rows.units, 0.3)):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        out = attend(q, k, v)
        out.backward(grad_out)
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for expected, got in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert results[1][2].abs().sum() > 0  # the keys got gradients through both prompts and responses
