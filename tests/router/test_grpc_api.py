"""Public gRPC surface: health, reflection-driven Generate, Tokenize, ListModels, bad input."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
import torch
from google.protobuf import descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from tandem.proto.inference import grpc_service_pb2 as kserve_pb
from tandem.proto.inference import grpc_service_pb2_grpc as kserve_grpc
from tandem.proto.tandem.admin.v1 import admin_pb2 as admin_pb
from tandem.proto.tandem.v1 import generation_pb2 as gen_pb
from tandem.proto.tandem.v1 import generation_pb2_grpc
from tandem.router.tokenization import PromptTokenizer
from tests.helpers.grpc_calls import public_channel, public_channel_sync
from tests.helpers.hf_reference import (
    LOGPROB_TOLERANCE,
    hf_greedy,
    hf_greedy_with,
    hf_prompt_scores,
    hf_top_logprobs,
)
from tests.helpers.inproc_cluster import SHARED_MAX_BODY_BYTES
from tests.helpers.prompts import make_prompts

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def channel(cluster):
    with public_channel_sync(cluster.grpc_endpoint) as channel:
        yield channel


def test_health_check_is_serving(channel):
    health = health_pb2_grpc.HealthStub(channel)
    reply = health.Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    # Each public service, ready (its workers answer): as /health.
    for service in ("tandem.v1.Generation", "inference.GRPCInferenceService"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, service


def test_every_service_but_health_and_reflection_needs_the_api_key(cluster):
    """The shared router has an API key: without it (or with a wrong one) every call of
    Generation, KServe and Admin is UNAUTHENTICATED before its request is read; probes
    (gRPC health, KServe live/ready) and reflection answer anyone."""
    generate = gen_pb.GenerateRequest(prompt="hi", max_tokens=2)
    calls = {
        "Generation/Generate": ("unary_stream", "/tandem.v1.Generation/Generate", generate),
        "Generation/Tokenize": (
            "unary_unary", "/tandem.v1.Generation/Tokenize", gen_pb.TokenizeRequest(prompt="hi")
        ),
        "Generation/ListModels": (
            "unary_unary", "/tandem.v1.Generation/ListModels", gen_pb.ListModelsRequest()
        ),
        "KServe/ModelInfer": (
            "unary_unary", "/inference.GRPCInferenceService/ModelInfer",
            kserve_pb.ModelInferRequest(model_name="x"),
        ),
        "KServe/ModelMetadata": (
            "unary_unary", "/inference.GRPCInferenceService/ModelMetadata",
            kserve_pb.ModelMetadataRequest(name="x"),
        ),
        "KServe/ModelStreamInfer": (
            "stream_stream", "/inference.GRPCInferenceService/ModelStreamInfer",
            kserve_pb.ModelInferRequest(model_name="x"),
        ),
        "Admin/GetPools": ("unary_unary", "/tandem.admin.v1.Admin/GetPools",
                           admin_pb.GetPoolsRequest()),
    }  # fmt: skip
    for metadata in ((), (("authorization", "Bearer sk-wrong"),), (("authorization", "x"),)):
        with grpc.insecure_channel(cluster.grpc_endpoint) as channel:
            for name, (kind, method, request) in calls.items():
                call = getattr(channel, kind)(
                    method, request_serializer=type(request).SerializeToString
                )
                with pytest.raises(grpc.RpcError) as info:
                    reply = call(iter([request]) if kind.startswith("stream") else request,
                                 timeout=10, metadata=metadata)  # fmt: skip
                    if kind.endswith("stream"):
                        list(reply)
                assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED, (name, metadata)
    with grpc.insecure_channel(cluster.grpc_endpoint) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        kserve = kserve_grpc.GRPCInferenceServiceStub(channel)
        assert kserve.ServerLive(kserve_pb.ServerLiveRequest(), timeout=5).live
        assert kserve.ServerReady(kserve_pb.ServerReadyRequest(), timeout=5).ready
        assert not kserve.ModelReady(kserve_pb.ModelReadyRequest(name="x"), timeout=5).ready
        assert "tandem.v1.Generation" in ProtoReflectionDescriptorDatabase(channel).get_services()


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


def test_prompt_logprobs_come_on_sequence_0s_first_message(channel, tiny_model_dir):
    """vLLM's prompt_logprobs on Generate (n = 2): each prompt token's logprob and rank
    and the 3 most likely tokens at its position, as transformers scores them, once."""
    prompt = make_prompts(2048, (17,), seed=64)[0]
    request = gen_pb.GenerateRequest(
        prompt_token_ids=prompt, max_tokens=3, temperature=0.0, ignore_eos=True, n=2,
        prompt_logprobs=3,
    )  # fmt: skip
    replies = list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60))
    scored = [r for r in replies if r.HasField("prompt_logprobs")]
    first_of_0 = next(r for r in replies if r.index == 0)
    assert scored == [first_of_0]
    scores = first_of_0.prompt_logprobs
    expected = hf_prompt_scores(tiny_model_dir, prompt, 3)[1:]
    assert len(scores.logprobs) == len(scores.ranks) == len(expected) == len(prompt) - 1
    for i, (token_id, want) in enumerate(zip(prompt[1:], expected, strict=True)):
        logprob, rank = want[str(token_id)]
        assert scores.ranks[i] == rank
        assert scores.logprobs[i] == pytest.approx(logprob, **LOGPROB_TOLERANCE)
        top = sorted((r, int(t), lp) for t, (lp, r) in want.items() if r <= 3)
        assert list(scores.top_logprobs[i].token_ids) == [t for _, t, _ in top]
        assert list(scores.top_logprobs[i].logprobs) == pytest.approx(
            [lp for _, _, lp in top], **LOGPROB_TOLERANCE
        )


def test_allowed_token_ids_and_bad_words_restrict_greedy_as_transformers(channel, tiny_model_dir):
    """vLLM's allowed_token_ids and bad_words on Generate: greedy equals transformers'
    greedy with the same tokens masked at each step (bad words as the router tokenizes
    them: a sequence's last token only after the rest of it), and differs from the free
    run."""
    prompt = make_prompts(2048, (21,), seed=65)[0]
    stub = generation_pb2_grpc.GenerationStub(channel)

    def greedy(**fields) -> list[int]:
        request = gen_pb.GenerateRequest(
            prompt_token_ids=prompt, max_tokens=6, temperature=0.0, ignore_eos=True, **fields
        )
        return [t for reply in stub.Generate(request, timeout=60) for t in reply.token_ids]

    free = greedy()
    assert free == hf_greedy(tiny_model_dir, [prompt], 6)[0]
    allowed = [t for t in range(5, 60) if t not in free][:6]

    def keep_allowed(_: list[int], row: torch.Tensor) -> None:
        outside = torch.ones_like(row, dtype=torch.bool)
        outside[allowed] = False
        row[outside] = float("-inf")

    expected = hf_greedy_with(tiny_model_dir, prompt, 6, keep_allowed)
    assert greedy(allowed_token_ids=allowed) == expected and expected != free

    tokenizer = PromptTokenizer(str(tiny_model_dir))
    words = [tokenizer.decode(free[:2]), tokenizer.decode(free[3:4])]
    sequences = tokenizer.bad_words_token_ids(words)

    def ban_words(generated: list[int], row: torch.Tensor) -> None:
        for *before, last in sequences:
            if not before or generated[len(generated) - len(before) :] == before:
                row[last] = float("-inf")

    expected = hf_greedy_with(tiny_model_dir, prompt, 6, ban_words)
    assert greedy(bad_words=words) == expected and expected != free


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
    (dict(prompt="hi", stop=["x" * 1001]), grpc.StatusCode.INVALID_ARGUMENT, "1000 characters"),
    (dict(prompt="hi", slo_class="gold"), grpc.StatusCode.INVALID_ARGUMENT, "slo_class"),
    (dict(prompt="hi", request_id="r" * 257), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
    (dict(prompt="hi", ttft_slo_s=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "ttft"),
    (dict(prompt="hi", top_logprobs=2), grpc.StatusCode.INVALID_ARGUMENT, "top_logprobs"),
    (dict(prompt="hi", min_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "min_p"),
    (
        dict(prompt="hi", logprobs=True, top_logprobs=21),
        grpc.StatusCode.INVALID_ARGUMENT,
        "top_logprobs",
    ),
    (dict(prompt="hi", prompt_logprobs=21), grpc.StatusCode.INVALID_ARGUMENT, "prompt_logprobs"),
    (dict(prompt="hi", allowed_token_ids=[3, 2048]), grpc.StatusCode.INVALID_ARGUMENT, "2048"),
    (dict(prompt="hi", stop_token_ids=[2, 99999]), grpc.StatusCode.INVALID_ARGUMENT, "99999"),
    (dict(prompt="hi", bad_words=[" "]), grpc.StatusCode.INVALID_ARGUMENT, "bad_words"),
    (dict(prompt="hi", bad_words=["x"] * 129), grpc.StatusCode.INVALID_ARGUMENT, "bad_words"),
    (
        dict(prompt="hi", bad_words=["x"], guided=gen_pb.GuidedDecoding(regex="[a-z]+")),
        grpc.StatusCode.INVALID_ARGUMENT,
        "bad_words",
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


def test_clients_may_send_the_same_request_id_at_once(cluster, tiny_model_dir):
    """A request_id is the client's label, echoed back: two requests with one id at the
    same time, or one that names another's n-th sequence ("z#1" beside "z" with n = 2),
    each run whole (the router's own id for the second adds a random part)."""
    prompt = make_prompts(2048, (20,), seed=63)[0]
    want = hf_greedy(tiny_model_dir, [prompt], 24)[0]

    async def one(stub, request_id: str, n: int = 1) -> tuple[set[str], list[list[int]]]:
        request = gen_pb.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            max_tokens=24,
            temperature=0.0,
            ignore_eos=True,
            n=n,
        )
        echoed, tokens = set(), [[] for _ in range(n)]
        async for reply in stub.Generate(request, timeout=60):
            echoed.add(reply.request_id)
            tokens[reply.index] += reply.token_ids
        return echoed, tokens

    async def scenario() -> list:
        async with public_channel(cluster.grpc_endpoint) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            return await asyncio.gather(
                one(stub, "dup"), one(stub, "dup"), one(stub, "z", n=2), one(stub, "z#1")
            )

    results = cluster.run(scenario())
    assert [echoed for echoed, _ in results] == [{"dup"}, {"dup"}, {"z"}, {"z#1"}]
    assert [tokens for _, tokens in results] == [[want], [want], [want, want], [want]]


def test_a_message_over_the_body_limit_is_refused_as_http_does(channel):
    """The public gRPC port takes messages up to the HTTP body limit (the shared
    router's: 256 KiB), so a prompt costs the tokenizer no more on one API than another."""
    stub = generation_pb2_grpc.GenerationStub(channel)
    assert stub.Tokenize(gen_pb.TokenizeRequest(prompt="a " * 100_000), timeout=30).token_ids
    with pytest.raises(grpc.RpcError) as info:
        stub.Tokenize(
            gen_pb.TokenizeRequest(prompt="a " * (SHARED_MAX_BODY_BYTES // 2)), timeout=30
        )
    assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_request_that_does_not_parse_is_invalid_argument_and_logs_no_traceback(channel, caplog):
    """Corrupt wire format, or a string field that is not UTF-8, on unary and streaming
    methods: INVALID_ARGUMENT naming the problem (it was UNKNOWN, with a traceback logged
    at ERROR for every such call); the server goes on serving."""
    corrupt = b"\xff\xff\xff"
    prompt_not_utf8 = b"\x12\x02\xff\xfe"  # GenerateRequest.prompt (field 2) = ff fe
    calls = [
        ("unary_stream", "/tandem.v1.Generation/Generate", prompt_not_utf8),
        ("unary_stream", "/tandem.v1.Generation/Generate", corrupt),
        ("unary_unary", "/tandem.v1.Generation/Tokenize", corrupt),
        ("unary_unary", "/inference.GRPCInferenceService/ModelInfer", corrupt),
        ("stream_stream", "/inference.GRPCInferenceService/ModelStreamInfer", corrupt),
    ]
    caplog.set_level("DEBUG")
    for kind, method, raw in calls:
        call = getattr(channel, kind)(method)
        with pytest.raises(grpc.RpcError) as info:
            if kind == "unary_unary":
                call(raw, timeout=10)
            else:
                list(call(iter([raw]) if kind == "stream_stream" else raw, timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, info.value)
        assert "malformed request" in info.value.details(), info.value.details()
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    stub = generation_pb2_grpc.GenerationStub(channel)
    replies = list(stub.Generate(gen_pb.GenerateRequest(prompt="hi", max_tokens=2), timeout=60))
    assert replies[-1].finish_reason
