"""``nanokv serve``: real servers on free loopback ports, driven by the real ``openai`` client.

Each server is a subprocess (``ServerProcess``: ``python -m nanokv_cli.cli serve --port 0``) on
a tiny random Llama; the serving page's examples (docs/serving.md) run against the default
model. Logs go to files, not pipes, so a chatty server can never block on a full pipe.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest
from support.servers import KEY, SERVER_ARGS, wait_until

from nanokv_cli.serve.process import ServerProcess
from nanokv_cli.trace.reader import TraceReader

REPO = Path(__file__).resolve().parents[1]
SYSTEM = (
    "You are a careful assistant for a paged KV cache engine. Answer briefly, name the blocks "
    "you would share, and never repeat the question. This system prompt is long on purpose."
)


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    srv = ServerProcess(
        ["--model", str(tiny), *SERVER_ARGS, "--served-model-name", "tiny"],
        tmp_path_factory.mktemp("server"),
        env={"NANOKV_API_KEY": KEY},  # the key from the environment, as the help suggests
    )
    yield srv
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.wait() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def idle(server) -> bool:
    m = server.metrics(KEY)
    return (
        m["vllm:num_requests_running"] == 0
        and m["vllm:num_requests_waiting"] == 0
        and m["nanokv:kv_cache_blocks{state=used}"] == 0
    )


# -- the API, through the openai client ---------------------------------------------------------


def test_models(client):
    [model] = client.models.list().data
    assert model.id == "tiny" and model.owned_by == "nanokv"


def test_completion_matches_the_python_api_streamed_or_not(client, tiny):
    from nanokv_cli import LLM, SamplingParams

    args = dict(model="tiny", prompt="The capital of France is", max_tokens=8, temperature=0)
    whole = client.completions.create(**args, extra_body={"ignore_eos": True})
    [choice] = whole.choices
    assert choice.finish_reason == "length"
    assert whole.usage.completion_tokens == 8
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 8
    assert whole.usage.prompt_tokens_details.cached_tokens == 0

    ref = LLM(str(tiny), block_size=16).generate(
        [args["prompt"]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    )[0]
    assert choice.text == ref["text"] and whole.usage.prompt_tokens == ref["num_prompt_tokens"]

    chunks = list(client.completions.create(**args, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_streamed_and_not(client):
    messages = [{"role": "user", "content": "Name three uses of a cache."}]
    args = dict(model="tiny", messages=messages, max_tokens=6, temperature=0)
    whole = client.chat.completions.create(**args, extra_body={"ignore_eos": True})
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 6

    chunks = list(
        client.chat.completions.create(
            **args,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_a_shared_system_prompt_is_served_from_the_cache(client, server):
    before = server.metrics(KEY)["vllm:prefix_cache_hits_total"]
    usages = []
    for question in ("What is a block?", "What is a prefix?"):
        out = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            max_tokens=4,
            temperature=0,
        )
        usages.append(out.usage)
    cached = usages[1].prompt_tokens_details.cached_tokens
    assert 0 < cached < usages[1].prompt_tokens
    assert cached >= usages[0].prompt_tokens // 2  # the system prompt, past whole blocks too
    assert server.metrics(KEY)["vllm:prefix_cache_hits_total"] > before


def test_stop_strings_cut_the_text(client, server):
    args = dict(model="tiny", prompt="Hello world", max_tokens=16, temperature=0)
    full = client.completions.create(**args, extra_body={"ignore_eos": True}).choices[0].text
    assert len(full) > 8
    stop = full[4:6]
    expected = full[: full.index(stop)]
    for stream in (False, True):
        out = client.completions.create(
            **args, stop=[stop, "never seen"], stream=stream, extra_body={"ignore_eos": True}
        )
        chunks = list(out) if stream else [out]
        assert "".join(c.choices[0].text for c in chunks) == expected
        assert chunks[-1].choices[0].finish_reason == "stop"
    assert wait_until(lambda: idle(server))  # the request cut short was aborted


def test_seeded_sampling_repeats(client):
    args = dict(model="tiny", prompt=[5, 6, 7, 8], max_tokens=8, temperature=1.0, seed=7)
    first = client.completions.create(**args).choices[0].text
    assert client.completions.create(**args).choices[0].text == first


# -- faults -------------------------------------------------------------------------------------


def post(server, path: str, body, *, key: str | None = KEY, raw: bytes | None = None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if raw is None:
        return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)
    headers["Content-Type"] = "application/json"  # what the raw bytes claim to be
    return httpx.post(f"{server.url}{path}", content=raw, headers=headers, timeout=60)


OK_PROMPT = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
BAD_INPUTS = [
    # (path, body, status, param)
    ("/v1/completions", {"model": "tiny", "max_tokens": 2}, 400, "prompt"),
    ("/v1/completions", {**OK_PROMPT, "prompt": 5}, 400, "prompt"),
    ("/v1/completions", {**OK_PROMPT, "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {**OK_PROMPT, "max_tokens": 1.5}, 400, "max_tokens"),
    ("/v1/completions", {**OK_PROMPT, "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {**OK_PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {**OK_PROMPT, "max_tokens": 10**30}, 400, "max_tokens"),
    ("/v1/completions", {**OK_PROMPT, "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {**OK_PROMPT, "seed": 2**64}, 400, "seed"),
    ("/v1/completions", {**OK_PROMPT, "seed": -(2**63) - 1}, 400, "seed"),
    ("/v1/completions", {**OK_PROMPT, "seed": 1.5}, 400, "seed"),
    ("/v1/completions", {**OK_PROMPT, "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {**OK_PROMPT, "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {**OK_PROMPT, "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {**OK_PROMPT, "stop": [""]}, 400, "stop"),
    ("/v1/completions", {**OK_PROMPT, "n": 2}, 400, "n"),
    ("/v1/completions", {**OK_PROMPT, "logprobs": 3}, 400, "logprobs"),
    ("/v1/completions", {**OK_PROMPT, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {**OK_PROMPT, "prompt": [1, 99999]}, 400, "prompt"),
    ("/v1/completions", {**OK_PROMPT, "prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {**OK_PROMPT, "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        None,
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 3}, 400, "n"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_INPUTS)
def test_bad_input_gets_an_openai_error(server, path, body, status, param):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert (error["param"] or "").split(".")[0] == param, error


@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_a_non_finite_number_gets_400_naming_its_field(server, field):
    # Python's json reads 1e999 as infinity: refused, not sampled with.
    raw = b'{"model": "tiny", "prompt": "Hello", "max_tokens": 2, "%s": 1e999}' % field.encode()
    r = post(server, "/v1/completions", None, raw=raw)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_a_tiny_temperature_is_greedy(client):
    args = dict(model="tiny", prompt=[5, 6, 7, 8], max_tokens=8)
    greedy = client.completions.create(**args, temperature=0).choices[0].text
    for tiny_temperature in (1e-40, 1e-300):
        assert (
            client.completions.create(**args, temperature=tiny_temperature).choices[0].text
            == greedy
        )


@pytest.mark.parametrize(
    "raw",
    [
        b"{not json",
        b"[1, 2]",
        b"\xff\xfe",
        b"",
        b'{"prompt": "a"} trailing',
        b'{"prompt": "a", "temperature": NaN}',
    ],
)
def test_a_body_that_is_no_json_object_gets_400(server, raw):
    r = post(server, "/v1/completions", None, raw=raw)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_a_body_over_the_limit_gets_413(server):
    from nanokv_cli.serve.json_body import MAX_BODY_BYTES

    r = post(server, "/v1/completions", {**OK_PROMPT, "prompt": "x" * MAX_BODY_BYTES})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunked():  # no Content-Length: the limit holds while reading
        for _ in range(MAX_BODY_BYTES // 65536 + 2):
            yield b" " * 65536

    r = httpx.post(
        f"{server.url}/v1/completions",
        content=chunked(),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413


def test_a_request_that_can_never_fit_is_refused_up_front(server):
    r = post(server, "/v1/completions", {**OK_PROMPT, "max_tokens": 505})  # > the model's 512
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    # Within the model's length but over the cache (24 blocks of 16 tokens).
    r = post(server, "/v1/completions", {**OK_PROMPT, "max_tokens": 450})
    assert r.status_code == 400 and "cache has only 24" in r.json()["error"]["message"]
    assert server.metrics(KEY)["nanokv:requests_rejected_total"] >= 1


def test_unknown_paths_and_methods(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.get(f"{server.url}/v1/nothing", headers=headers)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(f"{server.url}/v1/completions", headers=headers)
    assert r.status_code == 405 and "error" in r.json()
    assert httpx.get(f"{server.url}/v1/models/tiny", headers=headers).json()["id"] == "tiny"
    assert httpx.get(f"{server.url}/v1/models/other", headers=headers).status_code == 404


def test_v1_needs_the_key_health_and_metrics_do_not(server):
    for key in (None, "wrong-key", KEY + "x"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        for path in ("/v1/models", "/v1/nothing"):
            r = httpx.get(f"{server.url}{path}", headers=headers)
            assert r.status_code == 401, path
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert post(server, "/v1/completions", OK_PROMPT, key=key).status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200  # as vLLM's: scrapers read it
    assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": KEY}).status_code == 401
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_metrics_use_vllm_names(server, client):
    client.completions.create(model="tiny", prompt="metrics", max_tokens=3)
    m = server.metrics(KEY)
    for name in (
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_preemptions_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "nanokv:prefix_cache_evictions_total",
        "nanokv:prefix_cache_shared_hits_total",
        "nanokv:prefix_cache_revived_hits_total",
        "nanokv:prefix_cache_miss_tokens_total{reason=cold}",
        "nanokv:kv_cache_blocks{state=cached}",
    ):
        assert name in m, name
    assert m["vllm:prompt_tokens_total"] >= m["vllm:prefix_cache_queries_total"] > 0
    assert m["vllm:time_to_first_token_seconds_count"] > 0
    blocks = sum(m[f"nanokv:kv_cache_blocks{{state={s}}}"] for s in ("used", "cached", "free"))
    assert blocks == 24
    misses = sum(v for k, v in m.items() if k.startswith("nanokv:prefix_cache_miss_tokens_total"))
    queries, hits = m["vllm:prefix_cache_queries_total"], m["vllm:prefix_cache_hits_total"]
    assert misses == queries - hits


def aborted(server) -> float:
    return server.metrics(KEY).get("vllm:request_success_total{finished_reason=abort}", 0.0)


def test_a_client_that_disconnects_mid_stream_is_aborted(server):
    before, generated = aborted(server), server.metrics(KEY)["vllm:generation_tokens_total"]
    body = {**OK_PROMPT, "max_tokens": 350, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=60
    ) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    # Closed after one event: the request is aborted and its blocks freed at once.
    assert wait_until(lambda: aborted(server) == before + 1)
    assert wait_until(lambda: idle(server))
    assert server.metrics(KEY)["vllm:generation_tokens_total"] - generated < 350


def test_a_client_that_gives_up_on_a_whole_response_is_aborted(server):
    before = aborted(server)
    body = {**OK_PROMPT, "max_tokens": 350, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            f"{server.url}/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=httpx.Timeout(60, read=0.05),
        )
    # It may have finished before the client gave up (a fast machine): either way nothing leaks.
    assert wait_until(lambda: idle(server))
    assert aborted(server) in (before, before + 1)


# -- signals ------------------------------------------------------------------------------------


def stream_requests(url: str, n: int, results: list, started: threading.Event) -> list:
    """``n`` streaming completions in threads; each result: (finish reason or error, tokens)."""

    def one(i: int) -> None:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        text, reason = "", None
        try:
            for chunk in client.completions.create(
                model="tiny",
                prompt=f"Request {i}",
                max_tokens=300,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                started.set()
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            results.append(reason)
        except (openai.APIError, httpx.HTTPError) as e:
            results.append(type(e).__name__)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_load_drains_or_aborts_and_writes_trace_and_report(tiny, tmp_path, sig):
    trace, report = tmp_path / "serve.trace", tmp_path / "serve.json"
    srv = ServerProcess(
        [
            "--model",
            str(tiny),
            "--served-model-name",
            "tiny",
            *SERVER_ARGS,
            "--max-num-seqs",
            "1",  # one at a time: the load lasts long enough to be interrupted
            "--record",
            str(trace),
            "--report",
            str(report),
        ],
        tmp_path,
    )
    try:
        results: list = []
        started = threading.Event()
        threads = stream_requests(srv.url, 8, results, started)
        assert started.wait(60)

        def all_in_and_some_left() -> bool:
            # Every request arrived and at least two are still to run. A busy machine may let the
            # first finish before the last arrives, so "all 8 in flight at once" would be a race.
            m = srv.metrics(KEY)
            left = m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"]
            done = sum(v for k, v in m.items() if k.startswith("vllm:request_success_total"))
            return left + done == 8 and left >= 2

        assert wait_until(all_in_and_some_left, timeout=60)
        srv.proc.send_signal(sig)
        code = srv.wait(120)
        for t in threads:
            t.join(60)
    finally:
        srv.kill()
    log = srv.log()
    assert "Traceback" not in log
    saved = json.loads(report.read_text())
    state = TraceReader(trace).state_at()
    assert state.last_snapshot is not None and state.last_snapshot.num_used_blocks == 0
    assert len(results) == 8
    if sig == signal.SIGTERM:  # drained: everything in flight finished
        assert code == 0, log
        assert results == ["length"] * 8, results
        assert saved["requests"] == 8 and saved["interrupted"] is False
        assert saved["output_tokens"] == 8 * 300
        assert saved["stopped_by"] == "SIGTERM"
    else:  # interrupted: what was in flight was aborted
        assert code == 130 and "interrupted" in log, log
        assert results.count("length") < 8, results
        assert saved["interrupted"] is True and saved["requests"] < 8
        # What the aborted requests had streamed is counted, and said to be theirs.
        finished = saved["requests"] * 300
        assert saved["output_tokens"] > finished, saved
        assert saved["output_tokens_aborted"] == saved["output_tokens"] - finished
        summary = (tmp_path / "server.out").read_text()  # printed on stdout
        assert "aborted" in summary and "for aborted requests" in summary, summary
    assert saved["requests_added"] == 8


def test_a_taken_port_fails_at_once(tiny, server):
    port = server.url.rsplit(":", 1)[1]
    r = subprocess.run(
        [sys.executable, "-m", "nanokv_cli.cli", "serve", "--model", str(tiny), "--port", port],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and "cannot listen on" in r.stderr and "Traceback" not in r.stderr


# -- the serving page's examples, as written ----------------------------------------------------


def serving_section() -> str:
    page = (REPO / "docs" / "serving.md").read_text(encoding="utf-8")
    return page.split("# Serving", 1)[1].split("\n## ", 1)[0]


@pytest.mark.slow
def test_the_serving_page_examples_run(tmp_path):
    section = serving_section()
    shell = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    shell = re.sub(r"\\\n\s*", " ", shell)
    lines = [line.split(" #", 1)[0].strip() for line in shell.splitlines()]
    [serve_line] = [line for line in lines if line.startswith("nanokv serve")]
    curls = [line for line in lines if line.startswith("curl ")]
    python = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert curls and "openai" in python

    # As written, on a free port instead of 8000.
    srv = ServerProcess([*shlex.split(serve_line)[2:], "--port", "0", "--no-live"], tmp_path)
    try:
        written = "http://127.0.0.1:8000"
        for line in curls:
            r = subprocess.run(
                shlex.split(line.replace(written, srv.url)),
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert r.returncode == 0, r.stderr
            out = json.loads(r.stdout)
            assert out["choices"] and out["usage"]["completion_tokens"] > 0, out
        r = subprocess.run(
            [sys.executable, "-c", python.replace(written, srv.url)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip()
    finally:
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.wait() == 0


def test_the_live_view_runs_on_the_servers_terminal(tiny):
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(
        sys.executable,
        ["-m", "nanokv_cli.cli", "serve", "--model", str(tiny), "--port", "0", *SERVER_ARGS[:4]],
        cwd=str(REPO),
        env={**os.environ, "TERM": "xterm-256color", "COLUMNS": "100", "LINES": "40"},
        dimensions=(40, 100),
        encoding="utf-8",
        timeout=120,
    )
    child.expect(r"serving .* on (http://\S+)/v1")
    url = child.match.group(1)
    child.expect("cached-free")  # the live view is drawn
    # sampled at temperature 1 (the API's default): EOS is ignored so that three tokens come
    body = {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True}
    out = httpx.post(f"{url}/v1/completions", json=body).json()
    assert out["usage"]["completion_tokens"] == 3
    child.sendintr()
    rest = child.read()
    child.close()
    assert child.exitstatus == 130 and "Traceback" not in rest
    assert "\x1b[?25h" in rest  # the cursor is shown again


def test_an_engine_failure_fails_requests_with_a_500_not_a_traceback(tiny):
    """In process, on the model-free engine with an executor that breaks."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from nanokv_cli.engine.config import EngineConfig
    from nanokv_cli.engine.model.loader import load_tokenizer
    from nanokv_cli.run.loop import dry_run_engine
    from nanokv_cli.run.record import Run
    from nanokv_cli.serve.app import create_app
    from nanokv_cli.serve.engine_loop import EngineLoop
    from nanokv_cli.serve.metrics import Metrics
    from nanokv_cli.serve.serving import ServerState

    engine, clock = dry_run_engine(EngineConfig(block_size=16, num_blocks=64))

    def broken(seqs):
        raise RuntimeError("secret internals")

    engine.executor.run = broken
    tokenizer = load_tokenizer(str(tiny))
    llm = SimpleNamespace(
        tokenizer=tokenizer,
        chat_prompt=None,
        config=SimpleNamespace(vocab_size=320),
        max_model_len=512,
        model_path="dry-run",
    )
    with Run(engine, clock, config={}, latencies=False) as run:
        metrics = Metrics("m", engine.num_blocks, lambda: run.stats.last)
        loop = EngineLoop(engine, run, metrics)
        state = ServerState(llm, loop, metrics, model_name="m", default_max_tokens=4, api_key=None)
        loop.start()
        with TestClient(create_app(state)) as c:
            assert c.get("/health").status_code == 200
            r = c.post("/v1/completions", json={"prompt": [1, 2, 3]})
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
            assert "secret" not in r.text
            assert c.get("/health").status_code == 503
            assert c.post("/v1/completions", json={"prompt": "hi"}).status_code == 503
        loop.join(10)
    assert isinstance(loop.error, RuntimeError)
