"""KServe v2 / Triton gRPC API, driven by the unchanged `tritonclient.grpc` client."""

from __future__ import annotations

import json
import queue
import time

import grpc
import numpy as np
import pytest
from google.protobuf import descriptor_pool
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tandem.proto.inference import grpc_service_pb2 as kserve_pb
from tandem.proto.tandem.v1 import generation_pb2 as gen_pb
from tandem.proto.tandem.v1 import generation_pb2_grpc
from tandem.router.errors import InvalidRequest
from tandem.router.kserve_request import parse_request
from tandem.router.tokenization import PromptTokenizer
from tests.helpers.grpc_calls import BEARER, public_channel, public_channel_sync
from tests.helpers.hf_reference import hf_greedy


def _import_tritonclient():
    """tritonclient.grpc with Triton's generated protos in a private descriptor pool.

    tritonclient registers Triton's `inference.*` messages in protobuf's default pool,
    where the router's wire-identical ones already are, and protobuf refuses duplicate
    symbols (the known clash between KServe v2 implementations in one process:
    kserve/kserve#3099, triton-inference-server/client#730). The client code runs
    unchanged; only its descriptors live elsewhere.
    """
    private_pool = descriptor_pool.DescriptorPool()
    default_pool = descriptor_pool.Default
    descriptor_pool.Default = lambda: private_pool
    try:
        import tritonclient.grpc as grpcclient
        from tritonclient.grpc import service_pb2, service_pb2_grpc
        from tritonclient.utils import InferenceServerException
    finally:
        descriptor_pool.Default = default_pool
    return grpcclient, service_pb2, service_pb2_grpc, InferenceServerException


grpcclient, triton_pb, triton_grpc, InferenceServerException = _import_tritonclient()

