"""`llmserve bench serve` with several --target, an API key and TLS, without a model: fake
OpenAI-compatible and gRPC servers on loopback that check the bearer token, the same prompts
reaching every target, one table with the ratios to the first target, grpcs:// and https://
with a throwaway CA given by --tls-ca, and the key never printed."""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import pytest

from benchmarks import serve, serve_clients, serve_flags, serve_points, serve_stack, serve_targets
from benchmarks.common import masked_argv
from benchmarks.serve_clients import Access, OpenAIClient
from benchmarks.serve_compare import COMPARE_HEADERS
from benchmarks.serve_load import Generation, drive
from benchmarks.serve_workload import Sample
from protos.llmserve.v1 import text_pb2, text_pb2_grpc
from tests.tls_certs import self_signed

KEY = "sk-test-good-key"


@pytest.fixture(autouse=True)
def _no_key_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in serve_flags.API_KEY_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def _quiet_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    original = serve_points.run_point

    def run_point(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **{**kwargs, "show_progress": False})

    monkeypatch.setattr(serve_points, "run_point", run_point)


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.configure_parser(parser)
    return parser.parse_args(argv)


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _table(report: str, heading: str) -> list[list[str]]:
    """The rows of the markdown table under `heading` (header and rule left out)."""
    lines = report[report.index(heading) :].splitlines()[2:]
    table = []
    for line in lines:
        if not line.startswith("|"):
            break
        table.append(_cells(line))
    assert table[0] == COMPARE_HEADERS
    return table[2:]


# ---- a throwaway CA and a server certificate for 127.0.0.1 -----------------------------------


@dataclass(frozen=True)
class Certificates:
    ca_file: Path
    server_key: bytes
    server_chain: bytes

    def server_context(self, tmp_path: Path) -> ssl.SSLContext:
        key, chain = tmp_path / "server.key", tmp_path / "server.pem"
        key.write_bytes(self.server_key)
        chain.write_bytes(self.server_chain)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(chain, key)
        return context


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    # A self-signed certificate is its own CA: trusting it (--tls-ca) is trusting the server.
    cert, key = self_signed(tmp_path_factory.mktemp("tls"))
    return Certificates(cert, key.read_bytes(), cert.read_bytes())


# ---- a fake OpenAI-compatible server that wants a bearer token --------------------------------


