"""Logit bias and penalties in the Sampler against a plain per-token reference."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import pytest
import torch

from tandem.engine.request import Request
from tandem.engine.sampler import Sampler
from tandem.engine.sampling_params import SamplingParams

VOCAB_SIZE = 50


@dataclass
class History:
    penalty_prompt_token_ids: list[int]
    generated_token_ids: list[int] = field(default_factory=list)


def reference(logits: torch.Tensor, params: SamplingParams, history: History) -> torch.Tensor:
    """The textbook definitions, one token at a time (what the batched code must equal)."""
    out = logits.clone().float()
    for token_id, bias in params.logit_bias.items():
        out[token_id] += bias
    seen = set(history.penalty_prompt_token_ids) | set(history.generated_token_ids)
    for token_id in range(out.shape[0]):
        value = out[token_id].item()
        if token_id in seen and params.repetition_penalty != 1.0:
            rp = params.repetition_penalty
            value = value / rp if value > 0 else value * rp
        count = history.generated_token_ids.count(token_id)
        value -= count * params.frequency_penalty + (count > 0) * params.presence_penalty
        out[token_id] = value
    return out


def random_case(rng: random.Random) -> tuple[SamplingParams, History]:
    params = SamplingParams(
        temperature=0.0,
        logprobs=True,
        presence_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        frequency_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        repetition_penalty=rng.choice([1.0, rng.uniform(0.5, 2.0)]),
        logit_bias={rng.randrange(VOCAB_SIZE): rng.uniform(-100, 100) for _ in range(3)}
        if rng.random() < 0.5
        else {},
    )
    prompt = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randrange(1, 12))]
    generated = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randrange(0, 20))]
    return params, History(prompt, generated)


def test_batched_penalties_equal_the_reference() -> None:
    rng = random.Random(0)
    cases = [random_case(rng) for _ in range(40)]
    logits = torch.randn(len(cases), VOCAB_SIZE, generator=torch.Generator().manual_seed(0)) * 4
    params = [p for p, _ in cases]
    histories = [h for _, h in cases]
    out = Sampler().sample(logits, params, [None] * len(cases), histories)
    for row, (p, h) in enumerate(cases):
        expected = reference(logits[row], p, h)
        assert out.token_ids[row] == int(expected.argmax()), f"row {row}: {p}, {h}"
    # The reported logprob is that of the logits as given (vLLM's default).
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs == pytest.approx(
        [raw[r, t].item() for r, t in enumerate(out.token_ids)], abs=1e-5
    )


def test_rows_without_penalties_are_untouched_and_need_no_history() -> None:
    logits = torch.randn(4, VOCAB_SIZE, generator=torch.Generator().manual_seed(1))
    out = Sampler().sample(logits, [SamplingParams(temperature=0.0)] * 4, [None] * 4)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    with pytest.raises(ValueError, match="history"):
        Sampler().sample(logits[:1], [SamplingParams(presence_penalty=1.0)], [None])


def test_logit_bias_minus_100_bans_and_plus_100_forces_even_when_sampling() -> None:
    logits = torch.randn(300, VOCAB_SIZE, generator=torch.Generator().manual_seed(2))
    favourite = int(logits.sum(dim=0).argmax())
    banned = [SamplingParams(temperature=1.0, logit_bias={favourite: -100.0})] * 300
    out = Sampler().sample(logits, banned, list(range(300)))
    assert favourite not in out.token_ids
    forced = [SamplingParams(temperature=1.0, logit_bias={7: 100.0})] * 300
    out = Sampler().sample(logits, forced, list(range(300)))
    assert set(out.token_ids) == {7}


def test_allowed_token_ids_restrict_only_their_own_rows() -> None:
    """vLLM's allowed_token_ids: a restricted row (greedy or sampled) chooses only among
    its ids, even where biases and penalties favour others; the batch's other rows
    choose as they would alone; logprobs stay those of the unmodified logits."""
    logits = torch.randn(300, VOCAB_SIZE, generator=torch.Generator().manual_seed(3))
    allowed = [4, 9, 31]
    restricted = SamplingParams(
        temperature=1.0, allowed_token_ids=allowed, logit_bias={0: 100.0}, logprobs=True
    )
    free = SamplingParams(temperature=1.0, logprobs=True)
    rows = [restricted if i % 2 else free for i in range(300)]
    out = Sampler().sample(logits, rows, list(range(300)))
    assert {out.token_ids[i] for i in range(1, 300, 2)} == set(allowed)  # each drawn
    alone = Sampler().sample(logits[0::2], [free] * 150, list(range(0, 300, 2)))
    assert out.token_ids[0::2] == alone.token_ids
    chosen = logits.log_softmax(-1)[torch.arange(300), torch.tensor(out.token_ids)]
    assert out.logprobs == pytest.approx(chosen.tolist(), abs=1e-5)
    greedy = SamplingParams(temperature=0.0, allowed_token_ids=allowed)
    best = [allowed[int(row[allowed].argmax())] for row in logits[:5]]
    assert Sampler().sample(logits[:5], [greedy] * 5, [None] * 5).token_ids == best


def test_frequency_penalty_counts_only_generated_tokens() -> None:
    logits = torch.zeros(1, VOCAB_SIZE)
    logits[0, 3] = 1.0
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    in_prompt = Sampler().sample(logits, [params], [None], [History([3, 3, 3])])
    assert in_prompt.token_ids == [3]
    generated = Sampler().sample(logits, [params], [None], [History([1], [3])])
    assert generated.token_ids != [3]


def test_request_counts_resumed_tokens_as_generated() -> None:
    """After a migration the prompt carries tokens already sent; they stay 'generated'."""
    params = SamplingParams(presence_penalty=1.0, num_resumed_tokens=2)
    request = Request("r", [5, 6, 7, 8], params, output_token_ids=[9])
    assert request.penalty_prompt_token_ids == [5, 6]
    assert request.generated_token_ids == [7, 8, 9]
    fresh = Request("s", [5, 6], SamplingParams(presence_penalty=1.0), output_token_ids=[7])
    assert fresh.generated_token_ids == [7] and fresh.penalty_prompt_token_ids == [5, 6]


@pytest.mark.gpu
def test_cuda_logits_choose_what_cpu_logits_choose() -> None:
    rng = random.Random(3)
    cases = [random_case(rng) for _ in range(16)]
    logits = torch.randn(len(cases), VOCAB_SIZE, generator=torch.Generator().manual_seed(3)) * 4
    params = [p for p, _ in cases]
    histories = [h for _, h in cases]
    on_cpu = Sampler().sample(logits, params, [None] * len(cases), histories)
    on_gpu = Sampler().sample(logits.cuda(), params, [None] * len(cases), histories)
    assert on_gpu.token_ids == on_cpu.token_ids


def test_bad_words_ban_a_last_token_only_after_the_rest_of_the_word() -> None:
    """vLLM's bad_words as token sequences: [7, 5] bans 5 only right after a generated 7
    (resumed tokens count as generated, the prompt does not); [9] bans 9 everywhere;
    logprobs stay those of the unmodified logits."""
    logits = torch.zeros(1, VOCAB_SIZE)
    logits[0, 5], logits[0, 9], logits[0, 2] = 3.0, 2.0, 1.0
    params = SamplingParams(temperature=0.0, logprobs=True, bad_words_token_ids=[[7, 5], [9]])
    after_7 = History([1], [4, 7])
    out = Sampler().sample(logits, [params], [None], [after_7])
    assert out.token_ids == [2]
    assert out.logprobs == pytest.approx([logits.log_softmax(-1)[0, 2].item()], abs=1e-6)
    assert Sampler().sample(logits, [params], [None], [History([1], [7, 4])]).token_ids == [5]
    assert Sampler().sample(logits, [params], [None], [History([1, 7])]).token_ids == [5]
    resumed = Request("r", [1, 7], dataclasses.replace(params, num_resumed_tokens=1))
    assert Sampler().sample(logits, [resumed.params], [None], [resumed]).token_ids == [2]
    # Sampled rows too; a row without bad words in the same batch is untouched.
    sampled = dataclasses.replace(params, temperature=1.0)
    free = SamplingParams(temperature=1.0)
    batch = torch.cat([logits.expand(200, -1), logits.expand(200, -1)]) * 3
    rows = [sampled] * 200 + [free] * 200
    histories = [after_7] * 400
    out = Sampler().sample(batch, rows, list(range(400)), histories)
    assert not {5, 9} & set(out.token_ids[:200])
    assert {5, 9} <= set(out.token_ids[200:])
    with pytest.raises(ValueError, match="history"):
        Sampler().sample(logits, [params], [None])
    for bad in ([[]], [[-1]], [[3, True]], [7]):
        with pytest.raises(ValueError, match="bad_words_token_ids"):
            SamplingParams(bad_words_token_ids=bad)
