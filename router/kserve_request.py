"""The served model's KServe v2 signature, and a `ModelInferRequest` turned into a request.

The signature follows Triton's vLLM backend so that its clients work unchanged:
`text_input` (BYTES), optional `stream` (BOOL), `sampling_parameters` (BYTES, a JSON
object of vLLM-style sampling settings, numbers also accepted as strings as that backend
does), `exclude_input_in_output` (BOOL), plus Triton's TensorRT-LLM-style scalar inputs
(`max_tokens`, `temperature`, ...). Outputs: `text_output` and `finish_reason` (BYTES).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from tandem.engine.sampling_params import SamplingParams
from tandem.proto.inference import grpc_service_pb2 as kserve_pb
from tandem.router.errors import InvalidRequest
from tandem.router.json_fields import integer_key
from tandem.router.kserve_tensors import decode_input, num_elements
from tandem.router.sampling_defaults import OPENAI_DEFAULTS, SamplingDefaults
from tandem.router.structured_outputs import (
    GUIDED_FIELDS,
    field_ruling_out_grammar_tokens,
    vllm_guided,
)
from tandem.router.tokenization import PromptTokenizer

_INT_TYPES = ("INT32", "INT64", "INT8", "INT16", "UINT8", "UINT16", "UINT32", "UINT64")
_FLOAT_TYPES = ("FP32", "FP64", "FP16")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    # Accepted datatypes; the first is the one ModelMetadata advertises.
    datatypes: tuple[str, ...]
    # Shape ModelMetadata advertises (-1: any size).
    shape: tuple[int, ...]
    optional: bool = True


MODEL_INPUTS = (
    TensorSpec("text_input", ("BYTES",), (1,), optional=False),
    TensorSpec("stream", ("BOOL",), (1,)),
    TensorSpec("sampling_parameters", ("BYTES",), (1,)),
    TensorSpec("exclude_input_in_output", ("BOOL",), (1,)),
    TensorSpec("max_tokens", _INT_TYPES, (1,)),
    TensorSpec("temperature", _FLOAT_TYPES, (1,)),
    TensorSpec("top_p", _FLOAT_TYPES, (1,)),
    TensorSpec("top_k", _INT_TYPES, (1,)),
    TensorSpec("seed", ("UINT64", *_INT_TYPES), (1,)),
)
MODEL_OUTPUTS = (
    TensorSpec("text_output", ("BYTES",), (-1,)),
    TensorSpec("finish_reason", ("BYTES",), (-1,)),
)
_INPUTS = {spec.name: spec for spec in MODEL_INPUTS}
_OUTPUT_NAMES = tuple(spec.name for spec in MODEL_OUTPUTS)
# Scalar inputs that are sampling parameters of the same name.
_SAMPLING_INPUTS = ("max_tokens", "temperature", "top_p", "top_k", "seed")

# sampling_parameters keys by value type (string values are converted, as Triton's
# vLLM backend does: clients send {"temperature": "0.1"}).
_INT_KEYS = {"max_tokens", "top_k", "seed", "min_tokens"}
_FLOAT_KEYS = {
    "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty",
}  # fmt: skip
_BOOL_KEYS = {"ignore_eos", "skip_special_tokens", "include_stop_str_in_output"}
# vLLM settings Tandem does not implement: accepted only at their no-op value.
_NEUTRAL_KEYS = {
    "n": 1,
    "best_of": 1,
}
_INT_RANGES = {
    "seed": (0, 2**64 - 1),
    "stop_token_ids": (0, 2**31 - 1),
    "allowed_token_ids": (0, 2**31 - 1),
}
_DEFAULT_INT_RANGE = (-(2**31), 2**31 - 1)


@dataclass
class KserveRequest:
    """What one `ModelInferRequest` asks for, validated."""

    prompt: str
    prompt_ids: list[int]
    params: SamplingParams
    # Stream text deltas (ModelStreamInfer); otherwise one response with the whole text.
    stream: bool
    # Leave the prompt out of a non-streamed text_output (Triton's vLLM backend prepends
    # it unless this is set; Tandem defaults to leaving it out, like every other API).
    exclude_input_in_output: bool
    # Shape of each output: the shape of `text_input` ([1] or [1, 1]).
    output_shape: list[int]
    # Outputs to return, in order.
    output_names: tuple[str, ...]


def parse_request(
    request: kserve_pb.ModelInferRequest,
    tokenizer: PromptTokenizer,
    defaults: SamplingDefaults = OPENAI_DEFAULTS,
) -> KserveRequest:
    """Validate and convert; raises `InvalidRequest` naming the offending input or key.
    A sampling value the request leaves out is the model's default (`defaults`)."""
    values, shapes = _decode_inputs(request)
    if "text_input" not in values:
        raise InvalidRequest("missing required input 'text_input' (BYTES)", param="text_input")
    prompt = _utf8("text_input", values["text_input"])
    if not prompt:
        raise InvalidRequest("input 'text_input' must be a non-empty string", param="text_input")
    settings: dict[str, Any] = {}
    if "sampling_parameters" in values:
        settings = _sampling_settings(_utf8("sampling_parameters", values["sampling_parameters"]))
    for name in _SAMPLING_INPUTS:
        if name in values:
            if name in settings:
                raise InvalidRequest(
                    f"{name!r} is given both as an input and in sampling_parameters", param=name
                )
            settings[name] = _convert(name, values[name])
    if "bad_words" in settings:
        try:
            settings["bad_words_token_ids"] = tokenizer.bad_words_token_ids(
                settings.pop("bad_words")
            )
        except ValueError as exc:
            raise InvalidRequest(f"'bad_words' {exc}", param="bad_words") from exc
    try:
        prompt_ids = tokenizer.encode(prompt)
    except ValueError as exc:
        raise InvalidRequest(f"input 'text_input': {exc}", param="text_input") from exc
    if "max_tokens" not in settings:
        settings["max_tokens"] = tokenizer.default_max_tokens(len(prompt_ids))
    try:
        params = SamplingParams(**{**asdict(defaults), **settings})
    except ValueError as exc:
        raise InvalidRequest(f"invalid sampling parameters: {exc}", "sampling_parameters") from exc
    if (conflict := field_ruling_out_grammar_tokens(params)) is not None:
        raise InvalidRequest(f"{conflict!r} cannot be combined with structured outputs", conflict)
    for key in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
        try:
            tokenizer.check_vocabulary(key, getattr(params, key))
        except ValueError as exc:
            raise InvalidRequest(f"sampling parameter {exc}", param=key) from exc
    try:
        tokenizer.check_length(len(prompt_ids), params.max_tokens)
    except ValueError as exc:
        # The prompt alone leaves no room, or the output limit asks for too much.
        blame = "text_input" if len(prompt_ids) >= tokenizer.max_model_len else "max_tokens"
        raise InvalidRequest(f"'{blame}': {exc}", param=blame) from exc
    return KserveRequest(
        prompt=prompt,
        prompt_ids=prompt_ids,
        params=params,
        stream=bool(values.get("stream", False)),
        exclude_input_in_output=bool(values.get("exclude_input_in_output", True)),
        output_shape=shapes["text_input"],
        output_names=_output_names(request),
    )