@dataclass
class FakeOpenAI:
    """What the server saw; it streams one SSE event per `tokens_per_event` tokens, then usage."""

    key: str
    tokens_per_event: int = 1
    url: str = ""
    prompts: list[tuple[int, ...]] = field(default_factory=list)
    authorizations: list[str | None] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _openai_handler(state: FakeOpenAI) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def authorized(self) -> bool:
            authorization = self.headers.get("Authorization")
            with state.lock:
                state.authorizations.append(authorization)
            if authorization == f"Bearer {state.key}":
                return True
            body = b'{"error": {"message": "invalid api key", "type": "authentication_error"}}'
            self.send_response(401)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return False

        def do_GET(self) -> None:
            if not self.authorized():
                return
            body = json.dumps({"data": [{"id": "fake-model"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if not self.authorized():
                return
            with state.lock:
                state.prompts.append(tuple(request["prompt"]))
            assert request["stream_options"] == {"include_usage": True}
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            n, k = request["max_tokens"], state.tokens_per_event
            events: list[dict[str, Any]] = [{"choices": [{"text": "", "index": 0}]}]  # role only
            for start in range(0, n, k):
                last = start + k >= n
                text = "".join(f"t{i}" for i in range(start, min(start + k, n)))
                choice = {"text": text, "index": 0, "finish_reason": "length" if last else None}
                events.append({"choices": [choice]})
            usage = {"prompt_tokens": len(request["prompt"]), "completion_tokens": n}
            events.append({"choices": [], "usage": usage})
            for event in [*(json.dumps(e) for e in events), "[DONE]"]:
                data = f"data: {event}\n\n".encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")

    return Handler


@contextmanager
def _openai_server(state: FakeOpenAI, tls: ssl.SSLContext | None = None) -> Iterator[FakeOpenAI]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _openai_handler(state))
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    scheme = "https" if tls is not None else "http"
    state.url = f"{scheme}://127.0.0.1:{server.server_address[1]}/v1"
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def openai() -> Iterator[FakeOpenAI]:
    with _openai_server(FakeOpenAI(KEY)) as state:
        yield state


# ---- a fake gRPC TextGeneration that wants a bearer token -------------------------------------


class KeyedTextGeneration(text_pb2_grpc.TextGenerationServicer):  # type: ignore[misc]
    """One token per message; remembers every prompt and the authorization metadata."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.prompts: list[tuple[int, ...]] = []
        self.authorizations: list[str | None] = []
        self.lock = threading.Lock()

    def Generate(self, request: Any, context: Any) -> Iterator[Any]:
        authorization = dict(context.invocation_metadata()).get("authorization")
        with self.lock:
            self.authorizations.append(authorization)
        if authorization != f"Bearer {self.key}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid api key")
        with self.lock:
            self.prompts.append(tuple(request.prompt_token_ids))
        n = request.sampling.max_new_tokens
        for index in range(n):
            yield text_pb2.GenerateResponse(token_ids=[index])
        usage = text_pb2.Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=n)
        yield text_pb2.GenerateResponse(finish_reason="length", usage=usage)


@contextmanager
def _grpc_server(
    servicer: KeyedTextGeneration, certificates: Certificates | None = None
) -> Iterator[str]:
    """The servicer on loopback; its address (host:port)."""
    server = grpc.server(ThreadPoolExecutor(4))
    text_pb2_grpc.add_TextGenerationServicer_to_server(servicer, server)
    if certificates is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        credentials = grpc.ssl_server_credentials(
            [(certificates.server_key, certificates.server_chain)]
        )
        port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)


@pytest.fixture
def grpc_servicer() -> Iterator[tuple[KeyedTextGeneration, str]]:
    servicer = KeyedTextGeneration(KEY)
    with _grpc_server(servicer) as address:
        yield servicer, address


# ---- flags --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "label", "url"),
    [
        ("grpc=grpc://127.0.0.1:50051", "grpc", "grpc://127.0.0.1:50051"),
        ("grpc://127.0.0.1:50051", "grpc://127.0.0.1:50051", "grpc://127.0.0.1:50051"),
        ("llama = http://h:8080/v1", "llama", "http://h:8080/v1"),
        ("http://h:1/v1?x=y", "http://h:1/v1?x=y", "http://h:1/v1?x=y"),
        ("door=https://h:1/v1?x=y", "door", "https://h:1/v1?x=y"),
        ("tls=grpcs://h:1", "tls", "grpcs://h:1"),
        ("inprocess", "inprocess", "inprocess"),
        ("engine=inprocess", "engine", "inprocess"),
    ],
)
def test_a_target_is_an_optional_label_and_a_url(text: str, label: str, url: str) -> None:
    assert serve_targets.parse_target(text) == serve_targets.TargetSpec(label, url)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--target", "=grpc://h:1"], "needs a label"),
        (["--target", "a=ftp://h:1"], "grpc"),
        (["--target", "a=grpc://h:1", "--target", "a=http://h:2/v1"], "labels must differ"),
        (["--target", "grpc://h:1", "--target", "grpc://h:1"], "labels must differ"),
        (["--target", "grpc://h:1", "--rounds", "2"], "at least two"),
        (["--target", "a=grpc://h:1", "--target", "b=grpc://h:2", "--rounds", "0"], ">= 1"),
        (["--target", "grpc://h:1", "--target", "b=http://h:2/v1", "--tls-ca", "x"], "none"),
    ],
)
def test_target_flags_that_do_not_fit_are_refused(argv: list[str], message: str) -> None:
    args = _args(argv)
    with pytest.raises(ValueError, match=message):
        serve_targets.check_target_flags(args, serve_targets.target_specs(args))


def test_compare_inprocess_takes_one_running_stack() -> None:
    with pytest.raises(ValueError, match="at most one --target"):
        serve_stack.check_compare_flags(
            _args(["--compare-inprocess", "--target", "grpc://a:1", "--target", "grpc://b:1"])
        )
    args = _args(["--compare-inprocess", "--target", "stack=grpcs://a:1"])
    serve_stack.check_compare_flags(args)
    assert serve_stack.compared_target(args) == "grpcs://a:1"


def test_the_api_key_comes_from_the_flag_then_the_environment() -> None:
    environ = {"OPENAI_API_KEY": "openai", "LLMSERVE_API_KEY": "ours"}
    assert serve_targets.api_key_source(_args(["--api-key", "flag"]), environ) == (
        "flag",
        "--api-key",
    )
    assert serve_targets.api_key_source(_args([]), environ) == ("ours", "LLMSERVE_API_KEY")
    assert serve_targets.api_key_source(_args([]), {"OPENAI_API_KEY": "openai"}) == (
        "openai",
        "OPENAI_API_KEY",
    )
    assert serve_targets.api_key_source(_args([]), {"LLMSERVE_API_KEY": ""}) is None
    access, line = serve_targets.target_access(_args([]), environ)
    assert access.authorization == "Bearer ours"
    assert line is not None and "LLMSERVE_API_KEY" in line and "ours" not in line
    assert "ours" not in repr(access)


def test_the_command_line_never_shows_the_key() -> None:
    argv = ["llmserve", "bench", "serve", "--api-key", "k1", "--api-key=k2", "--api", "k3"]
    argv += ["--target", "grpc://h:1", "--api=k4"]
    assert masked_argv(argv) == [
        *("llmserve", "bench", "serve", "--api-key", "***", "--api-key=***", "--api", "***"),
        *("--target", "grpc://h:1", "--api=***"),
    ]
    config = serve.config_document(_args(["--api-key", "k1"]))
    assert config["api_key"] == "***"


def test_a_missing_ca_file_stops_the_run_before_any_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--target", "https://127.0.0.1:9/v1", "--tls-ca", str(tmp_path / "none.pem")]
    assert serve.run(_args(argv)) == 2
    assert "none.pem" in capsys.readouterr().err


# ---- the client: a bearer token, several tokens per event -------------------------------------


def test_openai_client_sends_the_key_and_counts_merged_events_from_usage() -> None:
    with _openai_server(FakeOpenAI(KEY, tokens_per_event=3)) as state:

        async def main() -> list[Any]:
            client = OpenAIClient(state.url, None, Generation(), Access(api_key=KEY))
            await client.start()
            try:
                return await drive(client, [Sample((1, 2), 7)], [0.0], 1, None)
            finally:
                await client.close()

        (record,) = asyncio.run(main())
    # GET /models and the completion both carry the key.
    assert state.authorizations == [f"Bearer {KEY}"] * 2
    assert record.ok
    # Events of 3, 3 and 1 tokens; the role-only first event is no token.
    assert [chunk.num_tokens for chunk in record.chunks] == [1, 1, 1]
    assert record.output_tokens == 7  # usage.completion_tokens
    assert record.tpot_s is not None
    assert record.tpot_s == pytest.approx(
        (record.end_time_s - record.chunks[0].time_s) / 6, rel=1e-9
    )


# ---- several targets in one run ---------------------------------------------------------------


def test_two_targets_get_the_same_prompts_and_one_table(
    openai: FakeOpenAI,
    grpc_servicer: tuple[KeyedTextGeneration, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    servicer, address = grpc_servicer
    out = tmp_path / "targets.json"
    argv = ["--target", f"grpc=grpc://{address}", "--target", f"http={openai.url}"]
    argv += ["--api-key", KEY, "--num-prompts", "4", "--input-len", "5", "--output-len", "3"]
    argv += ["--concurrency", "1,2", "--warmup", "2", "--json-out", str(out)]
    assert serve.run(_args(argv)) == 0
    # The key reached both servers: an HTTP header, gRPC metadata.
    assert set(openai.authorizations) == {f"Bearer {KEY}"}
    assert set(servicer.authorizations) == {f"Bearer {KEY}"}
    # The same warm-up and prompts, in the same order while one request is in flight (the
    # warm-up and c=1); at c=2 two requests race to each server.
    grpc_prompts, http_prompts = servicer.prompts, openai.prompts
    assert len(grpc_prompts) == len(http_prompts) == 2 + 2 * 4
    assert grpc_prompts[:6] == http_prompts[:6]
    assert sorted(grpc_prompts[6:]) == sorted(http_prompts[6:])
    assert len(set(grpc_prompts[2:])) == 8  # fresh prompts per load point
    captured = capsys.readouterr()
    rows = _table(captured.out, "## grpc vs http")
    assert [row[:4] for row in rows] == [
        ["c=1", "grpc", "4/4", "0"],
        ["c=1", "http", "4/4", "0"],
        ["c=2", "grpc", "4/4", "0"],
        ["c=2", "http", "4/4", "0"],
    ]
    ratio_columns = [COMPARE_HEADERS.index(h) for h in COMPARE_HEADERS if "ratio" in h]
    assert len(ratio_columns) == 3
    for row in rows:
        if row[1] == "grpc":
            assert [row[i] for i in ratio_columns] == ["1.00"] * 3
        else:
            assert all(float(row[i]) > 0 for i in ratio_columns)
    assert "every ratio is the row's target / grpc" in captured.out
    assert KEY not in captured.out + captured.err
    assert "API key from --api-key" in captured.out
    text = out.read_text()
    assert KEY not in text
    document = json.loads(text)
    assert [(p["system"], p["concurrency"], p["round"]) for p in document["points"]] == [
        ("grpc", 1, 1),
        ("grpc", 2, 1),
        ("http", 1, 1),
        ("http", 2, 1),
    ]
    compare = document["compare"]
    assert compare["reference"] == "grpc" and compare["run_order"] == ["grpc", "http"]
    assert compare["targets"]["http"] == openai.url
    assert [(row["label"], row["target"]) for row in compare["rows"]] == [
        ("c=1", "grpc"),
        ("c=1", "http"),
        ("c=2", "grpc"),
        ("c=2", "http"),
    ]
    assert document["config"]["api_key"] == "***"


def test_a_wrong_key_shows_as_errors_in_the_table(
    grpc_servicer: tuple[KeyedTextGeneration, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, address = grpc_servicer
    with _openai_server(FakeOpenAI("another key")) as openai:
        # One target with --model (requests fail), one without (its GET /models fails).
        argv = ["--target", f"grpc=grpc://{address}", "--target", f"http={openai.url}"]
        argv += ["--api-key", KEY, "--num-prompts", "3", "--output-len", "2"]
        assert serve.run(_args([*argv, "--model", "fake-model"])) == 1
        first = capsys.readouterr()
        assert serve.run(_args(argv)) == 1
        second = capsys.readouterr()
    for captured in (first, second):
        rows = _table(captured.out, "## grpc vs http")
        grpc_row, http_row = rows
        assert grpc_row[2:4] == ["3/3", "0"]
        assert http_row[2:4] == ["0/3", "HTTP 401: 3"]
        assert http_row[COMPARE_HEADERS.index("tok/s ratio (x)")] == "-"
        assert KEY not in captured.out + captured.err
    assert "GET /v1/models answered HTTP 401" in second.err


def test_a_wrong_key_on_grpc_is_unauthenticated(
    openai: FakeOpenAI, capsys: pytest.CaptureFixture[str]
) -> None:
    servicer = KeyedTextGeneration("another key")
    with _grpc_server(servicer) as address:
        argv = ["--target", f"http={openai.url}", "--target", f"grpc=grpc://{address}"]
        argv += ["--api-key", KEY, "--num-prompts", "2", "--output-len", "2"]
        assert serve.run(_args(argv)) == 1
    http_row, grpc_row = _table(capsys.readouterr().out, "## http vs grpc")
    assert http_row[2:4] == ["2/2", "0"]
    assert grpc_row[2:4] == ["0/2", "UNAUTHENTICATED: 2"]


def test_rounds_alternate_the_targets_with_fresh_prompts_per_round(
    openai: FakeOpenAI,
    grpc_servicer: tuple[KeyedTextGeneration, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    servicer, address = grpc_servicer
    out = tmp_path / "rounds.json"
    argv = ["--target", f"http={openai.url}", "--target", f"grpc=grpc://{address}"]
    argv += ["--api-key", KEY, "--num-prompts", "2", "--output-len", "2", "--rounds", "3"]
    argv += ["--concurrency", "1", "--json-out", str(out), "--plot-out", str(tmp_path / "p.png")]
    assert serve.run(_args(argv)) == 0
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert servicer.prompts == openai.prompts
    assert len(set(servicer.prompts)) == 6  # 3 rounds x 2 prompts, none repeated
    report = capsys.readouterr().out
    # Round by round, each target in turn.
    order = [
        line.split(":")[0]
        for line in report.splitlines()
        if line.startswith("## ") and "load 1/1" in line
    ]
    assert order == [
        f"## {target} load 1/1 round {r}/3" for r in (1, 2, 3) for target in ("http", "grpc")
    ]
    rows = _table(report, "## http vs grpc")
    assert [row[:3] for row in rows] == [["c=1", "http", "6/6"], ["c=1", "grpc", "6/6"]]
    assert "medians over 3 rounds" in report
    document = json.loads(out.read_text())
    assert [(p["system"], p["round"]) for p in document["points"]] == [
        ("http", 1),
        ("http", 2),
        ("http", 3),
        ("grpc", 1),
        ("grpc", 2),
        ("grpc", 3),
    ]
    seeds = [p["seed"] for p in document["points"]]
    assert seeds[:3] == seeds[3:] and len(set(seeds)) == 3
    assert document["compare"]["rounds"] == 3


# ---- TLS: grpcs:// and https:// trusting --tls-ca ---------------------------------------------


def test_grpcs_with_the_ca_given_by_tls_ca(
    certificates: Certificates,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(serve_clients, "CONNECT_TIMEOUT_S", 1.0)
    servicer = KeyedTextGeneration(KEY)
    with _grpc_server(servicer, certificates) as address:
        argv = ["--target", f"grpcs://{address}", "--num-prompts", "2", "--output-len", "3"]
        argv += ["--api-key", KEY]
        assert serve.run(_args([*argv, "--tls-ca", str(certificates.ca_file)])) == 0
        trusted = capsys.readouterr()
        assert len(servicer.prompts) == 2
        assert set(servicer.authorizations) == {f"Bearer {KEY}"}
        # The system's CA store does not hold the throwaway CA: no connection, no request.
        assert serve.run(_args(argv)) == 1
        untrusted = capsys.readouterr()
    assert f"target: grpcs://{address}" in trusted.out
    assert "TLS: CAs of" in trusted.out and "requests ok" in trusted.out
    assert "no connection: 2" in untrusted.out
    assert "is the server's certificate signed by --tls-ca?" in untrusted.err
    assert len(servicer.prompts) == 2


def test_https_and_grpcs_targets_together(
    certificates: Certificates,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    servicer = KeyedTextGeneration(KEY)
    tls = certificates.server_context(tmp_path)
    with (
        _grpc_server(servicer, certificates) as address,
        _openai_server(FakeOpenAI(KEY), tls) as openai,
    ):
        argv = ["--target", f"https={openai.url}", "--target", f"grpcs=grpcs://{address}"]
        argv += ["--api-key", KEY, "--tls-ca", str(certificates.ca_file)]
        argv += ["--num-prompts", "2", "--output-len", "2", "--concurrency", "1"]
        assert serve.run(_args(argv)) == 0
    assert openai.url.startswith("https://")
    assert servicer.prompts == openai.prompts and len(servicer.prompts) == 2
    rows = _table(capsys.readouterr().out, "## https vs grpcs")
    assert [row[1:4] for row in rows] == [["https", "2/2", "0"], ["grpcs", "2/2", "0"]]


def test_a_ca_file_without_certificates_stops_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty.pem"
    empty.write_text("not a certificate\n")
    argv = ["--target", "grpcs://127.0.0.1:9", "--tls-ca", str(empty)]
    assert serve.run(_args(argv)) == 2
    assert "--tls-ca" in capsys.readouterr().err
