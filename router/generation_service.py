"""Public gRPC `tandem.v1.Generation`: validate, tokenize, stream through the cluster."""

from __future__ import annotations

import logging
import uuid

import grpc

from tandem.engine.outputs import PromptLogprobs
from tandem.engine.request import FinishReason
from tandem.engine.sampler import TopLogprobs
from tandem.engine.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from tandem.proto.tandem.v1 import generation_pb2 as gen_pb
from tandem.proto.tandem.v1 import generation_pb2_grpc
from tandem.router.errors import (
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    RouterError,
    abort_with,
)
from tandem.router.grpc_streams import (
    ClientStalled,
    end_stalled,
    end_stream_with,
    write_message,
)
from tandem.router.openai.sampling_fields import DEFAULT_MAX_N
from tandem.router.request_flow import RequestFlow
from tandem.router.sampling_defaults import OPENAI_DEFAULTS, SamplingDefaults
from tandem.router.sequence import sequence_id
from tandem.router.structured_outputs import field_ruling_out_grammar_tokens, guided_from_generate
from tandem.router.tokenization import PromptTokenizer
from tandem.worker.convert import set_stop_reason

logger = logging.getLogger(__name__)

_FINISH = {
    None: gen_pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: gen_pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: gen_pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: gen_pb.FINISH_REASON_ABORT,
}


