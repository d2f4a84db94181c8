# rlproxy in a container (Debian, CPU): the OpenAI/Anthropic proxy, the Tinker API, and the
# learner or a replica of deploy/compose.yaml, depending on the flags given to `rlproxy serve`.
#
#   docker build -t rlproxy:local .
#   docker run --rm -p 8000:8000 -v rlproxy-data:/data -v rlproxy-cache:/cache rlproxy:local
#
# Any setting goes in as a flag after the image name (`rlproxy serve --model tiny ...` replaces
# the command) or as an RLPROXY_<FIELD> environment variable (-e RLPROXY_MODEL=tiny).
FROM python:3.11-slim

# MLX's Linux CPU wheel links a reference BLAS ~30-60x slower than OpenBLAS; rlproxy preloads
# this one at import (rlproxy/serving/blas.py, reported on /healthz as `blas`).
RUN apt-get update \
    && apt-get install -y --no-install-recommends libopenblas0-pthread \
    && rm -rf /var/lib/apt/lists/*

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /opt/rlproxy
COPY pyproject.toml README.md ./
COPY rlproxy ./rlproxy
COPY prm_prompts ./prm_prompts
# the tinker extra: the SDK for --trainer/--sampler tinker, and the schema /api/v1 serves
RUN pip install ".[tinker]"

# Not root. /data (records, checkpoints, prefix cache, stored responses) and /cache (models
# fetched once) are volumes; a new named volume takes this ownership.
RUN useradd --create-home --uid 1000 rlproxy \
    && mkdir -p /data /cache \
    && chown rlproxy:rlproxy /data /cache
USER rlproxy
ENV RLPROXY_DATA_DIR=/data \
    RLPROXY_CACHE_DIR=/cache \
    HF_HOME=/cache/huggingface \
    RLPROXY_PRM_PROMPTS=/opt/rlproxy/prm_prompts
VOLUME ["/data", "/cache"]

EXPOSE 8000
CMD ["rlproxy", "serve", "--host", "0.0.0.0", "--port", "8000"]
