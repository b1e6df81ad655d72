#!/usr/bin/env python3
"""Stream answers from a running stack through both doors, as a client on the host would:
gRPC `Generate` and the OpenAI HTTP `/v1/chat/completions` (server-sent events). Prints the
first answer of each as it streams; exits non-zero when any request fails or streams no text.

    stream_answers.py --grpc 127.0.0.1:50151 --http http://127.0.0.1:58000 [--requests 6]

Runs with the project's virtualenv (grpc, the generated protos) or inside the llmserve image.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from protos.llmserve.v1 import text_pb2, text_pb2_grpc

QUESTION = "What is the capital of France? Answer in one sentence."
MAX_TOKENS = 24


def grpc_answer(target: str, show: bool) -> str:
    with grpc.insecure_channel(target) as channel:
        request = text_pb2.GenerateRequest(
            messages=[text_pb2.ChatMessage(role="user", content=QUESTION)],
            sampling=text_pb2.SamplingParams(temperature=0.0, max_new_tokens=MAX_TOKENS),
        )
        text = []
        for response in text_pb2_grpc.TextGenerationStub(channel).Generate(request, timeout=300):
            text.append(response.text)
            if show:
                print(response.text, end="", flush=True)
    return "".join(text)


def http_answer(base_url: str, show: bool) -> str:
    body = {
        "model": http_model(base_url),
        "messages": [{"role": "user", "content": QUESTION}],
        "stream": True,
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
    }
    request = urllib.request.Request(
        f"{base_url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    text = []
    with urllib.request.urlopen(request, timeout=300) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line.removeprefix("data: "))["choices"]:
                piece = choice.get("delta", {}).get("content") or ""
                text.append(piece)
                if show:
                    print(piece, end="", flush=True)
    return "".join(text)


def http_model(base_url: str) -> str:
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=30) as response:
        return str(json.load(response)["data"][0]["id"])


def with_retry(ask: Callable[[], str], retry_s: float) -> str:
    """A worker that just restarted answers UNAVAILABLE / 503 until its scheduler has it back."""
    deadline = time.monotonic() + retry_s
    while True:
        try:
            return ask()
        except (grpc.RpcError, urllib.error.URLError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grpc", required=True, help="HOST:PORT of the gRPC door")
    parser.add_argument("--http", required=True, help="http://HOST:PORT of the HTTP door")
    parser.add_argument("--requests", type=int, default=1, help="concurrent requests per door")
    parser.add_argument("--quiet", action="store_true", help="a summary line only")
    parser.add_argument("--retry-s", type=float, default=0.0, help="retry failures this long")
    args = parser.parse_args()

    def one(door: str, index: int) -> str:
        show = index == 0 and not args.quiet and args.requests == 1
        if show:
            print(f"  {door:<4} > ", end="", flush=True)
        if door == "gRPC":
            answer = with_retry(lambda: grpc_answer(args.grpc, show), args.retry_s)
        else:
            answer = with_retry(lambda: http_answer(args.http, show), args.retry_s)
        if show:
            print()
        return answer

    jobs = [(door, index) for door in ("gRPC", "HTTP") for index in range(args.requests)]
    if args.requests == 1:  # one after the other, so the two streams print apart
        answers = [one(door, index) for door, index in jobs]
    else:
        with ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(lambda job: one(*job), jobs))
    empty = sum(1 for answer in answers if not answer.strip())
    if args.quiet or args.requests > 1:
        print(f"  {len(answers) - empty} of {len(answers)} answers streamed (gRPC and HTTP)")
    return 1 if empty else 0


if __name__ == "__main__":
    sys.exit(main())
