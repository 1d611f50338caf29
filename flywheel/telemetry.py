"""Request ids and traces: what ties a user's request to the records it becomes.

**Request id.** Serving takes a client's ``X-Request-Id`` when it is a safe one
(:func:`valid_request_id`: at most 128 characters of ``A-Z a-z 0-9 . _ : -``), else makes one
(:func:`new_request_id`), and answers every request with it in ``X-Request-Id``, errors
included. It is on every log line logged while the request is served (flywheel/logs.py) and
rides the records the request becomes in the Kafka header ``flywheel-request-id``:

    serving (generation, feedback) -> ingest (episode: its generation's) -> reward (reward)
        -> trainer (the ledger of the version that trained it: ``requests``)

**Traces** (opt-in: ``telemetry.otlp_endpoint``). Serving makes a span per request (a child of
the client's ``traceparent`` when it sends one) and one per record it publishes; the W3C
``traceparent`` of that span rides beside the request id, so ingest's and reward's spans for the
records made from it are in the request's trace. Spans are exported with OTLP/HTTP protobuf on
the SDK's batch thread: a collector that is slow or away drops spans, never fails a request or
a record. With no endpoint nothing is made or sent (the API's no-op tracer), and a stage passes
the ``traceparent`` it was given on unchanged, so a traced process further down still joins the
trace.

Headers are not part of a record's bytes: the contracts (flywheel/contracts.py) are unchanged,
and a record without them is as valid as before. A header that is not a valid id or trace
context is dropped, never passed on.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from flywheel.dburl import redact_database_url
from flywheel.settings import TelemetrySettings

log = logging.getLogger(__name__)

#: The HTTP header a client may send and always gets back.
HTTP_REQUEST_ID = "X-Request-Id"
#: The Kafka header of the request id, on every record a request becomes.
REQUEST_ID_HEADER = "flywheel-request-id"
#: W3C trace context headers (https://www.w3.org/TR/trace-context/), as Kafka headers too.
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
#: What a stage copies from a record onto the records it makes of it.
CARRIED = (REQUEST_ID_HEADER, TRACEPARENT, TRACESTATE)

#: Kafka headers as kafka-python reads and writes them.
Headers = list[tuple[str, bytes]]

# Safe in a log line, a header and a JSON field alike, and bounded: a client's id is copied into
# every record of its request.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
_TRACESTATE_MAX = 512  # the spec's limit on what a vendor must propagate

_PROPAGATOR = TraceContextTextMapPropagator()


def valid_request_id(value: str | bytes | None) -> str | None:
    """``value`` as a request id, or None when it is not a safe one."""
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    return value if value is not None and _REQUEST_ID.fullmatch(value) else None


def new_request_id() -> str:
    return uuid.uuid4().hex


def carried(headers: Sequence[tuple[str, bytes | None]] | None) -> Headers:
    """The request id and trace context among a record's ``headers``, valid ones only, to be
    put on the records made from it."""
    out: Headers = []
    for name, value in headers or ():
        if name not in CARRIED or value is None or any(n == name for n, _ in out):
            continue
        if name == REQUEST_ID_HEADER:
            ok = valid_request_id(value) is not None
        elif name == TRACEPARENT:
            ok = _TRACEPARENT.fullmatch(value.decode("ascii", "replace")) is not None
        else:
            ok = len(value) <= _TRACESTATE_MAX and value.isascii()
        if ok:
            out.append((name, value))
    return out


def request_id_of(headers: Sequence[tuple[str, bytes | None]] | None) -> str | None:
    """The request id a record carries, if it carries a valid one."""
    for name, value in carried(headers):
        if name == REQUEST_ID_HEADER:
            return value.decode("ascii")
    return None


class Tracing:
    """The spans of one process (``role``: ``serving``, ``ingest``, ...), from ``settings``.

    Without an endpoint it holds the API's no-op tracer: spans cost a call and record nothing.
    """

    def __init__(self, settings: TelemetrySettings | None = None, role: str = "flywheel") -> None:
        self.provider: Any = None
        self.tracer: trace.Tracer = trace.NoOpTracer()
        if settings is None or not settings.otlp_endpoint:
            return
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        # a provider of our own, not the global one: vLLM (or any library) setting the global
        # provider neither turns ours on nor redirects it
        self.provider = TracerProvider(resource=Resource.create({"service.name": f"{settings.service_name}-{role}"}))
        exporter = OTLPSpanExporter(endpoint=f"{settings.otlp_endpoint}/v1/traces", timeout=settings.export_timeout_s)
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("flywheel")
        log.info("traces: exporting to %s/v1/traces as %s-%s", redact_database_url(settings.otlp_endpoint),
                 settings.service_name, role)

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    @contextmanager
    def request_span(self, name: str, http_headers: Mapping[str, str]) -> Iterator[trace.Span]:
        """The span of one HTTP request, a child of the client's ``traceparent`` if it sent one."""
        parent = _PROPAGATOR.extract(http_headers) if self.enabled else None
        with self.tracer.start_as_current_span(name, context=parent, kind=trace.SpanKind.SERVER) as span:
            yield span

    def record_headers(self, kind: str, request_id: str | None) -> Headers:
        """Headers for a record the current request makes: its request id, and the trace context
        of a producer span for the record (a child of the request's span) when traces are on."""
        out: Headers = [(REQUEST_ID_HEADER, request_id.encode("ascii"))] if request_id else []
        if not self.enabled:
            return out
        with self.tracer.start_as_current_span(f"publish {kind}", kind=trace.SpanKind.PRODUCER) as span:
            if request_id:
                span.set_attribute("flywheel.request_id", request_id)
            return out + _injected()

    @contextmanager
    def record_span(self, name: str, headers: Headers, **attributes: str) -> Iterator[Headers]:
        """A span for work on a record that carried ``headers`` (already :func:`carried`), in the
        trace they name; yields the headers for the records made in it: the same request id, and
        this span's trace context (the given one unchanged when traces are off)."""
        if not self.enabled:
            yield headers
            return
        parent = _PROPAGATOR.extract({n: v.decode("ascii") for n, v in headers if n in (TRACEPARENT, TRACESTATE)})
        with self.tracer.start_as_current_span(name, context=parent, kind=trace.SpanKind.CONSUMER) as span:
            for key, value in attributes.items():
                span.set_attribute(f"flywheel.{key}", value)
            if (rid := request_id_of(headers)) is not None:
                span.set_attribute("flywheel.request_id", rid)
            yield [(n, v) for n, v in headers if n == REQUEST_ID_HEADER] + _injected()

    def flush(self, timeout_s: float = 10.0) -> None:
        if self.provider is not None:
            self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Export what is left (up to the export timeout) and stop the export thread."""
        if self.provider is not None:
            try:
                self.provider.shutdown()
            except Exception:
                log.warning("traces: the last spans could not be exported", exc_info=True)


def _injected() -> Headers:
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return [(name, value.encode("ascii")) for name, value in carrier.items()]
