"""Sampling defaults from the model's generation_config.json (vLLM's
`--generation-config auto`): read and checked, applied on every API to the fields a
request leaves out, and through a served cluster."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from tandem.proto.inference import grpc_service_pb2 as kserve_pb
from tandem.proto.tandem.v1 import generation_pb2 as gen_pb
from tandem.proto.tandem.v1 import generation_pb2_grpc
from tandem.router.config import RouterConfig
from tandem.router.generation_service import GenerationService
from tandem.router.kserve_request import parse_request
from tandem.router.openai.protocol import RequestParser
from tandem.router.policy_runtime import slo_config
from tandem.router.sampling_defaults import GenerationConfigUse, SamplingDefaults
from tandem.router.tokenization import PromptTokenizer
from tests.helpers.grpc_calls import public_channel
from tests.helpers.hf_reference import hf_greedy
from tests.helpers.inproc_cluster import InprocCluster, openai_client, shared_router_config
from tests.helpers.prompts import make_prompts

pytestmark = pytest.mark.timeout(300)

# Qwen2.5-Instruct's file, as shipped.
QWEN = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
        "repetition_penalty": 1.05, "eos_token_id": [151645, 151643]}  # fmt: skip


def model_with(tiny_model_dir: Path, tmp_path: Path, generation: dict) -> Path:
    """A copy of the tiny model whose generation_config.json adds `generation`."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    path = model / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **generation}))
    return model


def test_the_file_sets_what_it_names(tiny_model_dir, tmp_path):
    model = model_with(tiny_model_dir, tmp_path, QWEN)
    defaults = SamplingDefaults.of_model(model, GenerationConfigUse.AUTO)
    assert defaults == SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20,
                                        repetition_penalty=1.05)  # fmt: skip
    assert defaults.from_model() == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                     "repetition_penalty": 1.05}  # fmt: skip
    assert SamplingDefaults.of_model(model, GenerationConfigUse.OFF) == SamplingDefaults()
    # The tiny model's own file names no sampling.
    assert SamplingDefaults.of_model(tiny_model_dir, GenerationConfigUse.AUTO) == SamplingDefaults()


@pytest.mark.parametrize(
    ("generation", "field"),
    [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": 2.5}, "top_k"),
     ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": "high"}, "min_p"),
     ({"temperature": True}, "temperature"), ({"temperature": float("inf")}, "temperature"),
     ({"top_k": -2}, "top_k"), ({"temperature": 10**400}, "temperature")],
)  # fmt: skip
def test_a_value_no_request_could_give_is_refused_naming_the_file(
    tiny_model_dir, tmp_path, generation, field
):
    model = model_with(tiny_model_dir, tmp_path, generation)
    with pytest.raises(
        ValueError, match=f"generation_config.json: {field} = .*--generation-config off"
    ):
        SamplingDefaults.of_model(model, GenerationConfigUse.AUTO)
    assert SamplingDefaults.of_model(model, GenerationConfigUse.OFF) == SamplingDefaults()


def test_every_api_applies_the_defaults_to_what_a_request_leaves_out(tiny_model_dir):
    tokenizer = PromptTokenizer(str(tiny_model_dir))
    defaults = SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20, min_p=0.05,
                                repetition_penalty=1.1)  # fmt: skip
    wanted = (0.6, 0.9, 20, 0.05, 1.1)

    def values(params) -> tuple:
        return (params.temperature, params.top_p, params.top_k, params.min_p,
                params.repetition_penalty)  # fmt: skip

    slo = slo_config(RouterConfig(model_dir=str(tiny_model_dir)))
    parser = RequestParser(tokenizer, "tiny", slo, defaults=defaults)
    [left_out] = parser.completion({"prompt": "hi"})
    assert values(left_out.params) == wanted
    chat = parser.chat({"messages": [{"role": "user", "content": "hi"}]})
    assert values(chat.params) == wanted
    given = {"temperature": 0, "top_p": 1, "top_k": 0, "min_p": 0, "repetition_penalty": 1}
    [explicit] = parser.completion({"prompt": "hi", **given})
    assert values(explicit.params) == (0.0, 1.0, 0, 0.0, 1.0)

    service = GenerationService(None, tokenizer, "tiny", defaults=defaults)  # type: ignore[arg-type]
    _, params = service._parse(gen_pb.GenerateRequest(prompt="hi"))
    assert values(params) == wanted
    _, params = service._parse(gen_pb.GenerateRequest(prompt="hi", temperature=0, top_k=-1))
    assert (params.temperature, params.top_k) == (0.0, -1)

    request = kserve_pb.ModelInferRequest(model_name="tiny")
    tensor = request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    tensor.contents.bytes_contents.append(b"hi")
    assert values(parse_request(request, tokenizer, defaults).params) == wanted


def test_a_served_model_whose_file_asks_for_greedy_is_greedy(tiny_model_dir, tmp_path):
    """Through the cluster, on tandem.v1 and OpenAI: requests that name no temperature
    get the file's 0 (greedy), so their tokens equal transformers' greedy ones."""
    model = model_with(tiny_model_dir, tmp_path, {"temperature": 0.0})
    router = replace(shared_router_config(str(model)), max_local_prefill_tokens=0)
    cluster = InprocCluster(str(model), router_config=router).start()
    prompts = make_prompts(2048, (9, 33), seed=3)

    async def generate() -> list[list[int]]:
        got = []
        async with public_channel(cluster.grpc_endpoint) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            for prompt in prompts:
                request = gen_pb.GenerateRequest(prompt_token_ids=prompt, max_tokens=12)
                got.append(
                    [t async for m in stub.Generate(request, timeout=60) for t in m.token_ids]
                )
        return got

    try:
        assert cluster.router.sampling_defaults.from_model() == {"temperature": 0.0}
        expected = hf_greedy(str(model), prompts, 12)
        assert cluster.run(generate()) == expected
        for client in openai_client(cluster.http_endpoint):
            answer = client.completions.create(
                model=router.model_name, prompt=prompts, max_tokens=12,
                extra_body={"return_token_ids": True},
            ).model_dump()  # fmt: skip
            assert [c["token_ids"] for c in answer["choices"]] == expected
        cluster.assert_idle()
    finally:
        cluster.stop()
