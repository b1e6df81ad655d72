"""`python -m services.healthcheck HOST:PORT`: exit 0 when the server reports SERVING on the
standard gRPC health service; `python -m services.healthcheck http(s)://HOST:PORT/ready`: exit
0 when that URL answers 200 (over HTTPS without checking the certificate, so the tokenizer
tier's check works with TLS on). For container health checks."""

from __future__ import annotations

import sys

from services.launcher import healthy, http_ready


def check(target: str) -> bool:
    if target.startswith(("http://", "https://")):
        return http_ready(target, timeout=2.0)
    return healthy(target, timeout=2.0)


if __name__ == "__main__":
    sys.exit(0 if len(sys.argv) == 2 and check(sys.argv[1]) else 1)
