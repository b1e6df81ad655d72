"""`llmserve up`: the whole stack as local processes on loopback.

Starts a private redis-server (when installed and no --redis-url is given), N scheduler+worker
pairs and M tokenizer replicas, waits until each is ready (SERVING on the standard health
service; PONG for Redis), prints the public address, restarts any process that dies, and on
Ctrl-C / SIGTERM stops them front to back (tokenizers drain first) and exits 0.

Tokenizer replicas all bind the public gRPC port and the HTTP port with SO_REUSEPORT, so the
kernel spreads client connections across them. Each replica routes requests over every
scheduler.

Secrets travel by environment, never a command line (which any local user can read in ps):
API keys to the replicas; the stack's internal secret (the one given, else a fresh one per
stack) to every worker, scheduler and tokenizer, whose internal ports refuse calls without it;
the Redis URL, which carries the private redis-server's password (fresh per stack, handed to
redis-server as configuration on its stdin).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import redis

from services import cpu_placement
from services.common import cache_files, serving_marker
from services.common.config_flags import (
    add_config_flags,
    config_argv,
    config_from_args,
    env_name,
    secret_env,
)
from services.common.metrics_aggregate import ScrapeTarget, start_aggregate_server
from services.common.metrics_http import MetricsServer
from services.common.redis_store import redact_url
from services.common.serving_config import (
    SERVICE_GROUPS,
    BatchingConfig,
    ChatConfig,
    DebugConfig,
    DeviceConfig,
    DisaggregationConfig,
    InternalConfig,
    KvTierConfig,
    LoraConfig,
    ModelConfig,
    PublicConfig,
    RuntimeConfig,
    SpeculationConfig,
    StepLoopConfig,
    WeightsConfig,
)
from services.cpu_placement import Placement, PlacementPolicy
from services.healthcheck import healthy, http_ready


@dataclass(frozen=True, slots=True)
class StackConfig(
    ModelConfig,
    WeightsConfig,
    DeviceConfig,
    KvTierConfig,
    BatchingConfig,
    StepLoopConfig,
    RuntimeConfig,
    SpeculationConfig,
    LoraConfig,
    PublicConfig,
    ChatConfig,
    InternalConfig,
    DisaggregationConfig,
    DebugConfig,
):
    """The shared groups (services.common.serving_config), handed to each child as flags
    (CHILD_GROUPS), plus how the stack is laid out."""

    host: str = "127.0.0.1"
    """Where every process listens (loopback by default)."""
    port: int = 50051
    """Public port of the tokenizer tier (0 = any free port)."""
    tokenizer_replicas: int = 1
    """Tokenizer processes sharing the public port."""
    workers: int = 1
    """Scheduler+worker pairs behind the tokenizer tier (the CPU cores are split among them)."""
    prefill_pairs: int = 0
    """Pairs that only prefill long prompts, whose KV then moves to a decode pair
    (docs/disaggregation.md); with --decode-pairs, they replace --workers."""
    decode_pairs: int = 0
    """Pairs that serve requests, prefilling short prompts themselves; 0 with prefill pairs
    = one."""
    worker_threads: int | None = None
    """torch threads per worker; unset = the cores divided among the workers."""
    cpu_placement: PlacementPolicy = "auto"
    """Where processes run: none (the kernel places them), nice (everything but the workers
    at a lower priority), split (workers pinned to all cores but the last, the rest on it),
    or auto (none: measured no slower than the others; docs/deployment.md)."""
    redis_url: str | None = field(default=None, repr=False, metadata={"secret": True})
    """An existing Redis (redis://[user:password@]host:port, rediss:// for TLS; give it as
    LLMSERVE_REDIS_URL when it carries a password); unset = start a private redis-server on
    loopback, with a fresh password, when one is installed."""
    redis: bool = True
    """Use Redis at all (--no-redis: no prefix index, routing by load, local named prompts)."""
    routing: str = "cache_aware"
    """How tokenizers pick a scheduler: cache_aware, least_loaded or round_robin."""
    startup_timeout_s: float = 900.0
    """How long to wait for every process to become healthy (a worker's first start builds
    the C++ kernels and compiles its decode steps: minutes on 2 cores; later starts reuse
    the caches)."""
    ready_file: str | None = None
    """Write the addresses and pids as JSON here once ready (for scripts and tests)."""
    metrics_port: int | None = None
    """Port of the stack's merged Prometheus /metrics (0 = any free port); unset = none."""
    kv_disk_dir: str | None = None
    """Directory of the KV disk tier: each worker keeps its blocks in its own subdirectory,
    DIR/pair-<index>, so a restarted stack finds its prefixes again; unset = no disk tier."""

    def __post_init__(self) -> None:
        self.check_public()
        self.check_speculation()
        self.check_lora()
        self.check_disaggregation()
        self.check_kv_tiers(self.device)
        if self.prefill_pairs < 0 or self.decode_pairs < 0:
            raise ValueError("--prefill-pairs and --decode-pairs must be at least 0")

    @property
    def pair_roles(self) -> list[str]:
        """The role of each scheduler+worker pair, in start order."""
        if not self.prefill_pairs and not self.decode_pairs:
            return ["both"] * self.workers
        return ["prefill"] * self.prefill_pairs + ["decode"] * max(1, self.decode_pairs)


