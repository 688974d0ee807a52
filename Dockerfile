# One image for the api and the workers (docker-compose.yml picks the command).
#
# The base image brings torch, CUDA and cuDNN; nothing here downloads a second torch: the
# project's locked requirements leave torch out, so the image's own is kept.
# Build: docker build -t psgrad:latest .
# Another base that brings Python 3.11 with pip and this torch (a CPU build, a local mirror):
# --build-arg PSGRAD_BASE_IMAGE=... (compose passes $PSGRAD_BASE_IMAGE; docs/operations.md).
ARG PSGRAD_BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.6-cudnn9-runtime
FROM ${PSGRAD_BASE_IMAGE}

# Recent official images use the distribution's Python, marked externally managed (PEP 668);
# a container is its own environment, so pip may install into it.
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    THP_MEM_ALLOC_ENABLE=1

RUN groupadd --gid 10001 psgrad && useradd --uid 10001 --gid 10001 --create-home psgrad \
 && install -d -o 10001 -g 10001 /var/lib/psgrad  # gradient stores (a volume mounts here)

WORKDIR /app

# Dependencies first, the lock's exact versions (.ci/lock/server.txt, every file checked against
# its hash), so a code change does not reinstall them. The lock leaves torch out: the base
# image's is used as it is (--no-deps: nothing here downloads a second torch).
COPY .ci/lock/server.txt /tmp/server.txt
RUN python3 -m pip install --no-deps --require-hashes -r /tmp/server.txt && rm /tmp/server.txt

# Then the code, the documented way (the client, then the server); --no-deps: everything they
# need is installed above.
COPY pyproject.toml README.md ./
COPY client ./client
COPY service ./service
COPY models ./models
RUN python3 -m pip install --no-deps ./client . && python3 -m pip check \
 && rm -rf build client/build ./*.egg-info client/*.egg-info

# A numeric user, so that runtimes can check it is not root without reading /etc/passwd.
USER 10001:10001

# The CPU's compiled loops (numba), compiled here into the psgrad user's cache
# (~/.cache/psgrad/loops): a container on a host with the build's CPU reads them as it starts
# instead of compiling them; on another CPU each container compiles once (docs/operations.md).
RUN python3 -c "from service.fast_stats import warm_kernels; warm_kernels()"

EXPOSE 8000
# Checks the api; worker services in docker-compose.yml replace it with their own check.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]

ENTRYPOINT ["psgrad"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
