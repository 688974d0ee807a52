"""Every default of the client in one place (openai-python's ``_constants.py``)."""

from __future__ import annotations

import httpx

ENV_URL = "PSGRAD_URL"
ENV_API_KEY = "PSGRAD_API_KEY"
DEFAULT_BASE_URL = "http://127.0.0.1:8000"

# Per-sample gradients of a large batch take a while; connecting should not.
DEFAULT_TIMEOUT = httpx.Timeout(300.0, connect=5.0)
DEFAULT_MAX_RETRIES = 2
INITIAL_RETRY_DELAY = 0.5  # seconds, doubled each retry, with jitter
READY_POLL_S = 0.5  # how often wait_ready asks /readyz where the server names no Retry-After
READY_ASK_S = 5.0  # the longest one /readyz may take to answer before it is asked again
MAX_RETRY_DELAY = 8.0
MAX_RETRY_AFTER = 60.0  # a Retry-After above this is not waited for: the error is raised
RETRY_STATUSES = frozenset({408, 429})  # and every 5xx
# What says a request was not applied, so that one that must not repeat may be sent again: no
# connection was made, or the server refused it before any work (timed out reading it, a
# quota, a full queue or a broker down)
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
REFUSED_STATUSES = frozenset({408, 429, 503})
# The client's name for every try of one request (POST /jobs, a DP step's POST
# /per-sample-grads, POST /dp-runs): the server makes the job or run once, and answers each try
# with it
IDEMPOTENCY_KEY = "Idempotency-Key"

# Job polling: start fast (small jobs finish in milliseconds), back off to a calm rate.
JOB_POLL_INITIAL = 0.05
JOB_POLL_MAX = 1.0

REQUEST_ID_HEADER = "X-Request-ID"
JOB_STATUS_HEADER = "X-Psgrad-Job-Status"
USER_AGENT = "psgrad-python"
