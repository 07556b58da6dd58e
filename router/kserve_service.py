"""KServe v2 / Triton gRPC API (`inference.GRPCInferenceService`) over the request flow.

One model, named `RouterConfig.model_name`, version "1", with the signature in
`router.kserve_request`. `ModelInfer` answers with the whole text. `ModelStreamInfer`
follows Triton's decoupled-model conventions, which tritonclient relies on: many
requests may share one stream and run concurrently; each gets one response per text
delta (`stream` true) or one with the whole text; every response echoes the request
`id` and carries `triton_final_response` (true on the request's last one, which also
holds `finish_reason`); a failed request gets a response with `error_message` and the
stream goes on. When the client half-closes, the stream ends after its requests finish;
when it cancels (or its deadline passes), every generation on the stream is cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from importlib import metadata

from tandem.proto.inference import grpc_service_pb2 as kserve_pb
from tandem.proto.inference import grpc_service_pb2_grpc
from tandem.router.errors import InvalidRequest, ModelNotFound, RouterError, abort_with
from tandem.router.generation_chunk import Usage, public_finish_reason
from tandem.router.grpc_streams import ClientStalled, end_stalled, write_message
from tandem.router.kserve_request import MODEL_INPUTS, MODEL_OUTPUTS, KserveRequest, parse_request
from tandem.router.kserve_tensors import encode_bytes
from tandem.router.policy_runtime import PolicyRuntime
from tandem.router.request_flow import RequestFlow
from tandem.router.sampling_defaults import OPENAI_DEFAULTS, SamplingDefaults
from tandem.router.tokenization import PromptTokenizer

logger = logging.getLogger(__name__)

SERVICE_NAME = kserve_pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
MODEL_VERSION = "1"
# Responses a stream may buffer before its generations wait for the client to read.
_MAX_QUEUED_RESPONSES = 64


@dataclass
class _Output:
    """Text to send for one request, and whether (and how) the request ended."""

    text: str
    finish_reason: str | None
    usage: Usage | None


class KserveService(grpc_service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(
        self,
        flow: RequestFlow,
        tokenizer: PromptTokenizer,
        runtime: PolicyRuntime,
        model_name: str,
        defaults: SamplingDefaults = OPENAI_DEFAULTS,
    ) -> None:
        self.flow = flow
        self.tokenizer = tokenizer
        # Readiness (`PolicyRuntime.is_ready`).
        self.runtime = runtime
        self.model_name = model_name
        # Sampling values of requests that leave them out (the model's, or OpenAI's).
        self.defaults = defaults

    async def ServerLive(self, request, context) -> kserve_pb.ServerLiveResponse:
        return kserve_pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context) -> kserve_pb.ServerReadyResponse:
        return kserve_pb.ServerReadyResponse(ready=await self.runtime.is_ready())

    async def ModelReady(self, request, context) -> kserve_pb.ModelReadyResponse:
        # An unknown model is "not ready" rather than an error, as in Triton.
        try:
            self._check_model(request.name, request.version)
        except ModelNotFound:
            return kserve_pb.ModelReadyResponse(ready=False)
        return kserve_pb.ModelReadyResponse(ready=await self.runtime.is_ready())

    async def ServerMetadata(self, request, context) -> kserve_pb.ServerMetadataResponse:
        return kserve_pb.ServerMetadataResponse(name="tandem", version=_server_version())

    async def ModelMetadata(self, request, context) -> kserve_pb.ModelMetadataResponse:
        try:
            self._check_model(request.name, request.version)
        except ModelNotFound as exc:
            await abort_with(context, exc)
        Tensor = kserve_pb.ModelMetadataResponse.TensorMetadata
        return kserve_pb.ModelMetadataResponse(
            name=self.model_name,
            versions=[MODEL_VERSION],
            platform="tandem",
            inputs=[
                Tensor(name=s.name, datatype=s.datatypes[0], shape=s.shape) for s in MODEL_INPUTS
            ],
            outputs=[
                Tensor(name=s.name, datatype=s.datatypes[0], shape=s.shape) for s in MODEL_OUTPUTS
            ],
        )

    async def ModelInfer(self, request, context) -> kserve_pb.ModelInferResponse:
        try:
            parsed = await self._parse(request)
            if parsed.stream:
                raise InvalidRequest(
                    "input 'stream' is true: a streamed generation needs ModelStreamInfer "
                    "(ModelInfer answers once)",
                    param="stream",
                )
        except InvalidRequest as exc:
            logger.debug("ModelInfer %r rejected: %s", request.id, exc)
            await abort_with(context, exc)
        try:
            output = await self._generate_all(parsed)
        except RouterError as exc:
            logger.warning("ModelInfer %r failed: %s", request.id, exc)
            await abort_with(context, exc)
        return self._response(request, parsed, output, final=None)

    async def ModelStreamInfer(self, request_iterator, context) -> None:
        # One writer (this coroutine) drains a queue that every request's task fills:
        # gRPC allows one write at a time.
        responses: asyncio.Queue[kserve_pb.ModelStreamInferResponse | None] = asyncio.Queue(
            _MAX_QUEUED_RESPONSES
        )
        tasks: set[asyncio.Task] = set()
        reader = asyncio.create_task(self._read_stream(request_iterator, responses, tasks))
        try:
            while (message := await responses.get()) is not None:
                await write_message(context, message)
        except ClientStalled as exc:
            logger.info("ModelStreamInfer: %s, the stream is ended", exc)
            end_stalled(context, exc)
        finally:
            # Client gone, deadline passed or server stopping: cancel what still runs.
            reader.cancel()
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(reader, *tasks, return_exceptions=True)

    async def _read_stream(
        self,
        request_iterator: AsyncIterator[kserve_pb.ModelInferRequest],
        responses: asyncio.Queue,
        tasks: set[asyncio.Task],
    ) -> None:
        """Start a task per request; after the client half-closes, wait for them all."""
        try:
            async for request in request_iterator:
                task = asyncio.create_task(self._stream_one(request, responses))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks:
                await asyncio.wait(set(tasks))
        except Exception as exc:  # the request stream broke: end the response stream
            logger.info("ModelStreamInfer request stream failed: %r", exc)
        # Not in a `finally`: when cancelled, nobody reads the queue any more.
        await responses.put(None)

    async def _stream_one(
        self, request: kserve_pb.ModelInferRequest, responses: asyncio.Queue
    ) -> None:
        """Run one request of a stream, queueing its responses (or its error)."""
        try:
            parsed = await self._parse(request)
            if not parsed.stream:
                output = await self._generate_all(parsed)
                await responses.put(self._stream_response(request, parsed, output))
                return
            req_id = uuid.uuid4().hex
            generation = self.flow.generate(req_id, parsed.prompt_ids, parsed.params)
            async with aclosing(generation) as chunks:
                async for chunk in chunks:
                    reason = public_finish_reason(chunk.finish_reason)
                    output = _Output(chunk.text, reason, chunk.usage)
                    # Empty deltas (text held back until it is complete) are not sent.
                    if chunk.text or chunk.finish_reason is not None:
                        await responses.put(self._stream_response(request, parsed, output))
        except RouterError as exc:
            if not isinstance(exc, InvalidRequest):
                logger.warning("ModelStreamInfer %r failed: %s", request.id, exc)
            await responses.put(self._stream_error(request, str(exc)))
        except Exception:
            logger.exception("ModelStreamInfer %r failed", request.id)
            await responses.put(self._stream_error(request, "internal error"))

    async def _parse(self, request: kserve_pb.ModelInferRequest) -> KserveRequest:
        """The request checked and tokenized (on the tokenizer's thread, off the loop)."""
        self._check_model(request.model_name, request.model_version)
        return await self.tokenizer.off_loop(parse_request, request, self.tokenizer, self.defaults)

    def _check_model(self, name: str, version: str) -> None:
        if name != self.model_name:
            raise ModelNotFound(
                f"unknown model {name!r}; this server serves {self.model_name!r}", "model_name"
            )
        if version not in ("", MODEL_VERSION):
            raise ModelNotFound(
                f"model {name!r} has no version {version!r}; it has [{MODEL_VERSION!r}]",
                "model_version",
            )

    async def _generate_all(self, parsed: KserveRequest) -> _Output:
        """The whole generation as one output (prompt first unless excluded)."""
        req_id = uuid.uuid4().hex
        parts = [] if parsed.exclude_input_in_output else [parsed.prompt]
        finish_reason, usage = None, None
        generation = self.flow.generate(req_id, parsed.prompt_ids, parsed.params)
        async with aclosing(generation) as chunks:
            async for chunk in chunks:
                parts.append(chunk.text)
                finish_reason = public_finish_reason(chunk.finish_reason)
                usage = chunk.usage or usage
        return _Output("".join(parts), finish_reason, usage)

    def _response(
        self,
        request: kserve_pb.ModelInferRequest,
        parsed: KserveRequest,
        output: _Output,
        final: bool | None,
    ) -> kserve_pb.ModelInferResponse:
        """Outputs as raw BYTES contents; `final` (streams only) sets triton_final_response."""
        response = kserve_pb.ModelInferResponse(
            model_name=self.model_name, model_version=MODEL_VERSION, id=request.id
        )
        values = {"text_output": output.text, "finish_reason": output.finish_reason}
        for name in parsed.output_names:
            value = values[name]
            if value is None:  # finish_reason before the last response
                continue
            response.outputs.add(name=name, datatype="BYTES", shape=parsed.output_shape)
            response.raw_output_contents.append(encode_bytes([value.encode()]))
        if final is not None:
            response.parameters["triton_final_response"].bool_param = final
        if output.usage is not None:
            response.parameters["num_input_tokens"].int64_param = output.usage.prompt_tokens
            response.parameters["num_output_tokens"].int64_param = output.usage.completion_tokens
        return response

    def _stream_response(
        self, request: kserve_pb.ModelInferRequest, parsed: KserveRequest, output: _Output
    ) -> kserve_pb.ModelStreamInferResponse:
        final = output.finish_reason is not None
        return kserve_pb.ModelStreamInferResponse(
            infer_response=self._response(request, parsed, output, final=final)
        )

    def _stream_error(
        self, request: kserve_pb.ModelInferRequest, message: str
    ) -> kserve_pb.ModelStreamInferResponse:
        # The id (and final flag) let raw-stub clients match the error to its request;
        # tritonclient reads only error_message.
        response = kserve_pb.ModelInferResponse(
            model_name=request.model_name, model_version=request.model_version, id=request.id
        )
        response.parameters["triton_final_response"].bool_param = True
        return kserve_pb.ModelStreamInferResponse(error_message=message, infer_response=response)


def _server_version() -> str:
    try:
        return metadata.version("tandem")
    except metadata.PackageNotFoundError:
        return "unknown"
