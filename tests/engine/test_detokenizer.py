"""IncrementalDetokenizer: streamed text equals a full decode, stop strings, O(1) window."""

from __future__ import annotations

import random
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.sampling_params import SamplingParams

CORPUS = [
    "Hello world, the quick brown fox 🦊 jumps over the lazy dog.",
    "你好世界，今天天气很好。こんにちは世界",
    "emoji party 😀🎉👍🏽 and a flag 🇫🇷 too",
    "Stop here: STOP. Then continue with café, naïve, Ωmega.",
]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>"]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE small enough that CJK and emoji split across several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", clean_up_tokenization_spaces=False
    )


def stream(
    tokenizer: Any, prompt_ids: list[int], output_ids: list[int], params: SamplingParams
) -> tuple[list[str], str | None, IncrementalDetokenizer]:
    """Feed tokens until a stop string hits; returns deltas (flush last) and the stop."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params)
    deltas = []
    for token_id in output_ids:
        update = detok.add_token(token_id)
        deltas.append(update.delta_text)
        if update.stop_string is not None:
            return deltas, update.stop_string, detok
    deltas.append(detok.flush())
    return deltas, detok.stop_string, detok


def expected_cut(text: str, stops: list[str], include: bool = False) -> tuple[str, str | None]:
    """Cut before the stop occurrence that completes first (earliest end, then start); after
    it with `include` (include_stop_str_in_output)."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not found:
        return text, None
    end, start, stop = min(found, key=lambda f: f[:2])
    return text[: end if include else start], stop


def random_output(rng: random.Random, tokenizer: Any) -> list[int]:
    """Tokens of real multilingual text mixed with arbitrary ids (broken UTF-8 included)."""
    ids: list[int] = []
    for _ in range(rng.randint(1, 6)):
        if rng.random() < 0.6:
            sentence = rng.choice(CORPUS)
            start = rng.randrange(len(sentence))
            ids += tokenizer.encode(sentence[start : start + rng.randint(1, 20)])
        else:
            ids += [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 4))]
    return ids


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_stream_equals_full_decode(tokenizer: Any, skip_special_tokens: bool) -> None:
    rng = random.Random(0)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    for _ in range(150):
        prompt_ids = random_output(rng, tokenizer) if rng.random() < 0.7 else []
        output_ids = random_output(rng, tokenizer)
        deltas, stop, detok = stream(tokenizer, prompt_ids, output_ids, params)
        expected = tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == expected, output_ids
        assert stop is None
        assert detok.output_text == expected
        assert detok.output_token_ids == output_ids


@pytest.mark.parametrize("include", [False, True])
def test_stream_with_stop_strings_equals_cut_decode(tokenizer: Any, include: bool) -> None:
    rng = random.Random(1)
    num_stopped = 0
    for _ in range(200):
        output_ids = random_output(rng, tokenizer)
        full = tokenizer.decode(output_ids, skip_special_tokens=True)
        stops = [rng.choice(["STOP", "fox 🦊", "世界", "\n", "zz"])]
        for _ in range(rng.randint(0, 3)):
            if full:
                start = rng.randrange(len(full))
                stops.append(full[start : start + rng.randint(1, 4)])
        params = SamplingParams(stop=stops, include_stop_str_in_output=include)
        deltas, stop, detok = stream(tokenizer, [], output_ids, params)
        expected_text, expected_stop = expected_cut(full, stops, include)
        assert "".join(deltas) == expected_text, (output_ids, stops)
        assert stop == expected_stop
        assert detok.output_text == expected_text
        # Streaming never shows text that is later taken back.
        released = ""
        for delta in deltas:
            released += delta
            assert expected_text.startswith(released)
        num_stopped += stop is not None
    assert num_stopped > 50  # the test exercises stops, not only pass-through


def char_tokens(tokenizer: Any, text: str) -> list[int]:
    return [i for ch in text for i in tokenizer.encode(ch)]


def test_partial_stop_string_is_held_back(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["world"]))
    deltas = [detok.add_token(i).delta_text for i in char_tokens(tokenizer, "Hello wor")]
    assert "".join(deltas) == "Hello "
    assert detok.output_text == "Hello wor"
    update = detok.add_token(char_tokens(tokenizer, "l")[0])
    assert (update.delta_text, update.stop_string) == ("", None)
    update = detok.add_token(char_tokens(tokenizer, "d")[0])
    assert (update.delta_text, update.stop_string) == ("", "world")
    assert detok.output_text == "Hello "
    with pytest.raises(RuntimeError):
        detok.add_token(0)


