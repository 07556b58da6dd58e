"""OpenTelemetry tracing shared by the router and the workers (off by default).

One trace per request: the router opens the root span and child spans for queueing,
prefill and decode; it injects the W3C `traceparent` into gRPC metadata, and each
worker continues the trace (prefill compute, KV transfer, decode stream).
Exporters: "none" (default: a no-op tracer, nothing recorded), "console", "otlp"
(needs the `opentelemetry-exporter-otlp-proto-grpc` package and its standard
OTEL_EXPORTER_OTLP_* environment variables).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger(__name__)


class TraceExporter(enum.StrEnum):
    NONE = "none"  # a no-op tracer (the default)
    CONSOLE = "console"  # spans printed to stdout in batches
    OTLP = "otlp"  # OTLP over gRPC, configured by the OTEL_EXPORTER_OTLP_* variables


TRACE_EXPORTERS = tuple(e.value for e in TraceExporter)
# Tracing is off unless a process is told otherwise.
DEFAULT_TRACE_EXPORTER = TraceExporter.NONE
_PROPAGATOR = TraceContextTextMapPropagator()


class Tracing:
    """A tracer plus gRPC-metadata propagation; owned by one router or worker."""

    def __init__(
        self,
        service_name: str,
        exporter: TraceExporter | str | SpanExporter = DEFAULT_TRACE_EXPORTER,
    ) -> None:
        self.provider: TracerProvider | None = None
        if isinstance(exporter, SpanExporter):
            self.provider = TracerProvider(resource=_resource(service_name))
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        elif exporter == TraceExporter.CONSOLE:
            self.provider = TracerProvider(resource=_resource(service_name))
            self.provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        elif exporter == TraceExporter.OTLP:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            self.provider = TracerProvider(resource=_resource(service_name))
            self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        elif exporter != TraceExporter.NONE:
            raise ValueError(f"trace exporter must be one of {TRACE_EXPORTERS}, got {exporter!r}")
        if self.provider is None:
            self.tracer: trace.Tracer = trace.NoOpTracer()
        else:
            self.tracer = self.provider.get_tracer("tandem")

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def start_span(
        self, name: str, parent: trace.Span | otel_context.Context | None = None, **attributes: Any
    ) -> trace.Span:
        """A started span (not made current: async generators cross contexts); the
        caller ends it. `parent` is a span or an extracted context."""
        if isinstance(parent, trace.Span):
            parent = trace.set_span_in_context(parent)
        return self.tracer.start_span(name, context=parent, attributes=attributes or None)

    def metadata(self, span: trace.Span) -> tuple[tuple[str, str], ...]:
        """gRPC metadata carrying `span`'s context to the callee (empty when off)."""
        if not self.enabled:
            return ()
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        return tuple(carrier.items())

    def context_from(self, metadata: Iterable[Any] | None) -> otel_context.Context | None:
        """The caller's trace context from incoming gRPC metadata (None when off/absent)."""
        if not self.enabled or not metadata:
            return None
        carrier = {item[0]: item[1] for item in metadata}
        return _PROPAGATOR.extract(carrier)

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()


def _resource(service_name: str) -> Resource:
    return Resource.create({"service.name": service_name})
