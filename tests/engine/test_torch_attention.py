"""The torch backend against attention written out per sequence (float64, K/V repeated
per query head): ragged decodes in several length groups, prefill chunks over cached
prefixes, GQA/MQA/MHA; how decodes are grouped; and a layout that does not put its
one-token decodes first is refused."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.attention.metadata import BatchLayout
from tandem.engine.attention.torch_backend import (
    GROUP_SLACK_TOKENS,
    TorchAttentionBackend,
    group_decodes,
)
from tests.helpers.paged_batch import make_paged_batch, reference_attention

# (query lens, seq lens, q heads, kv heads, head dim, block size): decodes first.
CASES = {
    "decodes-one-group-gqa3": ([1, 1, 1], [150, 131, 140], 12, 4, 64, 16),
    "decodes-three-groups-gqa2": ([1, 1, 1, 1, 1], [700, 650, 300, 17, 1], 4, 2, 32, 16),
    "decodes-unsorted-mqa": ([1, 1, 1, 1], [9, 400, 64, 390], 8, 1, 32, 8),
    "decodes-mha-bs32": ([1, 1], [31, 100], 2, 2, 64, 32),
    "mixed-prefix-hits": ([1, 1, 37, 5, 16], [45, 3, 100, 21, 16], 4, 2, 64, 16),
    "prefill-fresh": ([20, 7], [20, 7], 6, 2, 32, 4),
}


@pytest.mark.parametrize("case_id", CASES)
def test_backend_matches_attention_written_out(case_id: str) -> None:
    case = make_paged_batch(*CASES[case_id])
    backend = TorchAttentionBackend(case.query.shape[-1] ** -0.5)
    cache = case.kv_cache.clone()
    meta = backend.build_metadata(case.batch)
    out = backend.forward(case.query, case.key, case.value, cache, meta)
    slots = case.batch.slot_mapping
    heads, dim = case.key.shape[1:]
    assert torch.equal(cache[0].view(-1, heads, dim)[slots], case.key)
    assert torch.equal(cache[1].view(-1, heads, dim)[slots], case.value)
    torch.testing.assert_close(out, reference_attention(case, cache).float(), rtol=1e-5, atol=1e-5)


def test_three_decode_groups_are_built_once_per_step() -> None:
    case = make_paged_batch(*CASES["decodes-three-groups-gqa2"])
    meta = TorchAttentionBackend(1.0).build_metadata(case.batch)
    assert [(g.start, g.end, g.max_len) for g in meta.decode_groups] == [
        (0, 2, 700), (2, 3, 300), (3, 5, 17),
    ]  # fmt: skip
    assert meta.decode_groups[0].mask is not None


def test_decode_groups_bound_the_padding() -> None:
    assert group_decodes([]) == []
    assert group_decodes([150, 149, 131]) == [(0, 3)]
    # Within the slack in tokens, even far apart in ratio.
    assert group_decodes([GROUP_SLACK_TOKENS + 1, 1]) == [(0, 2)]
    # Beyond both the slack and a quarter of the longest: a new group.
    assert group_decodes([1000, 760, 740, 100]) == [(0, 2), (2, 3), (3, 4)]
    for lens in ([1000, 900, 800, 700, 600, 10], [5, 500, 50, 5000]):
        for start, end in group_decodes(lens):
            low, high = min(lens[start:end]), max(lens[start:end])
            assert high - low <= GROUP_SLACK_TOKENS or 4 * (high - low) <= high


@pytest.mark.parametrize(
    ("starts", "num_decodes", "message"),
    [
        ([0, 3, 4], 1, "sequence 0 \\(of the first 1\\) has 3"),
        ([0, 1, 4], 3, "0..2 decodes, got 3 and 3"),
        ([0, 1], 0, "2 sequences need 3 query starts"),
    ],
)
def test_a_layout_whose_decodes_are_not_first_is_refused(starts, num_decodes, message) -> None:
    with pytest.raises(ValueError, match=message):
        BatchLayout(
            query_start_loc=starts, seq_lens=[3, 9], block_tables=[[0], [1]],
            slots=[0, 0, 0, 0], num_decodes=num_decodes,
            block_size=16, device=torch.device("cpu"),
        )  # fmt: skip
