"""``nanokv serve``: the OpenAI API from one engine (``nanokv_cli.serve`` runs it)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from ..engine.config import EngineConfig
from ..kv_events import KVEventsConfig, parse_kv_events_config
from ..paths import check_model_path, check_outputs, model_inputs
from ..serve.limits import ServeLimits
from .engine_options import EngineFlags, engine_options
from .errors import user_errors
from .models import make_llm
from .options import (
    DEFAULT_MAX_TOKENS,
    DebugOpt,
    LiveOpt,
    ModelOpt,
    RecordOpt,
    RequestMaxTokensOpt,
    want_live,
)
from .output import stdout_console

# serve's step latency target (ms): the shortest that keeps 90% of the fixed budget's tokens/s
# in scripts/bench/serve.py's burst on a 2-core CPU (60 ms: 71%, 100 ms: 83%, 200 ms: 97%), and a burst
# then slows running streams (longest wait 0.4 s) instead of freezing them (3.5 s).
SERVE_STEP_LATENCY_MS = 200.0


def _kv_events_flag(text: str) -> KVEventsConfig:
    """``--kv-events-config``'s JSON (kv_events.py); a bad one is a usage error."""
    try:
        return parse_kv_events_config(text)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


HostOpt = Annotated[
    str,
    typer.Option(help="Address to listen on: loopback by default; 0.0.0.0 for every interface."),
]
PortOpt = Annotated[
    int, typer.Option(min=0, max=65535, help="TCP port; 0 takes a free one (printed at start).")
]
ApiKeyOpt = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        envvar="NANOKV_API_KEY",
        show_envvar=True,
        help="Require `Authorization: Bearer KEY` on /v1/* (as vLLM; /health and /metrics "
        "stay open; the environment variable keeps the key out of the process list).",
        show_default=False,
    ),
]
GuardMetricsOpt = Annotated[
    bool,
    typer.Option(
        "--guard-metrics", help="With --api-key, /metrics needs the key too (scrapers send it)."
    ),
]
ServedNameOpt = Annotated[
    str | None,
    typer.Option(
        "--served-model-name",
        help="The model name clients send. [default: --model as given, else SmolLM2-135M-Instruct]",
        show_default=False,
    ),
]
ExitReportOpt = Annotated[
    Path | None, typer.Option(help="Write the run's report as JSON to this file on exit.")
]
ShutdownOpt = Annotated[
    float,
    typer.Option(
        min=0.0, help="Seconds SIGTERM waits for in-flight requests before aborting them."
    ),
]
# The limits' defaults are ServeLimits' own (declared once, in serve/limits.py).
DEFAULT_LIMITS = ServeLimits()
ConcurrencyOpt = Annotated[
    int,
    typer.Option(
        min=1,
        help="Requests in flight (a stream counts until it ends) before more get a 503; "
        "/health and /metrics are never refused.",
    ),
]
ConnectionsOpt = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="Open connections; one beyond is closed as it is accepted. [default: 3/4 of "
        "the open-files limit]",
        show_default=False,
    ),
]
KeepAliveOpt = Annotated[
    float, typer.Option(min=0.0, help="Seconds a connection may idle between requests.")
]
HeaderTimeoutOpt = Annotated[
    float,
    typer.Option(
        min=0.0,
        help="Seconds a request's headers may take, from its first byte or the "
        "connection's start (then a 408).",
    ),
]
BodyTimeoutOpt = Annotated[
    float,
    typer.Option(
        min=0.0, help="Seconds a request's body may take after its headers (then closed)."
    ),
]
KvEventsOpt = Annotated[
    KVEventsConfig | None,
    typer.Option(
        "--kv-events-config",
        parser=_kv_events_flag,
        metavar="JSON",
        help="Publish the KV cache's events for KV-aware routers (Dynamo, llm-d), as vLLM's "
        'flag does, e.g. `{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}`. '
        "Keys as vLLM's: publisher, buffer_steps, hwm, max_queue_size. [default: off]",
        show_default=False,
    ),
]