def pair_kv_disk_dir(config: KvTierConfig, index: int) -> str | None:
    """The disk tier directory of pair `index`: its own, since a worker refuses a directory
    another live worker holds; the same index finds the same blocks after a restart."""
    if config.kv_disk_dir is None:
        return None
    return str(Path(config.kv_disk_dir) / f"pair-{index}")


CHILD_GROUPS = SERVICE_GROUPS
"""The shared groups each kind of child is given from the stack's config (the ones its own
config is made of): as flags, and its secret fields as environment (secret_env)."""


def with_internal_secret(config: StackConfig) -> StackConfig:
    """The config with an internal secret: the one given, else a fresh one for this stack."""
    if config.internal_secret:
        return config
    return replace(config, internal_secret=secrets.token_urlsafe(32))


@dataclass(slots=True)
class Child:
    name: str
    kind: str
    """redis, worker, scheduler or tokenizer."""
    command: list[str]
    address: str
    ready: Callable[[str], bool]
    metrics_url: str | None = None
    """This process's own /metrics, when the stack exposes metrics."""
    placement: Placement = field(default_factory=Placement)
    env: dict[str, str] = field(default_factory=dict)
    """Added to the stack's environment for this child (its secrets)."""
    stdin: bytes | None = None
    """Written to the process's stdin at each start, then closed (redis-server's
    configuration, which holds its password: stdin is readable by no other process)."""
    http_url: str | None = None
    """A tokenizer's OpenAI base URL, when it serves HTTP."""
    serving_marker: Path | None = None
    """A replica sharing its port with others: the file it writes once it serves
    (services/common/serving_marker.py); ready needs it too."""
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = field(default=0.0)

    def start(self, env: dict[str, str]) -> None:
        if self.serving_marker is not None:
            self.serving_marker.unlink(missing_ok=True)  # a restart serves anew
        # Redis prints a banner on stdout; ours go to stderr as JSON logs.
        stdout = subprocess.DEVNULL if self.kind == "redis" else None
        stdin = subprocess.PIPE if self.stdin is not None else None
        self.process = subprocess.Popen(
            self.command,
            env={**env, **self.env},
            start_new_session=True,
            stdout=stdout,
            stdin=stdin,
        )
        if self.stdin is not None and self.process.stdin is not None:
            with self.process.stdin:
                self.process.stdin.write(self.stdin)
        cpu_placement.apply(self.process.pid, self.placement)
        self.started_at = time.monotonic()

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def serves(self) -> bool:
        """Ready at its address, and (a replica sharing the port) this process itself."""
        if self.serving_marker is not None and not self.serving_marker.exists():
            return False
        return self.ready(self.address)


def llmserve_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


# Internal listeners take ports below the kernel's ephemeral range: a port picked there (bind
# to port 0) is free only until some process's outgoing connection is handed it, and a child
# binds its port seconds later (a worker's metrics port after its model loads). Below the range
# only another listener can take it.
_LOWEST_PICKED_PORT = 15000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port(host: str) -> int:
    """A port no listener holds now, outside the ephemeral range when the system says where
    that is (else one the kernel picks)."""
    try:
        ephemeral_low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 0
    if ephemeral_low > _LOWEST_PICKED_PORT:
        for _ in range(64):
            port = secrets.randbelow(ephemeral_low - _LOWEST_PICKED_PORT) + _LOWEST_PICKED_PORT
            if _bindable(host, port):
                return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def redis_answers(address: str, password: str | None = None, timeout: float = 1.0) -> bool:
    """Whether the private Redis answers a PING (authenticated with `password`)."""
    host, port = address.rsplit(":", 1)
    client = redis.Redis(
        host=host,
        port=int(port),
        password=password,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
    )
    try:
        return bool(client.ping())
    except redis.RedisError:  # refused or still loading: not ready yet
        return False
    finally:
        client.close()


def private_redis(host: str, password: str) -> Child | None:
    """A throwaway redis-server for this stack: loopback only, nothing persisted, and a
    password. `-` makes it read configuration from stdin, before the flags: the password
    stays off its command line."""
    binary = shutil.which("redis-server")
    if binary is None:
        return None
    port = free_port(host)
    command = [
        *(binary, "-"),
        *("--bind", host, "--port", str(port)),
        *("--save", "", "--appendonly", "no"),
    ]
    return Child(
        "redis",
        "redis",
        command,
        f"{host}:{port}",
        lambda address: redis_answers(address, password),
        stdin=f"requirepass {password}\n".encode(),
    )


