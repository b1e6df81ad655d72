"""`python -m services.healthcheck HOST:PORT`: exit 0 when the server reports SERVING
(container health checks)."""

from __future__ import annotations

import sys

from services.launcher import healthy

if __name__ == "__main__":
    sys.exit(0 if len(sys.argv) == 2 and healthy(sys.argv[1], timeout=2.0) else 1)
