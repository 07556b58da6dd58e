"""Request specs for a benchmark run, generated (never downloaded) from a seed."""

from __future__ import annotations

import random
import uuid
import zlib
from dataclasses import dataclass
from typing import Protocol

import numpy as np

# Low ids are special tokens in most vocabularies (unk, bos, eos, ...): prompts skip them.
FIRST_TOKEN_ID = 10

# Words for text prompts: common, short, and one BPE token each in most vocabularies.
_WORD_TEXT = """the of and to in is was for on are with as his they be at one have this from or
    had by word but what some we can out other were all there when up use your how said
    an each she which do their time if will way about many then them write would like so
    these her long make thing see him two has look more day could go come did number
    sound no most people my over know water than call first who may down side been now
    find any new work part take get place made live where after back little only round
    man year came show every good me give our under name very through just form sentence
    great think say help low line differ turn cause much mean before move right boy old
    too same tell does set three want air well also play small end put home read hand
    port large spell add even land here must big high such follow act why ask men change
    went light kind off need house picture try us again animal point mother world near
    build self earth father head stand own page should country found answer school grow
    study still learn plant cover food sun four between state keep eye never last let
    thought city tree cross farm hard start might story saw far sea draw left late run
    while press close night real life few north open seem together next white children
    begin got walk example ease paper group always music those both mark often letter
    until mile river car feet care second book carry took science eat room friend began
    idea fish mountain stop once base hear horse cut sure watch color face wood main"""
WORDS = tuple(_WORD_TEXT.split())

# Tags of request classes; metrics and plots single out LONG_TAG (long documents/prompts).
SHORT_TAG = "short"
LONG_TAG = "long"

