"""Public gRPC surface: health, reflection-driven Generate, Tokenize, ListModels, bad input."""

from __future__ import annotations

import math

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from tandem.proto.tandem.v1 import generation_pb2 as gen_pb
from tandem.proto.tandem.v1 import generation_pb2_grpc
from tests.helpers.hf_reference import LOGPROB_TOLERANCE, hf_greedy, hf_top_logprobs
from tests.helpers.prompts import make_prompts

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def channel(cluster):
    with grpc.insecure_channel(cluster.grpc_endpoint) as channel:
        yield channel


def test_health_check_is_serving(channel):
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_generate_through_reflection_discovered_descriptors(channel, tiny_model_dir):
    database = ProtoReflectionDescriptorDatabase(channel)
    assert "tandem.v1.Generation" in database.get_services()
    pool = descriptor_pool.DescriptorPool(database)
    method = pool.FindServiceByName("tandem.v1.Generation").FindMethodByName("Generate")
    request_cls = message_factory.GetMessageClass(method.input_type)
    response_cls = message_factory.GetMessageClass(method.output_type)
    call = channel.unary_stream(
        "/tandem.v1.Generation/Generate",
        request_serializer=request_cls.SerializeToString,
        response_deserializer=response_cls.FromString,
    )
    prompt = make_prompts(2048, (30,), seed=61)[0]
    request = request_cls(prompt_token_ids=prompt, max_tokens=6, temperature=0.0)
    tokens = [t for reply in call(request, timeout=60) for t in reply.token_ids]
    assert tokens == hf_greedy(tiny_model_dir, [prompt], 6)[0]


def test_top_logprobs_equal_transformers(channel, tiny_model_dir):
    """The first token's alternatives come from the prefill worker, the rest from the
    decode worker: both equal transformers' log-softmax."""
    prompt = make_prompts(2048, (40,), seed=63)[0]
    request = gen_pb.GenerateRequest(
        prompt_token_ids=prompt, max_tokens=6, temperature=0.0, ignore_eos=True,
        logprobs=True, top_logprobs=4,
    )  # fmt: skip
    replies = list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60))
    tokens = [t for reply in replies for t in reply.token_ids]
    tops = [top for reply in replies for top in reply.top_logprobs]
    expected = hf_top_logprobs(tiny_model_dir, prompt, tokens, 4)
    assert [list(top.token_ids) for top in tops] == [ids for ids, _ in expected]
    for top, (_, logprobs) in zip(tops, expected, strict=True):
        assert list(top.logprobs) == pytest.approx(logprobs, **LOGPROB_TOLERANCE)
    assert [top.logprobs[0] for top in tops] == [lp for r in replies for lp in r.logprobs]


def test_tokenize_and_list_models(channel, cluster):
    stub = generation_pb2_grpc.GenerationStub(channel)
    reply = stub.Tokenize(gen_pb.TokenizeRequest(prompt="hello world"), timeout=5)
    assert reply.token_ids[0] == 1 and len(reply.token_ids) > 1
    assert reply.max_model_len == 1024
    models = stub.ListModels(gen_pb.ListModelsRequest(), timeout=5).models
    assert [m.id for m in models] == [cluster.router.config.model_name]
    assert models[0].vocab_size == 2048


BAD_REQUESTS = [
    (dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (dict(prompt_token_ids=[1] * 2048), grpc.StatusCode.INVALID_ARGUMENT, "context length"),
    (dict(prompt="hi", max_tokens=5000), grpc.StatusCode.INVALID_ARGUMENT, "context length"),
    (dict(prompt="hi", temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (dict(prompt="hi", temperature=math.nan), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (dict(prompt="hi", top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (dict(prompt="hi", top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (dict(prompt="hi", top_k=-2), grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
    (dict(prompt="hi", model="gpt-9"), grpc.StatusCode.NOT_FOUND, "gpt-9"),
    (dict(prompt_token_ids=[1, 99999]), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
    (dict(prompt="hi", stop=["x"] * 17), grpc.StatusCode.INVALID_ARGUMENT, "stop"),
    (dict(prompt="hi", stop=[""]), grpc.StatusCode.INVALID_ARGUMENT, "stop"),
    (dict(prompt="hi", slo_class="gold"), grpc.StatusCode.INVALID_ARGUMENT, "slo_class"),
    (dict(prompt="hi", ttft_slo_s=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "ttft"),
    (dict(prompt="hi", top_logprobs=2), grpc.StatusCode.INVALID_ARGUMENT, "top_logprobs"),
    (dict(prompt="hi", min_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "min_p"),
    (
        dict(prompt="hi", logprobs=True, top_logprobs=21),
        grpc.StatusCode.INVALID_ARGUMENT,
        "top_logprobs",
    ),
]


@pytest.mark.parametrize(("fields", "code", "needle"), BAD_REQUESTS)
def test_bad_generate_requests_get_clear_errors(channel, tiny_model_dir, fields, code, needle):
    stub = generation_pb2_grpc.GenerationStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(gen_pb.GenerateRequest(**fields), timeout=30))
    assert info.value.code() == code
    assert needle in info.value.details(), info.value.details()
    # The cluster still serves a normal request correctly afterwards.
    prompt = make_prompts(2048, (12,), seed=62)[0]
    request = gen_pb.GenerateRequest(prompt_token_ids=prompt, max_tokens=4, temperature=0.0)
    tokens = [t for reply in stub.Generate(request, timeout=60) for t in reply.token_ids]
    assert tokens == hf_greedy(tiny_model_dir, [prompt], 4)[0]