@engine_options(defaults={"step_latency_target_ms": SERVE_STEP_LATENCY_MS})
def serve_cmd(
    model: ModelOpt = None,
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 8000,
    api_key: ApiKeyOpt = None,
    guard_metrics: GuardMetricsOpt = False,
    served_model_name: ServedNameOpt = None,
    max_tokens: RequestMaxTokensOpt = DEFAULT_MAX_TOKENS,
    *,
    engine: EngineFlags,
    live: LiveOpt = None,
    record: RecordOpt = None,
    report: ExitReportOpt = None,
    shutdown_timeout: ShutdownOpt = 30.0,
    limit_concurrency: ConcurrencyOpt = DEFAULT_LIMITS.limit_concurrency,
    limit_connections: ConnectionsOpt = DEFAULT_LIMITS.limit_connections,
    timeout_keep_alive: KeepAliveOpt = DEFAULT_LIMITS.timeout_keep_alive,
    timeout_header: HeaderTimeoutOpt = DEFAULT_LIMITS.timeout_header,
    timeout_body: BodyTimeoutOpt = DEFAULT_LIMITS.timeout_body,
    kv_events_config: KvEventsOpt = None,
    debug: DebugOpt = False,
) -> None:
    """Serve the OpenAI API (completions, chat, streaming) from one engine, with metrics.

    Endpoints: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`,
    `GET /health`, `GET /metrics` (Prometheus, vLLM's names). Every client's requests are
    batched continuously by one engine loop; the live view shows their cache on a terminal.
    SIGTERM stops accepting and finishes in-flight requests (exit 0); Ctrl-C aborts them
    (exit 130); both write `--record` and `--report`.

    **Examples**

    ```
    nanokv serve
    nanokv serve --port 8080 --block-size 16 --record serve.trace --report serve.json
    NANOKV_API_KEY=secret nanokv serve --host 0.0.0.0
    ```
    """
    from ..engine.model.loader import DEFAULT_MODEL_FILE

    engine_config = engine.config()
    if api_key is not None and not api_key.strip():
        raise typer.BadParameter("the API key is empty", param_hint="--api-key")
    limits = dict(
        limit_concurrency=limit_concurrency,
        limit_connections=limit_connections,
        timeout_keep_alive=timeout_keep_alive,
        timeout_header=timeout_header,
        timeout_body=timeout_body,
    )
    with user_errors(debug):
        check_model_path(model)
        check_outputs({"--report": report, "--record": record}, inputs=model_inputs(model))
        from ..serve.server import bind_socket, serve
        from ..views.tables import summary_table

        sock = bind_socket(host, port)  # before loading: a taken port fails at once
        llm = make_llm(model, engine_config)
        result = serve(
            llm,
            sock,
            model_name=served_model_name or model or DEFAULT_MODEL_FILE.split(".")[0],
            default_max_tokens=max_tokens,
            api_key=api_key,
            config=_run_config(llm, engine_config),
            record=record,
            report=report,
            live=want_live(live, False),
            console=stdout_console(),
            shutdown_timeout=shutdown_timeout,
            limits=ServeLimits(**limits),
            guard_metrics=guard_metrics,
            kv_events=kv_events_config,
        )
        stdout_console().print(summary_table(result.report))
    if result.exit_code == 130:
        print("nanokv: interrupted", file=sys.stderr)
    elif result.exit_code:
        print("nanokv: error: the engine failed (traceback above)", file=sys.stderr)
    raise typer.Exit(result.exit_code)


def _run_config(llm, engine_config: EngineConfig) -> dict[str, Any]:
    """The report's description of the server's engine."""
    return {
        "model": llm.model_path,
        "dry_run": False,
        **engine_config.describe(),
        "quantization": llm.quantization or "none",
    }
