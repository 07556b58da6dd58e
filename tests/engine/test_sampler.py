"""Sampler: greedy parity with argmax, filters, seeded reproducibility, distributions."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from tandem.engine.sampler import Sampler, rank_logprobs, token_draw_seed
from tandem.engine.sampling_params import SamplingParams

VOCAB_SIZE = 64


def random_logits(num_seqs: int, seed: int = 0, vocab_size: int = VOCAB_SIZE) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_seqs, vocab_size, generator=generator) * 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    logits = random_logits(32).to(dtype)
    params = [SamplingParams(temperature=0.0)] * 32
    out = Sampler().sample(logits, params, [None] * 32)
    assert out.token_ids == torch.argmax(logits, dim=-1).tolist()
    assert len(out.logprobs) == 32


def test_greedy_rows_in_mixed_batch_are_argmax() -> None:
    logits = random_logits(8)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0) for i in range(8)]
    out = Sampler().sample(logits, params, list(range(8)))
    argmax = torch.argmax(logits, dim=-1).tolist()
    assert [out.token_ids[i] for i in range(1, 8, 2)] == [argmax[i] for i in range(1, 8, 2)]


def test_top_k_one_is_greedy() -> None:
    logits = random_logits(50, seed=1)
    params = [SamplingParams(temperature=1.5, top_k=1)] * 50
    out = Sampler().sample(logits, params, list(range(50)))
    assert out.token_ids == torch.argmax(logits, dim=-1).tolist()


def test_tiny_top_p_is_greedy() -> None:
    logits = random_logits(50, seed=2)
    params = [SamplingParams(temperature=2.0, top_p=1e-6)] * 50
    out = Sampler().sample(logits, params, list(range(50)))
    assert out.token_ids == torch.argmax(logits, dim=-1).tolist()


def test_logprob_is_log_softmax_of_raw_logits() -> None:
    logits = random_logits(6, seed=3)
    params = [
        SamplingParams(temperature=0.0, logprobs=True),
        SamplingParams(temperature=0.5, logprobs=True),
        SamplingParams(temperature=2.0, top_k=3, logprobs=True),
        SamplingParams(temperature=1.0, top_p=0.5, logprobs=True),
        SamplingParams(temperature=0.0, logprobs=True),
        SamplingParams(temperature=3.0, logprobs=True),
    ]
    out = Sampler().sample(logits, params, list(range(6)))
    expected = torch.log_softmax(logits, dim=-1)
    for row, (token_id, logprob) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert logprob == pytest.approx(expected[row, token_id].item(), abs=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_banned_tokens_are_never_drawn_and_leave_the_logprobs_raw(dtype: torch.dtype) -> None:
    """Tokens a row may not draw yet (EOS and stop tokens below min_tokens) are skipped,
    but its logprobs stay the model's, the banned tokens ranked among them (vLLM)."""
    logits = random_logits(4, seed=9).to(dtype)
    top = torch.argmax(logits, dim=-1).tolist()
    params = [SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, logprobs=True),
              SamplingParams(temperature=0.0, logprobs=True)]  # fmt: skip
    banned = [[top[0]], [top[1]], [top[2]], []]
    out = Sampler().sample(logits, params, [0, 1, 2, 3], banned=banned)
    for row in range(3):
        assert out.token_ids[row] != top[row]
    second = logits[0].float().clone()
    second[top[0]] = float("-inf")
    assert out.token_ids[0] == int(torch.argmax(second))
    assert out.token_ids[3] == top[3]
    expected = torch.log_softmax(logits.float(), dim=-1)
    for row in (0, 2, 3):
        assert out.logprobs[row] == pytest.approx(
            expected[row, out.token_ids[row]].item(), abs=1e-5
        )
    ranked = out.top_logprobs[0]
    assert ranked is not None and ranked.token_ids[0] == top[0]
    assert ranked.logprobs[0] == pytest.approx(expected[0, top[0]].item(), abs=1e-5)


@pytest.mark.parametrize("greedy", [True, False])
def test_logprobs_only_for_rows_that_ask(greedy: bool) -> None:
    logits = random_logits(6, seed=4)
    params = [
        SamplingParams(temperature=0.0 if greedy else 1.0, logprobs=i % 3 == 0) for i in range(6)
    ]
    out = Sampler().sample(logits, params, list(range(6)))
    expected = torch.log_softmax(logits, dim=-1)
    for row, (token_id, logprob) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        if row % 3 == 0:
            assert logprob == pytest.approx(expected[row, token_id].item(), abs=1e-5)
        else:
            assert math.isnan(logprob)


@dataclass
class History:
    penalty_prompt_token_ids: list[int]
    generated_token_ids: list[int]