# Longest client request_id (it is echoed, and names the request in logs and traces).
MAX_REQUEST_ID_CHARS = 256


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(
        self,
        flow: RequestFlow,
        tokenizer: PromptTokenizer,
        model_name: str,
        max_n: int = DEFAULT_MAX_N,
        defaults: SamplingDefaults = OPENAI_DEFAULTS,
    ) -> None:
        self.flow = flow
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_n = max_n
        # Sampling values of requests that leave them out (the model's, or OpenAI's).
        self.defaults = defaults
        # Router ids of the requests (and their sequences) in flight here.
        self._in_flight: set[str] = set()

    async def Generate(self, request: gen_pb.GenerateRequest, context) -> None:
        try:
            prompt_ids, params = await self.tokenizer.off_loop(self._validate, request)
            slo = self.flow.slo.resolve(
                request.slo_class or None,
                ttft_s=request.ttft_slo_s if request.HasField("ttft_slo_s") else None,
                itl_s=request.itl_slo_s if request.HasField("itl_slo_s") else None,
            )
        except RouterError as exc:
            await abort_with(context, exc)
        num_sequences = request.n or 1
        held = self._claim_ids(request.request_id, num_sequences)
        req_id = held[0]
        echoed_id = request.request_id or req_id
        stream = self.flow.generate(req_id, prompt_ids, params, slo, n=num_sequences)
        # Client cancel or deadline: the RPC ends while we may be parked at a yield.
        context.add_done_callback(lambda _: stream.cancel())
        try:
            async for chunk in stream:
                msg = gen_pb.GenerateResponse(
                    request_id=echoed_id,
                    token_ids=chunk.token_ids,
                    text=chunk.text,
                    logprobs=chunk.logprobs,
                    top_logprobs=[_top_logprobs(top) for top in chunk.top_logprobs],
                    finish_reason=_FINISH[chunk.finish_reason],
                    index=chunk.index,
                )
                set_stop_reason(msg, chunk.stop_reason)
                if chunk.prompt_logprobs is not None:
                    msg.prompt_logprobs.CopyFrom(_prompt_logprobs(chunk.prompt_logprobs))
                if chunk.usage is not None:
                    msg.usage.CopyFrom(
                        gen_pb.Usage(
                            prompt_tokens=chunk.usage.prompt_tokens,
                            completion_tokens=chunk.usage.completion_tokens,
                            cached_prompt_tokens=chunk.usage.cached_prompt_tokens,
                        )
                    )
                await write_message(context, msg)
        except ClientStalled as exc:
            logger.info("request %s: %s, its stream is ended", req_id, exc)
            end_stalled(context, exc)
        except Overloaded as exc:
            logger.info("request %s shed: %s", req_id, exc)
            end_stream_with(context, exc)
        except RouterError as exc:
            logger.warning("request %s failed: %s", req_id, exc)
            end_stream_with(context, exc)
        finally:
            await stream.aclose()
            self._in_flight.difference_update(held)

    def _claim_ids(self, client_id: str, num_sequences: int) -> list[str]:
        """The router's id for a request, and its sequences' (`sequence_id`), held until
        it ends. The client's `request_id` is a label echoed back: it is the router's id
        too (so logs and traces show it) unless that, or one of its sequences' ids, names
        a request in flight here (two clients, or a retry, may send one id at once; "z#1"
        is sequence 1 of "z"); then the router's adds a random part."""
        base = client_id or uuid.uuid4().hex
        while True:
            held = [sequence_id(base, i) for i in range(num_sequences)]
            if self._in_flight.isdisjoint(held):
                self._in_flight.update(held)
                return held
            base = f"{client_id}-{uuid.uuid4().hex[:12]}"

    async def Tokenize(self, request: gen_pb.TokenizeRequest, context) -> gen_pb.TokenizeResponse:
        try:
            self._check_model(request.model)
            ids = await self.tokenizer.off_loop(self.tokenizer.encode, request.prompt)
        except RouterError as exc:
            await abort_with(context, exc)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return gen_pb.TokenizeResponse(token_ids=ids, max_model_len=self.tokenizer.max_model_len)

    async def ListModels(
        self, request: gen_pb.ListModelsRequest, context
    ) -> gen_pb.ListModelsResponse:
        card = gen_pb.ModelCard(
            id=self.model_name,
            root=self.tokenizer.model_dir,
            max_model_len=self.tokenizer.max_model_len,
            vocab_size=self.tokenizer.vocab_size,
        )
        return gen_pb.ListModelsResponse(models=[card])

    def _check_model(self, model: str) -> None:
        if model and model != self.model_name:
            raise ModelNotFound(
                f"model {model!r} does not exist; this server serves {self.model_name!r}", "model"
            )

    def _validate(self, request: gen_pb.GenerateRequest) -> tuple[list[int], SamplingParams]:
        """Prompt ids and sampling params, or InvalidRequest naming the bad field."""
        self._check_model(request.model)
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequest(
                f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters, "
                f"got {len(request.request_id)}",
                "request_id",
            )
        if request.n > self.max_n:
            raise InvalidRequest(f"n must be <= {self.max_n}, got {request.n}", "n")
        try:
            return self._parse(request)
        except RouterError:
            raise
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc

    def _parse(self, request: gen_pb.GenerateRequest) -> tuple[list[int], SamplingParams]:
        defaults = self.defaults
        if request.prompt_token_ids:
            prompt_ids = self.tokenizer.check_ids(list(request.prompt_token_ids))
        elif request.prompt:
            prompt_ids = self.tokenizer.encode(request.prompt)
        else:  # proto3: an empty prompt is no prompt
            raise InvalidRequest("prompt or prompt_token_ids is required", "prompt")
        num_prompt_top = request.prompt_logprobs if request.HasField("prompt_logprobs") else None
        if num_prompt_top is not None and num_prompt_top > MAX_TOP_LOGPROBS:
            raise InvalidRequest(
                f"prompt_logprobs must be <= {MAX_TOP_LOGPROBS}, got {num_prompt_top}",
                "prompt_logprobs",
            )
        params = SamplingParams(
            max_tokens=request.max_tokens or self.tokenizer.default_max_tokens(len(prompt_ids)),
            temperature=(
                request.temperature if request.HasField("temperature") else defaults.temperature
            ),
            # 0 is "unset" in proto3 (-1 turns top_k off).
            top_k=request.top_k or defaults.top_k,
            top_p=request.top_p if request.HasField("top_p") else defaults.top_p,
            min_p=request.min_p or defaults.min_p,
            seed=request.seed if request.HasField("seed") else None,
            stop=list(request.stop),
            include_stop_str_in_output=request.include_stop_str_in_output,
            stop_token_ids=list(request.stop_token_ids),
            ignore_eos=request.ignore_eos,
            logprobs=request.logprobs,
            top_logprobs=request.top_logprobs,
            min_tokens=request.min_tokens,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty
            if request.HasField("repetition_penalty")
            else defaults.repetition_penalty,
            logit_bias=dict(request.logit_bias),
            allowed_token_ids=list(request.allowed_token_ids),
            bad_words_token_ids=self._bad_words(request),
            prompt_logprobs=num_prompt_top is not None,
            prompt_top_logprobs=num_prompt_top or 0,
            structured=guided_from_generate(request.guided),
            cache_salt=request.cache_salt if request.HasField("cache_salt") else None,
        )
        for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
            try:
                self.tokenizer.check_vocabulary(name, getattr(request, name))
            except ValueError as exc:
                raise InvalidRequest(str(exc), name) from exc
        if (conflict := field_ruling_out_grammar_tokens(params)) is not None:
            raise InvalidRequest(f"{conflict} cannot be combined with `guided`", conflict)
        self.tokenizer.check_length(len(prompt_ids), params.max_tokens)
        return prompt_ids, params

    def _bad_words(self, request: gen_pb.GenerateRequest) -> list[list[int]]:
        try:
            return self.tokenizer.bad_words_token_ids(list(request.bad_words))
        except ValueError as exc:
            raise InvalidRequest(f"bad_words {exc}", "bad_words") from exc


def _top_logprobs(top: TopLogprobs) -> gen_pb.TopLogprobs:
    return gen_pb.TopLogprobs(token_ids=top.token_ids, logprobs=top.logprobs)


def _prompt_logprobs(scores: PromptLogprobs) -> gen_pb.PromptLogprobs:
    return gen_pb.PromptLogprobs(
        logprobs=scores.logprobs,
        ranks=scores.ranks,
        top_logprobs=[_top_logprobs(top) for top in scores.top],
    )