@pytest.mark.parametrize(
    ("text", "stop", "min_tokens", "expected"),
    [
        ("a.b.c.d", ".", 0, "a"),
        ("a.b.c.d", ".", 1, "a"),  # the first "." is the second token
        ("a.b.c.d", ".", 2, "a.b"),
        ("a.b.c.d", ".", 3, "a.b"),
        ("a.b.c.d", ".", 4, "a.b.c"),
        ("a.b.c.d", ".", 7, None),  # every "." within the first min_tokens
        ("xy", "xy", 1, ""),  # begun within min_tokens, completed past them
    ],
)
def test_stop_strings_end_the_output_only_past_min_tokens(
    tokenizer: Any, text: str, stop: str, min_tokens: int, expected: str | None
) -> None:
    params = SamplingParams(max_tokens=16, min_tokens=min_tokens, stop=[stop])
    deltas, found, detok = stream(tokenizer, [], char_tokens(tokenizer, text), params)
    assert found == (None if expected is None else stop)
    assert "".join(deltas) == detok.output_text == (text if expected is None else expected)


def test_false_start_of_stop_string_is_released(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["world"]))
    deltas = [detok.add_token(i).delta_text for i in char_tokens(tokenizer, "Hello word")]
    assert "".join(deltas) == "Hello word"
    assert detok.flush() == ""


def test_held_stop_prefix_released_by_flush(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["STOP"]))
    deltas = [detok.add_token(i).delta_text for i in char_tokens(tokenizer, "go ST")]
    assert "".join(deltas) == "go "
    assert detok.flush() == "ST"
    assert detok.stop_string is None


def test_split_emoji_is_never_emitted_broken(tokenizer: Any) -> None:
    emoji_ids = tokenizer.encode("👍🏽")
    assert len(emoji_ids) > 2  # two 4-byte code points split over several tokens
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    deltas = [detok.add_token(i).delta_text for i in emoji_ids]
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[-1].endswith("🏽") and "".join(deltas) == "👍🏽"


def test_incomplete_character_released_by_flush(tokenizer: Any) -> None:
    emoji_ids = tokenizer.encode("🦊")
    assert len(emoji_ids) > 1
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    assert detok.add_token(emoji_ids[0]).delta_text == ""
    assert detok.flush() == tokenizer.decode(emoji_ids[:1])


class CountingTokenizer:
    """Wraps a tokenizer and records the longest id list it was asked to decode."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.max_decode_len = 0

    def decode(self, token_ids: list[int], **kwargs: Any) -> str:
        self.max_decode_len = max(self.max_decode_len, len(token_ids))
        return self.inner.decode(token_ids, **kwargs)


def test_decode_window_stays_short(tokenizer: Any) -> None:
    counting = CountingTokenizer(tokenizer)
    output_ids = tokenizer.encode(" ".join(CORPUS) * 10)
    prompt_ids = tokenizer.encode(CORPUS[0])
    detok = IncrementalDetokenizer(counting, prompt_ids, SamplingParams(stop=["never"]))
    text = "".join(detok.add_token(i).delta_text for i in output_ids) + detok.flush()
    assert text == tokenizer.decode(output_ids)
    assert len(output_ids) > 500
    assert counting.max_decode_len <= 12


def test_prompt_context_keeps_leading_space_of_sentencepiece_tokens() -> None:
    """Metaspace decoding drops the first token's space; the prompt context keeps it."""
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    metaspace = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    assert metaspace.decode([2]) == "world"
    detok = IncrementalDetokenizer(metaspace, [1], SamplingParams())
    deltas = [detok.add_token(i).delta_text for i in [2, 3]]
    assert deltas == [" world", "!"]


def test_tokenizer_with_space_clean_up_streams_its_own_decode() -> None:
    """transformers' clean-up of tokenization spaces changes the decoded text; the stream
    keeps it (it decodes through the tokenizer, not the Rust tokenizer directly)."""
    vocab = {"<unk>": 0, "Hello": 1, ",": 2, "world": 3, "!": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    cleaning = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", clean_up_tokenization_spaces=True
    )
    output_ids = [1, 2, 3, 4]
    assert tok.decode(output_ids) == "Hello , world !"
    assert cleaning.decode(output_ids) == "Hello, world!"
    deltas, _, _ = stream(cleaning, [], output_ids, SamplingParams())
    assert "".join(deltas) == "Hello, world!"
