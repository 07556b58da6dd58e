"""Dummy-model maker: writes a Llama model directory that `transformers` loads unchanged.

Tandem's tests and demos need a model without downloading weights. `make_model` writes
`config.json`, `generation_config.json`, `model.safetensors` (float32, random weights
from a seed) and a byte-level BPE tokenizer trained on a synthetic corpus, with a
ChatML chat template. The weights are initialised so that greedy decoding varies and
has well-separated top-1 logits: the engine's greedy output must match `transformers`
token for token, and near-ties would let fp32 rounding flip an argmax. (Measured on
`tiny`, seeds 0-2, 3,000 greedy steps: logits std 5, median top-1/top-2 gap ~3,
about 2 gaps in 1,000 below 1e-2 and 1 in 3,000 below 1e-3.)
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

logger = logging.getLogger(__name__)

UNK_TOKEN, BOS_TOKEN, EOS_TOKEN = "<unk>", "<s>", "</s>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# Order fixes the ids: <unk>=0, <s>=1, </s>=2, then the chat markers.
SPECIAL_TOKENS = (UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START, IM_END)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Kept as one string (not a list literal) so the table stays ~15 lines.
_WORD_TEXT = """
the of and to a in is it you that he was for on are with as I his they be at one have
this from or had by hot but some what there we can out other were all your when up use
word how said an each she which do their time if will way about many then them would
write like so these her long make thing see him two has look more day could go come did
my sound no most number who over know water than call first people may down side been
now find any new work part take get place made live where after back little only round
man year came show every good me give our under name very through just form much great
think say help low line before turn cause same mean differ move right boy old too does
tell sentence set three want air well also play small end put home read hand port large
spell add even land here must big high such follow act why ask men change went light
kind off need house picture try us again animal point mother world near build self earth
father head stand own page should country found answer school grow study still learn
plant cover food sun four thought let keep eye never last door between city tree cross
since hard start might story saw far sea draw left late run while press close night real
life few stop open seem together next white children begin got walk example ease paper
often always music those both mark book letter until mile river car feet care second
group carry took rain eat room friend began idea fish mountain north once base hear
horse cut sure watch color face wood main enough plain girl usual young ready above ever
red list though feel talk bird soon body dog family direct pose leave song measure state
product black short numeral class wind question happen complete ship area half rock
order fire south problem piece told knew pass farm top whole king size heard best hour
better true during hundred am remember step early hold west ground interest reach fast
five sing listen six table travel less morning ten simple several vowel toward war lay
against pattern slow center love person money serve appear road map science rule govern
pull cold notice voice fall power town fine certain fly unit lead cry dark machine note
wait plan figure star box noun field rest correct able pound done beauty drive stood
contain front teach week final gave green oh quick develop sleep warm free minute strong
special mind behind clear tail produce fact street inch lot nothing course stay wheel
full force blue object decide surface deep moon island foot yet busy test record boat
common gold possible plane age dry wonder laugh thousand ago ran check game shape yes
miss brought heat snow bed bring sit perhaps fill east weight language among model token
request server cache block decode prefill batch queue worker router cluster latency
"""
_WORDS = tuple(_WORD_TEXT.split())
_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwyz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]
_PUNCTUATION = (".", ".", ".", "!", "?", ";")


@dataclass(frozen=True)
class ModelPreset:
    """Shape of one dummy model (Llama architecture)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int  # < num_heads: grouped-query attention
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    # Weight init std. Larger than HF's 0.02 so that random layers change the residual
    # stream enough to vary the greedy output (at 0.02 it repeats one token forever).
    init_std: float = 0.05
    logits_std: float = 5.0  # target std of the output logits, set by the final norm
    # Std of log(row scale) of the output projection: heavier-tailed logits, so the
    # top-1/top-2 gap is ~3x larger than with Gaussian logits of the same std.
    token_scale_spread: float = 0.4


PRESETS: dict[str, ModelPreset] = {
    "tiny": ModelPreset(4, 256, 4, 2, 640, 2048, True, 2048, init_std=0.1),
    "small": ModelPreset(12, 768, 12, 4, 2048, 32000, False, 4096, init_std=0.04),
}


