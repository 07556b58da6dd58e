"""Workloads are deterministic in (seed, index) and have the shapes they promise."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.bench.loadgen.workloads import (
    FIRST_TOKEN_ID,
    LONG_TAG,
    ChatMix,
    ChatWorkload,
    FixedWorkload,
    MixedWorkload,
    Vocab,
    take,
)

VOCAB = 2048


def all_workloads(seed: int):
    vocab = Vocab(VOCAB, seed)
    return [
        FixedWorkload(vocab, 32, 8),
        ChatWorkload(vocab, ChatMix(), max_model_len=1024),
        MixedWorkload(ChatWorkload(vocab, ChatMix(), 1024), 0.2, 600, 8),
    ]


@pytest.mark.parametrize("index", range(2))
def test_same_seed_same_requests_other_seed_other_prompts(index):
    first, again, other = all_workloads(1)[index], all_workloads(1)[index], all_workloads(2)[index]
    assert take(first, 12) == take(again, 12)
    # A request depends on its index only: the head of a longer run is the shorter run.
    assert take(first, 30)[:12] == take(first, 12)
    assert [s.prompt_ids for s in take(first, 12)] != [s.prompt_ids for s in take(other, 12)]


@pytest.mark.parametrize("index", range(2))
def test_token_ids_stay_inside_the_vocabulary(index):
    for spec in take(all_workloads(5)[index], 50):
        assert min(spec.prompt_ids) >= FIRST_TOKEN_ID and max(spec.prompt_ids) < VOCAB
        assert spec.max_tokens >= 1 and spec.ignore_eos


def test_fixed_lengths_and_tags_seed_separately():
    vocab = Vocab(VOCAB, 0)
    specs = take(FixedWorkload(vocab, 32, 8), 5)
    assert {(s.prompt_len, s.max_tokens, s.tag) for s in specs} == {(32, 8, "short")}
    assert len({s.req_id for s in specs}) == 5
    long = FixedWorkload(vocab, 32, 8, tag="long").request(0)
    assert long.tag == "long" and long.prompt_ids != specs[0].prompt_ids


def test_chat_mix_has_the_asked_means_and_a_heavy_tail():
    workload = ChatWorkload(Vocab(VOCAB, 0), ChatMix(), max_model_len=100_000)
    specs = take(workload, 3000)
    input_lens = np.array([s.prompt_len for s in specs])
    output_lens = np.array([s.max_tokens for s in specs])
    assert abs(input_lens.mean() / 215 - 1) < 0.15
    assert abs(output_lens.mean() / 198 - 1) < 0.15
    assert np.median(input_lens) < 0.7 * input_lens.mean()  # right-skewed
    assert input_lens.min() >= 4 and output_lens.min() >= 4


def test_chat_lengths_fit_the_model():
    workload = ChatWorkload(Vocab(VOCAB, 0), ChatMix(), max_model_len=256)
    for spec in take(workload, 500):
        assert spec.prompt_len + spec.max_tokens <= 256
        assert spec.prompt_len >= 4 and spec.max_tokens >= 4


def test_prompt_text_is_one_word_per_id():
    first, second = take(FixedWorkload(Vocab(VOCAB, 0), 10, 4), 2)
    words = first.prompt_text.split(" ")
    assert len(words) == first.prompt_len
    assert first.prompt_text != second.prompt_text


def test_bad_parameters_raise():
    with pytest.raises(ValueError):
        Vocab(5)
    with pytest.raises(ValueError):
        FixedWorkload(Vocab(VOCAB), 0, 8)
    with pytest.raises(ValueError):
        ChatMix(mean_input_len=2)


def test_mixed_is_chat_plus_the_asked_share_of_long_documents():
    chat = ChatWorkload(Vocab(VOCAB), ChatMix(), max_model_len=1024)
    mixed = MixedWorkload(chat, long_fraction=0.1, long_input_len=900, long_output_len=8)
    specs = take(mixed, 2000)
    documents = [s for s in specs if s.tag == LONG_TAG]
    assert 0.08 < len(documents) / len(specs) < 0.12
    # Documents: 900 ± 25%, clipped so prompt + output fit 1024; fixed output.
    assert all(675 <= d.prompt_len <= 1016 and d.max_tokens == 8 for d in documents)
    assert max(d.prompt_len for d in documents) == 1016
    # The rest are exactly the chat workload's requests at the same index.
    chats = [(i, s) for i, s in enumerate(specs) if s.tag != LONG_TAG]
    assert all(s == chat.request(i) for i, s in chats)
    assert take(MixedWorkload(chat, 0.0, 800, 8), 50) == take(chat, 50)
    with pytest.raises(ValueError):
        MixedWorkload(chat, long_fraction=1.5, long_input_len=800, long_output_len=8)