def test_top_logprobs_are_the_largest_raw_logprobs_in_order() -> None:
    """From the logits as the model gave them (before penalties and temperature), as the
    chosen token's logprob; rows that ask for none get None."""
    logits = random_logits(5, seed=6)
    logits[3, 10:20] = 9.0  # ties: reported in index order
    params = [
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5),
        SamplingParams(temperature=1.0, logprobs=True),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0, top_k=2, logprobs=True, top_logprobs=20),
        SamplingParams(temperature=0.7, logprobs=True, top_logprobs=1, presence_penalty=2.0),
    ]
    seen = History([], [int(logits[4].argmax())])
    out = Sampler().sample(logits, params, list(range(5)), [seen] * 5)
    expected = torch.log_softmax(logits, dim=-1)
    assert out.top_logprobs[1] is None and out.top_logprobs[2] is None
    for row in (0, 3, 4):
        top = out.top_logprobs[row]
        k = params[row].top_logprobs
        order = sorted(range(VOCAB_SIZE), key=lambda t: (-logits[row, t].item(), t))[:k]
        assert top.token_ids == order
        assert top.logprobs == pytest.approx(expected[row, order].tolist(), abs=1e-5)
    assert out.top_logprobs[3].token_ids[:10] == list(range(10, 20))
    # Greedy: the chosen token leads its own list, with the same logprob.
    assert out.top_logprobs[0].token_ids[0] == out.token_ids[0]
    assert out.top_logprobs[0].logprobs[0] == pytest.approx(out.logprobs[0], abs=1e-6)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"top_logprobs": 2}, "needs logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, r"\[0, 20\]"),
        ({"logprobs": True, "top_logprobs": -1}, r"\[0, 20\]"),
        ({"logprobs": True, "top_logprobs": True}, r"\[0, 20\]"),
    ],
)
def test_bad_top_logprobs_are_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