def stack_redis_url(
    config: StackConfig, redis: Child | None, password: str | None = None
) -> str | None:
    """The Redis every child uses: the given one, else the private server (with its password);
    None without Redis."""
    if not config.redis:
        return None
    if config.redis_url:
        return config.redis_url
    if redis is None:
        return None
    credentials = f":{password}@" if password else ""
    return f"redis://{credentials}{redis.address}"


def http_url(config: PublicConfig, port: int, host: str = "127.0.0.1") -> str:
    """The OpenAI base URL of an HTTP door."""
    return f"{'https' if config.tls else 'http'}://{host}:{port}/v1"


def port_open(address: str, timeout: float = 1.0) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def build_children(
    config: StackConfig, redis: Child | None, redis_url: str | None = None
) -> list[Child]:
    """Redis (if private) first, then workers, schedulers, tokenizers: the start order.
    `redis_url` (stack_redis_url) reaches the schedulers and tokenizers by environment."""
    host = config.host
    redis_env = {env_name("redis_url"): redis_url} if redis_url else {}
    cpus = cpu_placement.usable_cpus()
    roles = config.pair_roles

    def placed(kind: str, index: int = 0) -> Placement:
        return cpu_placement.placement_for(
            config.cpu_placement, kind, cpus=cpus, worker_index=index, num_workers=len(roles)
        )

    def child(name: str, kind: str, port: int, args: list[str], index: int = 0) -> Child:
        address = f"{host}:{port}"
        args = [kind, "--host", host, "--port", str(port), *args]
        own = config
        if kind == "worker":
            own = replace(config, kv_disk_dir=pair_kv_disk_dir(config, index))
        args += config_argv(own, *CHILD_GROUPS[kind])
        metrics_url = None
        if config.metrics_port is not None:
            metrics_port = free_port(host)
            args += ["--metrics-port", str(metrics_port)]
            metrics_url = f"http://{host}:{metrics_port}/metrics"
        command = llmserve_command(*args)
        return Child(
            name,
            kind,
            command,
            address,
            healthy,
            metrics_url,
            placed(kind, index),
            env=secret_env(config, *CHILD_GROUPS[kind]),
        )

    workers: list[Child] = []
    schedulers: list[Child] = []
    for index, role in enumerate(roles):
        worker_port, scheduler_port = free_port(host), free_port(host)
        threads = (
            config.worker_threads
            or placed("worker", index).threads
            or max(1, len(cpus) // len(roles))
        )
        worker_args = ["--threads", str(threads)]
        workers.append(child(f"worker-{index}", "worker", worker_port, worker_args, index))
        scheduler_args = [
            *("--scheduler-id", f"scheduler-{index}"),
            *("--worker", f"{host}:{worker_port}"),
            *("--role", role),
        ]
        scheduler = child(f"scheduler-{index}", "scheduler", scheduler_port, scheduler_args)
        scheduler.env.update(redis_env)
        schedulers.append(scheduler)
    public_port = config.port or free_port(host)
    http_port = config.http_port or free_port(host)  # one port for every replica
    tokenizer_args = [
        *("--scheduler", ",".join(c.address for c in schedulers)),
        *("--routing", config.routing),
    ]
    tokenizers = [
        child(f"tokenizer-{index}", "tokenizer", public_port, tokenizer_args)
        for index in range(config.tokenizer_replicas)
    ]
    markers = Path(tempfile.mkdtemp(prefix="llmserve-serving-"))
    for index, tokenizer in enumerate(tokenizers):
        tokenizer.serving_marker = markers / f"tokenizer-{index}"
        tokenizer.env[serving_marker.ENV_VAR] = str(tokenizer.serving_marker)
        tokenizer.command += ["--http-port", str(http_port)]  # the last flag given wins
        tokenizer.env.update(redis_env)
        if config.http:
            tokenizer.http_url = http_url(config, http_port, host)
            # The HTTP door's /ready is true when the gRPC health would be SERVING, and it
            # answers over TLS without a client that trusts the certificate.
            ready_url = tokenizer.http_url.removesuffix("/v1") + "/ready"
            tokenizer.ready = lambda _address, url=ready_url: http_ready(url)
        elif config.tls:
            tokenizer.ready = port_open
    if redis is not None:
        redis.placement = placed("redis")
    return [*([redis] if redis else []), *workers, *schedulers, *tokenizers]


class Stack:
    def __init__(self, config: StackConfig) -> None:
        self.config = config = with_internal_secret(config)
        wants_private_redis = config.redis and not config.redis_url
        redis_password = secrets.token_urlsafe(32)
        self.redis = private_redis(config.host, redis_password) if wants_private_redis else None
        if wants_private_redis and self.redis is None:
            print(
                "llmserve: redis-server is not installed: running without Redis "
                "(no prefix index; routing by load)",
                file=sys.stderr,
            )
        self.redis_url = stack_redis_url(config, self.redis, redis_password)
        self.children = build_children(config, self.redis, self.redis_url)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._stopping = False
        self.metrics: MetricsServer | None = None

    @property
    def public_address(self) -> str:
        return self.children[-1].address

    def start(self) -> None:
        self.metrics = start_aggregate_server(
            self.config.host,
            self.config.metrics_port,
            [ScrapeTarget(c.kind, c.name, c.metrics_url) for c in self.children if c.metrics_url],
        )
        for child in self.children:
            child.start(self.env)
        deadline = time.monotonic() + self.config.startup_timeout_s
        for child in self.children:
            print(f"llmserve: waiting for {child.name} at {child.address}", file=sys.stderr)
            while not child.serves():
                if self._stopping:  # SIGTERM before ready: stop the children, not wait on
                    raise RuntimeError("stopped during start-up")
                if not child.alive:
                    raise RuntimeError(f"{child.name} exited during start-up")
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{child.name} not healthy after {self.config.startup_timeout_s}s"
                    )
                time.sleep(0.25)
        self._write_ready_file()
        http = self.children[-1].http_url
        print(
            f"llmserve ready: {self.public_address}" + (f" (gRPC), {http} (HTTP)" if http else ""),
            flush=True,
        )

    def _group(self, kind: str) -> list[Child]:
        return [c for c in self.children if c.kind == kind]

    def describe(self) -> dict[str, object]:
        schedulers = [c.address for c in self._group("scheduler")]
        workers = [c.address for c in self._group("worker")]
        return {
            "public": self.public_address,
            "http": self.children[-1].http_url,
            "scheduler": schedulers[0],
            "worker": workers[0],
            "schedulers": schedulers,
            "workers": workers,
            "roles": self.config.pair_roles,  # of the pairs, in the order above
            # Without its password: the ready file is for scripts, not a secret store.
            "redis_url": redact_url(self.redis_url) if self.redis_url else None,
            "pids": {c.name: c.process.pid for c in self.children if c.process is not None},
            "metrics": self.metrics.url if self.metrics else None,
            "process_metrics": {c.name: c.metrics_url for c in self.children if c.metrics_url},
        }

    def _write_ready_file(self) -> None:
        if self.config.ready_file:
            # Replaced in one step: a script polling it never reads it empty or half written.
            cache_files.write_text(Path(self.config.ready_file), json.dumps(self.describe()))

    def supervise(self) -> None:
        """Restart children that die, until asked to stop."""
        while not self._stopping:
            for child in self.children:
                if self._stopping or child.alive:
                    continue
                code = child.process.returncode if child.process else None
                child.restarts += 1
                print(
                    f"llmserve: {child.name} exited ({code}); restart #{child.restarts}",
                    file=sys.stderr,
                )
                # Back off when a child keeps dying right away.
                if time.monotonic() - child.started_at < 5:
                    time.sleep(min(5.0, 0.5 * child.restarts))
                child.start(self.env)
                self._write_ready_file()
            time.sleep(0.2)

    def stop(self, *_: object) -> None:
        self._stopping = True

    def shutdown(self, timeout_s: float = 40.0) -> None:
        # Front to back: tokenizers drain their streams, then schedulers, workers, Redis.
        for group in [self._group(k) for k in ("tokenizer", "scheduler", "worker", "redis")]:
            for child in group:
                if child.alive and child.process is not None:
                    child.process.send_signal(signal.SIGTERM)
            for child in group:
                if child.process is None:
                    continue
                try:
                    child.process.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    child.process.kill()
        for marker_dir in {c.serving_marker.parent for c in self.children if c.serving_marker}:
            shutil.rmtree(marker_dir, ignore_errors=True)


def run(config: StackConfig) -> int:
    # Read now (a built-in's name or a file), so that a bad --chat-template stops the start
    # before any child runs. Imported here: Jinja is the chat tiers' dependency.
    if config.chat_template:
        from services.text.builtin_chat_templates import chat_template_option

        chat_template_option(config.chat_template)
    stack = Stack(config)
    signal.signal(signal.SIGTERM, stack.stop)
    signal.signal(signal.SIGINT, stack.stop)
    try:
        stack.start()
        stack.supervise()
    except (RuntimeError, TimeoutError, OSError) as exc:  # OSError: a port is taken
        print(f"llmserve: {exc}", file=sys.stderr)
        stack.shutdown(timeout_s=5)
        return 1
    stack.shutdown()
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("up", help="start the whole stack as local processes")
    add_config_flags(parser, StackConfig)
    parser.set_defaults(func=lambda args: run(config_from_args(StackConfig, args)))