# Seed streams: requests of different workloads (and long prompts) never share a stream.
# The numbers are part of the published runs' prompts: keep them.
_STREAM_FIXED, _STREAM_CHAT, _STREAM_MIX = 1, 5, 6


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: what the client puts on the wire."""

    req_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    ignore_eos: bool = True  # exactly max_tokens, so output lengths are known
    tag: str = SHORT_TAG  # the part of the workload ("short", "long"); summaries group by it
    text: str = ""  # a text prompt of its own; "" = the ids as words

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def prompt_text(self) -> str:
        """The prompt as words, one per token id (for servers that refuse token ids)."""
        return self.text or " ".join(WORDS[i % len(WORDS)] for i in self.prompt_ids)


class Workload(Protocol):
    """A deterministic, unbounded sequence of request specs."""

    @property
    def name(self) -> str: ...

    def request(self, index: int) -> RequestSpec: ...


def take(workload: Workload, num_requests: int) -> list[RequestSpec]:
    """The first `num_requests` specs of `workload`."""
    return [workload.request(i) for i in range(num_requests)]


@dataclass(frozen=True)
class Vocab:
    """Where prompt token ids come from."""

    vocab_size: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.vocab_size <= FIRST_TOKEN_ID + 1:
            raise ValueError(f"vocab_size must be > {FIRST_TOKEN_ID + 1}, got {self.vocab_size}")

    def rng(self, stream: int, *keys: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, stream, *keys])

    def token_ids(self, rng: np.random.Generator, length: int) -> tuple[int, ...]:
        return tuple(int(t) for t in rng.integers(FIRST_TOKEN_ID, self.vocab_size, size=length))


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class FixedWorkload:
    """Every prompt `input_len` random ids, every output `output_len` tokens."""

    vocab: Vocab
    input_len: int
    output_len: int
    tag: str = SHORT_TAG
    name: str = "fixed"

    def __post_init__(self) -> None:
        _check_positive(input_len=self.input_len, output_len=self.output_len)

    def request(self, index: int) -> RequestSpec:
        # The tag is part of the seed: long prompts differ from short ones of equal length.
        rng = self.vocab.rng(_STREAM_FIXED, zlib.crc32(self.tag.encode()), index)
        ids = self.vocab.token_ids(rng, self.input_len)
        return RequestSpec(f"{self.tag}-{index}", ids, self.output_len, tag=self.tag)


@dataclass(frozen=True)
class TextPrompts:
    """Text prompts of `num_words` words, each starting with its own number so the prefix
    cache cannot turn prefill into a lookup; with `text`, every request sends that text."""

    seed: int
    max_tokens: int
    text: str = ""
    num_words: int = 40  # about 45 tokens with the presets' tokenizer
    name: str = "text"

    def request(self, index: int) -> RequestSpec:
        if self.text:  # the same prompt each time: ids must still be unique
            req_id = f"{self.seed}-{index}-{uuid.uuid4().hex[:8]}"
            return RequestSpec(req_id, (), self.max_tokens, text=self.text)
        rng = random.Random(self.seed * 1_000_003 + index)
        words = " ".join(rng.choice(WORDS) for _ in range(self.num_words))
        req_id = f"{self.seed}-{index}"
        return RequestSpec(req_id, (), self.max_tokens, text=f"{req_id}: {words}")


@dataclass(frozen=True)
class ChatMix:
    """ShareGPT-like log-normal lengths: the means are vLLM's ShareGPT sampling with a Llama
    tokenizer; sigma sets the tail (median = mean·e^(−σ²/2))."""

    mean_input_len: float = 215.0
    mean_output_len: float = 198.0
    input_sigma: float = 1.1
    output_sigma: float = 0.9
    min_len: int = 4

    def __post_init__(self) -> None:
        if self.mean_input_len < self.min_len or self.mean_output_len < self.min_len:
            raise ValueError(f"mean lengths must be >= min_len ({self.min_len})")
        if self.input_sigma < 0 or self.output_sigma < 0:
            raise ValueError("sigmas must be >= 0")

    def sample(self, rng: np.random.Generator) -> tuple[int, int]:
        """One (input_len, output_len) pair, each at least `min_len`."""

        def draw(mean_len: float, sigma: float) -> int:
            mu = np.log(mean_len) - sigma**2 / 2  # a log-normal's mean is e^(mu + sigma²/2)
            return max(self.min_len, round(float(rng.lognormal(mu, sigma))))

        # Input first: the same seed gives the same pairs as ever.
        input_len = draw(self.mean_input_len, self.input_sigma)
        return input_len, draw(self.mean_output_len, self.output_sigma)


@dataclass(frozen=True)
class ChatWorkload:
    """A synthetic chat mix; lengths clipped so prompt + output fit `max_model_len`."""

    vocab: Vocab
    mix: ChatMix
    max_model_len: int
    name: str = "chat"

    def __post_init__(self) -> None:
        if self.max_model_len < 2 * self.mix.min_len:
            raise ValueError(f"max_model_len must be >= {2 * self.mix.min_len}")

    def request(self, index: int) -> RequestSpec:
        rng = self.vocab.rng(_STREAM_CHAT, index)
        input_len, output_len = self.mix.sample(rng)
        input_len = min(input_len, self.max_model_len - self.mix.min_len)
        output_len = min(output_len, self.max_model_len - input_len)
        return RequestSpec(f"chat-{index}", self.vocab.token_ids(rng, input_len), output_len)


@dataclass(frozen=True)
class MixedWorkload:
    """Chat, and with probability `long_fraction` a document (tag "long"): prompt uniform in
    `long_input_len`·(1 ± 0.25), output `long_output_len`; clipped to `chat.max_model_len`."""

    chat: ChatWorkload
    long_fraction: float
    long_input_len: int
    long_output_len: int
    name: str = "mixed"

    def __post_init__(self) -> None:
        if not 0 <= self.long_fraction <= 1:
            raise ValueError(f"long_fraction must be in [0, 1], got {self.long_fraction}")
        _check_positive(long_input_len=self.long_input_len, long_output_len=self.long_output_len)
        if self.long_output_len >= self.chat.max_model_len:
            raise ValueError("long_output_len must be < max_model_len")

    @property
    def vocab(self) -> Vocab:
        return self.chat.vocab

    def request(self, index: int) -> RequestSpec:
        rng = self.vocab.rng(_STREAM_MIX, index)
        if rng.random() >= self.long_fraction:
            return self.chat.request(index)
        low, high = int(self.long_input_len * 0.75), int(self.long_input_len * 1.25)
        input_len = int(rng.integers(max(1, low), max(1, high) + 1))
        input_len = min(input_len, self.chat.max_model_len - self.long_output_len)
        ids = self.vocab.token_ids(rng, input_len)
        return RequestSpec(f"doc-{index}", ids, self.long_output_len, tag=LONG_TAG)