@pytest.mark.parametrize("vocab_size", [64, 32000, 128256])
def test_greedy_ties_pick_the_first_maximum(vocab_size: int) -> None:
    generator = torch.Generator().manual_seed(5)
    logits = torch.randint(-2, 2, (16, vocab_size), generator=generator).float()
    logits[0] = float("-inf")
    logits[1] = 0.0
    logits[2, vocab_size // 2 :] = 5.0
    params = [SamplingParams(temperature=0.0)] * 16
    out = Sampler().sample(logits, params, [None] * 16)
    assert out.token_ids == torch.argmax(logits, dim=-1).tolist()
    assert out.token_ids[1] == 0 and out.token_ids[2] == vocab_size // 2


def _draw_sequence(seed: int, other_rows: int, position: int, num_steps: int) -> list[int]:
    """Tokens drawn for one seeded request sharing the batch with `other_rows` others."""
    sampler = Sampler()
    tokens = []
    for step in range(num_steps):
        # The request sees the same logits at every step whatever its batch neighbours.
        own_logits = random_logits(1, seed=step)
        batch = random_logits(other_rows + 1, seed=500 + step)
        batch[position] = own_logits[0]
        params = [SamplingParams(temperature=0.9, top_k=20, top_p=0.95)] * (other_rows + 1)
        others = [token_draw_seed(1000 + i, step) if i % 2 else None for i in range(other_rows)]
        draw_seeds = [*others[:position], token_draw_seed(seed, step), *others[position:]]
        tokens.append(sampler.sample(batch, params, draw_seeds).token_ids[position])
    return tokens


def test_seed_reproducible_regardless_of_batch() -> None:
    alone = _draw_sequence(seed=7, other_rows=0, position=0, num_steps=20)
    assert _draw_sequence(seed=7, other_rows=5, position=3, num_steps=20) == alone
    assert _draw_sequence(seed=7, other_rows=9, position=9, num_steps=20) == alone
    # Sampling is really random: another seed gives another sequence.
    assert _draw_sequence(seed=8, other_rows=0, position=0, num_steps=20) != alone


def _frequencies(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    counts = torch.bincount(torch.tensor(token_ids), minlength=vocab_size).float()
    return counts / len(token_ids)


# Fixed seeds make these deterministic; 0.02 is also > 5 standard deviations at these sizes.
FREQ_TOLERANCE = 0.02


def test_temperature_frequencies_follow_softmax_seeded() -> None:
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    num_draws = 6000
    params = [SamplingParams(temperature=2.0)] * num_draws
    out = Sampler().sample(base.expand(num_draws, -1), params, list(range(num_draws)))
    expected = torch.softmax(base / 2.0, dim=-1)
    assert torch.allclose(_frequencies(out.token_ids, 5), expected, atol=FREQ_TOLERANCE)


def test_unseeded_frequencies_follow_softmax() -> None:
    base = torch.tensor([1.0, 0.0, -0.5, 0.3])
    num_draws = 20000
    params = [SamplingParams(temperature=0.7)] * num_draws
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        out = Sampler().sample(base.expand(num_draws, -1), params, [None] * num_draws)
    expected = torch.softmax(base / 0.7, dim=-1)
    assert torch.allclose(_frequencies(out.token_ids, 4), expected, atol=FREQ_TOLERANCE)


@pytest.mark.parametrize(
    ("top_k", "top_p", "kept"),
    [
        (2, 1.0, [0, 1]),
        (0, 0.75, [0, 1]),  # probs .5,.3,.15,.05: mass before token 2 is .8 >= .75
        (-1, 0.85, [0, 1, 2]),
        (3, 0.5, [0]),  # after top-k, mass before token 1 is .5/.95 >= .5
        # top-p sees what top-k left, renormalised: mass before token 2 is .8/.95 >= .83
        (3, 0.83, [0, 1]),
    ],
)
def test_top_k_top_p_keep_the_nucleus(top_k: int, top_p: float, kept: list[int]) -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    num_draws = 6000
    params = [SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)] * num_draws
    out = Sampler().sample(probs.log().expand(num_draws, -1), params, list(range(num_draws)))
    expected = torch.zeros(4)
    expected[kept] = probs[kept] / probs[kept].sum()
    assert torch.allclose(_frequencies(out.token_ids, 4), expected, atol=FREQ_TOLERANCE)


def test_rows_use_their_own_filters() -> None:
    logits = random_logits(2, seed=4).repeat(200, 1)
    params = [SamplingParams(top_k=1), SamplingParams(top_k=0)] * 200
    out = Sampler().sample(logits, params, list(range(400)))
    argmax = torch.argmax(logits, dim=-1).tolist()
    assert out.token_ids[0::2] == argmax[0::2]
    assert out.token_ids[1::2] != argmax[1::2]


def test_rejects_mismatched_inputs() -> None:
    with pytest.raises(ValueError, match="params"):
        Sampler().sample(random_logits(3), [SamplingParams()] * 2, [None] * 3)
    with pytest.raises(ValueError, match="shape"):
        Sampler().sample(torch.zeros(VOCAB_SIZE), [SamplingParams()], [None])


def test_min_p_drops_tokens_less_likely_than_its_share_of_the_top() -> None:
    """After temperature, a token survives when p >= min_p * p_max: over many seeded
    draws every chosen token does, and min_p 1 is greedy."""
    logits = random_logits(4, seed=8)
    temperature, min_p = 1.5, 0.2
    probs = torch.softmax(logits / temperature, dim=-1)
    allowed = probs >= min_p * probs.max(dim=-1, keepdim=True).values
    sampler = Sampler()
    params = [SamplingParams(temperature=temperature, min_p=min_p)] * 4
    for seed in range(200):
        out = sampler.sample(logits, params, [token_draw_seed(seed, row) for row in range(4)])
        assert all(allowed[row, token] for row, token in enumerate(out.token_ids))
    greedy = sampler.sample(logits, [SamplingParams(temperature=3.0, min_p=1.0)] * 4, [1] * 4)
    assert greedy.token_ids == torch.argmax(logits, dim=-1).tolist()
    # Rows without min_p in the same batch keep every token.
    mixed = [SamplingParams(temperature=5.0, min_p=0.9), SamplingParams(temperature=5.0)] * 2
    drawn = Counter(sampler.sample(logits, mixed, [seed] * 4).token_ids[1] for seed in range(300))
    assert len(drawn) > int(allowed[1].sum())


@pytest.mark.parametrize("min_p", [-0.1, 1.5, float("nan"), "0.5"])
def test_bad_min_p_is_refused(min_p) -> None:
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=min_p)


def test_rank_logprobs_breaks_ties_in_index_order_like_a_stable_sort() -> None:
    """bfloat16 logits tie often; the ranking must not depend on topk's own order."""
    generator = torch.Generator().manual_seed(9)
    logits = torch.randn(16, 32000, generator=generator).bfloat16().float()
    logits[3] = 0.0  # every token tied
    logits[4, 100:140] = 9.0  # ties above the k-th value
    log_totals = torch.logsumexp(logits, dim=-1, keepdim=True)
    ranked = rank_logprobs(logits, log_totals, 20)
    sorted_values, order = logits.sort(dim=-1, descending=True, stable=True)
    for row, top in enumerate(ranked):
        assert top.token_ids == order[row, :20].tolist()
        expected = (sorted_values[row, :20] - log_totals[row]).tolist()
        assert top.logprobs == pytest.approx(expected)
    assert ranked[3].token_ids == list(range(20))