def _decode_inputs(request: kserve_pb.ModelInferRequest) -> tuple[dict[str, Any], dict]:
    """Each input's single element, and each input's shape, by input name."""
    raw_contents = request.raw_input_contents
    if raw_contents and len(raw_contents) != len(request.inputs):
        raise InvalidRequest(
            f"raw_input_contents has {len(raw_contents)} entries for "
            f"{len(request.inputs)} inputs; it needs one per input"
        )
    values: dict[str, Any] = {}
    shapes: dict[str, list[int]] = {}
    for index, tensor in enumerate(request.inputs):
        spec = _INPUTS.get(tensor.name)
        if spec is None:
            raise InvalidRequest(
                f"unknown input {tensor.name!r}; this model takes {sorted(_INPUTS)}",
                param=tensor.name,
            )
        if tensor.name in values:
            raise InvalidRequest(f"input {tensor.name!r} is given twice", param=tensor.name)
        if tensor.datatype not in spec.datatypes:
            expected = " or ".join(spec.datatypes)
            raise InvalidRequest(
                f"input {tensor.name!r} must have datatype {expected}, got {tensor.datatype!r}",
                param=tensor.name,
            )
        if num_elements(tensor.name, tensor.shape) != 1:
            raise InvalidRequest(
                f"input {tensor.name!r} must hold exactly one element (one request per "
                f"call), got shape {list(tensor.shape)}",
                param=tensor.name,
            )
        if list(tensor.shape) not in ([1], [1, 1]):
            # ModelMetadata says [1] (Triton's vLLM backend too); [1, 1] with a batch dim.
            raise InvalidRequest(
                f"input {tensor.name!r} must have shape [1] (or [1, 1]), got {list(tensor.shape)}",
                param=tensor.name,
            )
        elements = decode_input(tensor, raw_contents[index] if raw_contents else None)
        values[tensor.name] = elements[0]
        shapes[tensor.name] = list(tensor.shape)
    return values, shapes