def make_model(preset: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write a loadable HF model directory for `preset` to `out_dir` and return its path."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    spec = PRESETS[preset]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(spec.vocab_size, spec.max_position_embeddings)
    # The chat template goes into tokenizer_config.json (not chat_template.jinja), and the
    # class name is one that transformers 4.x also knows: both for older readers.
    tokenizer.save_pretrained(out, save_jinja_files=False)
    _update_json(out / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast"})

    config = _llama_config(spec)
    model = _build_model(config, spec, seed)
    model.save_pretrained(out)
    # transformers 5 writes only `rope_parameters`; readers of 4.x configs want these.
    _update_json(out / "config.json", {"rope_theta": spec.rope_theta, "torch_dtype": "float32"})
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(out)

    num_params = sum(p.numel() for p in model.parameters())
    logger.info("wrote %s model (%d params, seed %d) to %s", preset, num_params, seed, out)
    return out


def _llama_config(spec: ModelPreset) -> LlamaConfig:
    # rope_theta: transformers 5 takes this 4.x keyword through **kwargs, untyped.
    return LlamaConfig(  # type: ignore[call-arg]
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        rms_norm_eps=spec.rms_norm_eps,
        initializer_range=spec.init_std,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )


def _build_model(config: LlamaConfig, spec: ModelPreset, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    # .float(), not .to(torch.float32): transformers types its `to` wrapper wrongly.
    model = LlamaForCausalLM(config).float().eval()
    separate_logits(model, spec.logits_std, spec.token_scale_spread)
    return model


def separate_logits(
    model: PreTrainedModel, logits_std: float = 5.0, token_scale_spread: float = 0.4
) -> None:
    """Re-scale a random causal LM's output so greedy argmax is rarely a near-tie.

    Usable on any HF Llama-family model (Qwen2, Mistral, ...) built from a config with
    `initializer_range` around 0.1 / sqrt(hidden_size / 256); draws from torch's RNG.
    """
    hidden_size = model.config.hidden_size
    with torch.no_grad():
        # Per-token scale on the output rows (with tied weights, also on the embeddings,
        # which the first RMSNorm mostly undoes): a few tokens stand out at each step.
        head = model.get_output_embeddings().weight
        head.mul_(torch.randn(head.shape[0], 1).mul_(token_scale_spread).exp_())
        # The final RMSNorm output has unit RMS per element before its weight, so its
        # weight sets the logits' scale without changing which token wins.
        model.model.norm.weight.fill_(logits_std / (head.std().item() * hidden_size**0.5))


def _update_json(path: Path, fields: dict[str, object]) -> None:
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def build_tokenizer(vocab_size: int, model_max_length: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of exactly `vocab_size` ids on a seeded synthetic corpus."""
    tok = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_synthetic_corpus(vocab_size), trainer=trainer)
    _pad_vocab(tok, vocab_size)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
                special_tokens=[(BOS_TOKEN, tok.token_to_id(BOS_TOKEN))],
            ),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        pad_token=EOS_TOKEN,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )


def _pad_vocab(tok: Tokenizer, vocab_size: int) -> None:
    """Fill any ids the trainer left unused, so every id < vocab_size decodes."""
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        logger.warning("BPE reached %d of %d ids; padding", tok.get_vocab_size(), vocab_size)
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} ids, expected {vocab_size}")


def _synthetic_corpus(vocab_size: int) -> Iterator[str]:
    """Sentences of common English words, made-up words and numbers, from a fixed seed.

    The made-up words (syllable strings) give the trainer enough distinct words to
    reach large vocabularies; the count scales with the vocabulary asked for.
    """
    rng = random.Random(1234)
    num_invented = vocab_size // 2
    invented = sorted(
        {"".join(rng.choices(_SYLLABLES, k=rng.randint(2, 4))) for _ in range(num_invented)}
    )
    for i in range(vocab_size * 4):
        num_words = rng.randint(4, 14)
        words = []
        for _ in range(num_words):
            roll = rng.random()
            if roll < 0.6:
                words.append(rng.choice(_WORDS))
            elif roll < 0.9:
                words.append(invented[(i * 7 + len(words)) % len(invented)])
            else:
                words.append(str(rng.randint(0, 10 ** rng.randint(1, 4))))
        words[0] = words[0].capitalize()
        if rng.random() < 0.2:
            words[rng.randrange(num_words)] += ","
        yield " ".join(words) + rng.choice(_PUNCTUATION)