PROMPTS = ("the cache block decode worker", "router latency is the")
GREEDY = {"temperature": 0, "max_tokens": 12}
# Far longer than a test waits for: only cancellation ends it early. The most the tiny
# model's 1,024-token context leaves after these prompts: ~0.9 s of decoding here (500
# tokens took 0.66 s, and once finished inside test_infer_deadline's 0.5 s deadline);
# the workers get 0.3 s to become idle after a cancel (they take ~10 ms).
LONG = {"temperature": 0, "max_tokens": 1000, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_name(cluster) -> str:
    return cluster.router.config.model_name


@pytest.fixture(scope="module")
def expected(cluster) -> dict[str, str]:
    """Greedy text of each prompt from the tandem `Generate` API."""
    return {p: cluster.run(_generate_text(cluster.grpc_endpoint, p))[0] for p in PROMPTS}


def _with_api_key(request) -> None:
    """A tritonclient plugin: the router's API key on every call (Triton's own plugins,
    e.g. BasicAuth, set a header the same way)."""
    request.headers[BEARER[0]] = BEARER[1]


@pytest.fixture
def client(cluster):
    client = grpcclient.InferenceServerClient(cluster.grpc_endpoint)
    client.register_plugin(_with_api_key)
    yield client
    client.close()


async def _generate_text(endpoint: str, prompt: str) -> tuple[str, list[int]]:
    async with public_channel(endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = gen_pb.GenerateRequest(
            prompt=prompt, max_tokens=GREEDY["max_tokens"], temperature=0.0
        )
        text, token_ids = "", []
        async for msg in stub.Generate(request, timeout=60):
            text += msg.text
            token_ids += msg.token_ids
        return text, token_ids


def _reflected_services(endpoint: str) -> list[str]:
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    with public_channel_sync(endpoint) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        (reply,) = stub.ServerReflectionInfo(iter([request]), timeout=10)
    return [service.name for service in reply.list_services_response.service]


def _input(name: str, datatype: str, value, shape=(1,)):
    tensor = grpcclient.InferInput(name, list(shape), datatype)
    dtype = np.object_ if datatype == "BYTES" else None
    tensor.set_data_from_numpy(np.array([value], dtype=dtype).reshape(shape))
    return tensor


def _inputs(prompt: str, sampling: dict | None = None, stream: bool | None = None, shape=(1,)):
    inputs = [_input("text_input", "BYTES", prompt.encode(), shape)]
    if sampling is not None:
        inputs.append(_input("sampling_parameters", "BYTES", json.dumps(sampling).encode(), shape))
    if stream is not None:
        inputs.append(_input("stream", "BOOL", stream, shape))
    return inputs


def _text(result, name: str = "text_output") -> str:
    return result.as_numpy(name).reshape(-1)[0].decode()


def _is_final(result) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


class _Collector:
    """A tritonclient stream callback that queues (result, error) pairs."""

    def __init__(self) -> None:
        self.items: queue.Queue = queue.Queue()

    def __call__(self, result, error) -> None:
        self.items.put((result, error))

    def next(self, timeout_s: float = 60.0):
        return self.items.get(timeout=timeout_s)

    def until_final(self, num_requests: int = 1) -> list:
        """Results until `num_requests` requests got their final response (errors raise)."""
        results, finished = [], 0
        while finished < num_requests:
            result, error = self.next()
            if error is not None:
                raise error
            results.append(result)
            finished += _is_final(result)
        return results


@pytest.mark.timeout(60)
def test_wire_format_matches_triton_descriptors():
    def layout(d):
        fields = sorted(
            (
                f.number,
                f.name,
                f.type,
                f.is_repeated,
                f.message_type.full_name if f.message_type else None,
                f.containing_oneof.name if f.containing_oneof else None,
            )
            for f in d.fields
        )
        nested = {n.name: layout(n) for n in d.nested_types}
        return fields, nested, d.GetOptions().map_entry

    assert kserve_pb.DESCRIPTOR.package == triton_pb.DESCRIPTOR.package == "inference"
    for name, ours in kserve_pb.DESCRIPTOR.message_types_by_name.items():
        theirs = triton_pb.DESCRIPTOR.message_types_by_name[name]
        assert layout(ours) == layout(theirs), name
    ours = kserve_pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    theirs = triton_pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert ours.full_name == theirs.full_name
    for method in ours.methods:
        other = theirs.methods_by_name[method.name]
        assert (method.input_type.full_name, method.output_type.full_name) == (
            other.input_type.full_name,
            other.output_type.full_name,
        )
        assert (method.client_streaming, method.server_streaming) == (
            other.client_streaming,
            other.server_streaming,
        )


@pytest.mark.timeout(300)
def test_generate_reference_matches_transformers(cluster, tiny_model_dir, expected):
    tokenizer = PromptTokenizer(str(tiny_model_dir))
    prompt = PROMPTS[0]
    text, token_ids = cluster.run(_generate_text(cluster.grpc_endpoint, prompt))
    (hf_ids,) = hf_greedy(tiny_model_dir, [tokenizer.encode(prompt)], GREEDY["max_tokens"])
    assert token_ids == hf_ids
    assert text == expected[prompt] and text


@pytest.mark.timeout(120)
def test_health_and_metadata(cluster, client, model_name):
    client_endpoint = cluster.grpc_endpoint
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready(model_name)
    assert client.is_model_ready(model_name, "1")
    assert not client.is_model_ready("no-such-model")
    assert client.get_server_metadata().name == "tandem"
    assert "inference.GRPCInferenceService" in _reflected_services(client_endpoint)
    meta = client.get_model_metadata(model_name)
    assert meta.name == model_name and list(meta.versions) == ["1"]
    inputs = {t.name: (t.datatype, list(t.shape)) for t in meta.inputs}
    assert inputs["text_input"] == ("BYTES", [1])
    assert inputs["stream"] == ("BOOL", [1])
    assert inputs["sampling_parameters"] == ("BYTES", [1])
    outputs = {t.name: (t.datatype, list(t.shape)) for t in meta.outputs}
    assert outputs == {"text_output": ("BYTES", [-1]), "finish_reason": ("BYTES", [-1])}
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("no-such-model")
    assert info.value.status() == "StatusCode.NOT_FOUND"
    assert "no-such-model" in info.value.message()


@pytest.mark.timeout(120)
def test_infer_raw_contents_matches_generate(client, model_name, expected):
    for prompt in PROMPTS:
        result = client.infer(model_name, _inputs(prompt, GREEDY), request_id=f"id-{prompt[:3]}")
        assert _text(result) == expected[prompt]
        assert _text(result, "finish_reason") in ("stop", "length")
        response = result.get_response()
        assert response.id == f"id-{prompt[:3]}"
        assert response.model_name == model_name
        assert list(response.outputs[0].shape) == [1]
    # Triton's vLLM backend conventions: numbers as strings, the prompt prepended on request.
    prompt = PROMPTS[0]
    as_strings = {key: str(value) for key, value in GREEDY.items()}
    inputs = [*_inputs(prompt, as_strings), _input("exclude_input_in_output", "BOOL", False)]
    assert _text(client.infer(model_name, inputs)) == prompt + expected[prompt]


@pytest.mark.timeout(120)
def test_infer_batch_shape_and_scalar_inputs(client, model_name, expected):
    prompt = PROMPTS[1]
    inputs = [
        _input("text_input", "BYTES", prompt.encode(), (1, 1)),
        _input("max_tokens", "INT32", np.int32(GREEDY["max_tokens"]), (1, 1)),
        _input("temperature", "FP32", np.float32(0.0), (1, 1)),
    ]
    outputs = [grpcclient.InferRequestedOutput("text_output")]
    result = client.infer(model_name, inputs, outputs=outputs)
    assert result.as_numpy("text_output").shape == (1, 1)
    assert _text(result) == expected[prompt]
    assert result.as_numpy("finish_reason") is None  # not requested


@pytest.mark.timeout(120)
def test_an_output_requested_twice_is_refused(client, model_name):
    outputs = [grpcclient.InferRequestedOutput("text_output")] * 2
    with pytest.raises(InferenceServerException) as info:
        client.infer(model_name, _inputs("x", GREEDY), outputs=outputs)
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "'text_output' is requested twice" in info.value.message()


@pytest.mark.timeout(120)
def test_infer_typed_contents_matches_generate(cluster, model_name, expected):
    """A KServe client that sends typed `contents` instead of raw bytes."""
    prompt = PROMPTS[0]
    request = triton_pb.ModelInferRequest(model_name=model_name, id="typed")
    for name, datatype, field, value in [
        ("text_input", "BYTES", "bytes_contents", prompt.encode()),
        ("stream", "BOOL", "bool_contents", False),
        ("max_tokens", "INT32", "int_contents", GREEDY["max_tokens"]),
        ("temperature", "FP32", "fp32_contents", 0.0),
    ]:
        tensor = request.inputs.add(name=name, datatype=datatype, shape=[1])
        getattr(tensor.contents, field).append(value)
    with public_channel_sync(cluster.grpc_endpoint) as channel:
        stub = triton_grpc.GRPCInferenceServiceStub(channel)
        response = stub.ModelInfer(request, timeout=60)
        request.inputs[0].datatype = "INT32"
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request, timeout=60)
    result = grpcclient.InferResult(response)
    assert response.id == "typed"
    assert _text(result) == expected[prompt]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "text_input" in info.value.details()
    cluster.assert_idle()


@pytest.mark.timeout(120)
def test_stream_deltas_match_generate(client, model_name, expected):
    collector = _Collector()
    client.start_stream(callback=collector)
    prompt = PROMPTS[0]
    client.async_stream_infer(model_name, _inputs(prompt, GREEDY, stream=True), request_id="s1")
    results = collector.until_final()
    assert len(results) > 1, "stream=true must send one response per text delta"
    assert all(r.get_response().id == "s1" for r in results)
    assert not any(_is_final(r) for r in results[:-1])
    assert all(r.as_numpy("finish_reason") is None for r in results[:-1])
    assert _text(results[-1], "finish_reason") in ("stop", "length")
    assert "".join(_text(r) for r in results) == expected[prompt]

    # stream=false on the same stream: one response with the whole text.
    client.async_stream_infer(model_name, _inputs(prompt, GREEDY, stream=False), request_id="s2")
    (result,) = collector.until_final()
    assert result.get_response().id == "s2"
    assert _text(result) == expected[prompt]
    client.stop_stream()


@pytest.mark.timeout(120)
def test_stream_runs_requests_concurrently_and_drains_on_close(client, model_name, expected):
    collector = _Collector()
    client.start_stream(callback=collector)
    for i, prompt in enumerate(PROMPTS):
        client.async_stream_infer(
            model_name, _inputs(prompt, GREEDY, stream=True), request_id=str(i)
        )
    # Half-closing the stream (no cancel) lets the requests in flight finish first.
    client.stop_stream()
    results = collector.until_final(num_requests=len(PROMPTS))
    for i, prompt in enumerate(PROMPTS):
        mine = [r for r in results if r.get_response().id == str(i)]
        assert "".join(_text(r) for r in mine) == expected[prompt]


BAD_REQUESTS = [
    # (case, inputs builder, model override, status, words the message must contain)
    ("missing text_input", lambda: _inputs("x", GREEDY)[1:], None, "INVALID_ARGUMENT",
     ["text_input", "missing"]),
    ("wrong datatype", lambda: [_input("text_input", "INT32", np.int32(7))], None,
     "INVALID_ARGUMENT", ["text_input", "BYTES", "INT32"]),
    ("invalid JSON", lambda: [*_inputs("x"), _input("sampling_parameters", "BYTES", b"{tem")],
     None, "INVALID_ARGUMENT", ["sampling_parameters", "JSON"]),
    ("negative temperature", lambda: _inputs("x", {"temperature": -0.5}), None,
     "INVALID_ARGUMENT", ["temperature", "-0.5"]),
    ("unknown sampling key", lambda: _inputs("x", {"beam_width": 4}), None, "INVALID_ARGUMENT",
     ["beam_width"]),
    ("two prompts", lambda: [_input("text_input", "BYTES", [b"a", b"b"], (2,))], None,
     "INVALID_ARGUMENT", ["text_input", "one element"]),
    ("empty prompt", lambda: _inputs(""), None, "INVALID_ARGUMENT", ["text_input", "empty"]),
    ("too long", lambda: _inputs("x", {"max_tokens": 5000}), None, "INVALID_ARGUMENT",
     ["context length"]),
    ("unknown model", lambda: _inputs("x"), "no-such-model", "NOT_FOUND", ["no-such-model"]),
    ("stream on unary ModelInfer", lambda: _inputs("x", stream=True), None, "INVALID_ARGUMENT",
     ["stream", "ModelStreamInfer"]),
    ("stop token outside the vocabulary", lambda: _inputs("x", {"stop_token_ids": [99999999]}),
     None, "INVALID_ARGUMENT", ["stop_token_ids", "99999999", "vocabulary"]),
    ("guided_json 0", lambda: _inputs("x", {"guided_json": 0}), None, "INVALID_ARGUMENT",
     ["guided_json"]),
    ("guided_regex false-ish 0", lambda: _inputs("x", {"guided_regex": 0}), None,
     "INVALID_ARGUMENT", ["guided_regex"]),
    ("scalar prompt of shape []", lambda: _inputs("x", shape=()), None, "INVALID_ARGUMENT",
     ["text_input", "shape [1]", "[]"]),
    ("prompt of shape [1, 1, 1]", lambda: _inputs("x", shape=(1, 1, 1)), None,
     "INVALID_ARGUMENT", ["text_input", "shape [1]", "[1, 1, 1]"]),
]  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("make_inputs", "model", "status", "words"),
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
def test_infer_rejects_bad_input(client, model_name, make_inputs, model, status, words):
    with pytest.raises(InferenceServerException) as info:
        client.infer(model or model_name, make_inputs())
    assert info.value.status() == f"StatusCode.{status}"
    for word in words:
        assert word in info.value.message()


@pytest.mark.timeout(120)
def test_stream_reports_errors_per_request(client, model_name, expected):
    """A bad request gets an error response; the stream carries on with the next one."""
    collector = _Collector()
    client.start_stream(callback=collector)
    client.async_stream_infer(model_name, _inputs("x", {"temperature": -1}, stream=True))
    client.async_stream_infer("no-such-model", _inputs("x", stream=True))
    # Each request of a stream runs on its own: their answers may come in either order.
    answers = [collector.next() for _ in range(2)]
    assert [result for result, _ in answers] == [None, None]
    messages = " | ".join(error.message() for _, error in answers)
    assert "temperature" in messages and "no-such-model" in messages, messages
    prompt = PROMPTS[1]
    client.async_stream_infer(model_name, _inputs(prompt, GREEDY, stream=True))
    assert "".join(_text(r) for r in collector.until_final()) == expected[prompt]
    client.stop_stream()


@pytest.mark.timeout(120)
def test_stream_cancel_frees_workers(cluster, client, model_name):
    collector = _Collector()
    client.start_stream(callback=collector)
    prompt = PROMPTS[0]
    client.async_stream_infer(model_name, _inputs(prompt, LONG, stream=True))
    result, error = collector.next()
    assert error is None and not _is_final(result)
    client.stop_stream(cancel_requests=True)
    cluster.assert_idle(timeout_s=0.3)
    finals = []
    while not collector.items.empty():
        result, _ = collector.next()
        finals += [result is not None and _is_final(result)]
    assert not any(finals), "the generation finished before it was cancelled"


@pytest.mark.timeout(120)
def test_infer_deadline_cancels_generation(cluster, client, model_name):
    prompt = PROMPTS[1]
    started = time.monotonic()
    with pytest.raises(InferenceServerException) as info:
        client.infer(model_name, _inputs(prompt, LONG), client_timeout=0.2)
    assert info.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert time.monotonic() - started < 5
    cluster.assert_idle(timeout_s=0.3)


@pytest.mark.timeout(60)
def test_parse_request_conversions_and_conflicts(tiny_model_dir):
    tokenizer = PromptTokenizer(str(tiny_model_dir))

    def request(sampling: dict | None = None, **scalars) -> kserve_pb.ModelInferRequest:
        msg = kserve_pb.ModelInferRequest(model_name="tiny")
        tensor = msg.inputs.add(name="text_input", datatype="BYTES", shape=[1])
        tensor.contents.bytes_contents.append(b"the cache")
        if sampling is not None:
            tensor = msg.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1])
            tensor.contents.bytes_contents.append(json.dumps(sampling).encode())
        for name, value in scalars.items():
            tensor = msg.inputs.add(name=name, datatype="INT32", shape=[1])
            tensor.contents.int_contents.append(value)
        return msg

    parsed = parse_request(
        request({"temperature": "0.5", "top_k": "40", "ignore_eos": "true", "stop": "x", "n": 1}),
        tokenizer,
    )
    params = parsed.params
    assert (params.temperature, params.top_k, params.ignore_eos) == (0.5, 40, True)
    assert params.stop == ["x"] and params.max_tokens == 16
    assert not parsed.stream and parsed.exclude_input_in_output
    assert parse_request(request(max_tokens=7), tokenizer).params.max_tokens == 7
    # Near the context limit: the default output limit is capped to the room left, and
    # an explicit one that overflows is blamed (not the prompt).
    num_prompt = len(tokenizer.encode("the cache"))
    near = PromptTokenizer(str(tiny_model_dir), max_model_len=num_prompt + 3)
    assert parse_request(request(), near).params.max_tokens == 3
    with pytest.raises(InvalidRequest, match="'max_tokens': this model's maximum") as refused:
        parse_request(request(max_tokens=4), near)
    assert refused.value.param == "max_tokens"
    with pytest.raises(InvalidRequest, match="'text_input'") as refused:
        parse_request(request(), PromptTokenizer(str(tiny_model_dir), max_model_len=num_prompt))
    assert refused.value.param == "text_input"
    # vLLM's allowed_token_ids and bad_words (tokenized as on the OpenAI endpoints).
    restricted = request({"allowed_token_ids": [5, "9"], "bad_words": ["cache hit", "x"]})
    params = parse_request(restricted, tokenizer).params
    assert params.allowed_token_ids == [5, 9]
    assert params.bad_words_token_ids == tokenizer.bad_words_token_ids(["cache hit", "x"])
    for bad, word in [
        (request({"allowed_token_ids": [2048]}), "vocabulary"),
        (request({"allowed_token_ids": 5}), "list"),
        (request({"bad_words": "x"}), "list of strings"),
        (request({"bad_words": [" "]}), "bad_words"),
        (request({"bad_words": ["x"], "guided_regex": "[a-z]+"}), "'bad_words' cannot"),
        (request({"allowed_token_ids": [5], "guided_regex": "[a-z]+"}), "'allowed_token_ids' c"),
        (request({"n": 2}), "'n'"),
        (request({"seed": -1}), "seed"),
        (request({"top_k": "many"}), "top_k"),
        (request({"ignore_eos": "yes"}), "ignore_eos"),
        (request({"max_tokens": 8}, max_tokens=7), "both"),
        (request(["temperature"]), "JSON object"),
    ]:
        with pytest.raises(InvalidRequest, match=word):
            parse_request(bad, tokenizer)
    mixed = request()
    mixed.raw_input_contents.append(b"\x01\x00\x00\x00a")
    with pytest.raises(InvalidRequest, match="contents"):
        parse_request(mixed, tokenizer)
    mixed.inputs[0].contents.Clear()
    assert parse_request(mixed, tokenizer).prompt == "a"
    mixed.raw_input_contents.append(b"")
    with pytest.raises(InvalidRequest, match="raw_input_contents has 2 entries"):
        parse_request(mixed, tokenizer)