def _output_names(request: kserve_pb.ModelInferRequest) -> tuple[str, ...]:
    if not request.outputs:
        return _OUTPUT_NAMES
    names = tuple(output.name for output in request.outputs)
    for index, name in enumerate(names):
        if name not in _OUTPUT_NAMES:
            raise InvalidRequest(
                f"unknown output {name!r}; this model produces {list(_OUTPUT_NAMES)}", param=name
            )
        if name in names[:index]:
            raise InvalidRequest(f"output {name!r} is requested twice", param=name)
    return names


def _utf8(name: str, value: bytes) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"input {name!r} is not valid UTF-8: {exc}", param=name) from exc


def _sampling_settings(text: str) -> dict[str, Any]:
    """SamplingParams keyword arguments from the `sampling_parameters` JSON object."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(
            f"input 'sampling_parameters' is not valid JSON: {exc}", param="sampling_parameters"
        ) from exc
    if not isinstance(obj, dict):
        raise InvalidRequest(
            f"input 'sampling_parameters' must be a JSON object, got {type(obj).__name__}",
            param="sampling_parameters",
        )
    settings: dict[str, Any] = {}
    guided = vllm_guided(obj)
    if guided is not None:
        settings["structured"] = guided[1]
    for key, value in obj.items():
        if value is None or key in GUIDED_FIELDS or key == "structured_outputs":
            continue
        if key in _NEUTRAL_KEYS:
            if _convert(key, value, float) != _NEUTRAL_KEYS[key]:
                raise InvalidRequest(
                    f"sampling parameter {key!r} is not supported (only "
                    f"{_NEUTRAL_KEYS[key]!r}), got {value!r}",
                    param=key,
                )
        elif key == "stop":
            settings["stop"] = [value] if isinstance(value, str) else value
        elif key == "logit_bias":
            settings["logit_bias"] = _logit_bias(value)
        elif key == "cache_salt":
            if not isinstance(value, str):
                raise InvalidRequest(f"'cache_salt' must be a string, got {value!r}", key)
            settings["cache_salt"] = value
        elif key in ("stop_token_ids", "allowed_token_ids"):
            if not isinstance(value, list):
                raise InvalidRequest(f"{key!r} must be a list, got {value!r}", key)
            settings[key] = [_convert(key, v, int) for v in value]
        elif key == "bad_words":
            if not isinstance(value, list) or not all(isinstance(w, str) for w in value):
                raise InvalidRequest(f"'bad_words' must be a list of strings, got {value!r}", key)
            settings[key] = value
        elif key in _INT_KEYS | _FLOAT_KEYS | _BOOL_KEYS:
            settings[key] = _convert(key, value)
        else:
            raise InvalidRequest(f"unknown sampling parameter {key!r}", param=key)
    return settings


def _logit_bias(value: Any) -> dict[int, float]:
    """{"token id": bias} (keys as strings, as JSON objects have them) -> {id: bias}."""
    if not isinstance(value, dict):
        raise InvalidRequest(f"'logit_bias' must be an object, got {value!r}", "logit_bias")
    bias = {}
    for key, number in value.items():
        token_id = integer_key(key) if isinstance(key, str) else key
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise InvalidRequest(
                f"'logit_bias' keys must be token ids, got {key!r}", param="logit_bias"
            )
        bias[token_id] = _convert("logit_bias", number, float)
    return bias


def _convert(key: str, value: Any, kind: type | None = None) -> Any:
    """`value` as the type sampling parameter `key` takes (numeric strings accepted)."""
    kind = kind or (int if key in _INT_KEYS else float if key in _FLOAT_KEYS else bool)
    if kind is bool:
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if isinstance(value, bool):
            return value
        raise InvalidRequest(f"sampling parameter {key!r} must be a boolean, got {value!r}", key)
    if isinstance(value, str):
        value = _number(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"{key!r} must be a number, got {value!r}", param=key)
    if kind is int:
        if isinstance(value, float):
            if not value.is_integer():
                raise InvalidRequest(f"{key!r} must be an integer, got {value!r}", param=key)
            value = int(value)
        low, high = _INT_RANGES.get(key, _DEFAULT_INT_RANGE)
        if not low <= value <= high:
            raise InvalidRequest(f"{key!r} must be in [{low}, {high}], got {value}", param=key)
        return value
    return float(value)


def _number(text: str) -> int | float | str:
    """A numeric string as a number (int when it is one); other strings unchanged."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
