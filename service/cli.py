"""The server side of the ``psgrad`` command: ``serve`` (api + embedded workers) and ``worker``.

Imported only when those commands run, so the ``psgrad`` command stays light for client use.
"""

from __future__ import annotations

import ipaddress
import logging

from service.config import Settings, get_settings

log = logging.getLogger("psgrad.serve")

EXIT_OK = 0
EXIT_REFUSED = 2


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def serve(
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    insecure_no_auth: bool = False,
    workers: int | None = None,
    log_level: str = "info",
    settings: Settings | None = None,
) -> int:
    """Run the api under uvicorn; without ``PSGRAD_REDIS_URL`` it also runs the worker threads.

    With no keys configured it refuses a non-loopback ``host`` unless ``insecure_no_auth``.
    """
    import uvicorn

    from service.api import create_app

    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = settings or get_settings()
    if workers is not None:
        settings = settings.model_copy(update={"workers": workers})
    if not (settings.api_key_set or settings.admin_key_set):
        if not is_loopback(host) and not insecure_no_auth:
            log.error(
                "refusing to serve on %s without API keys: anyone who reaches it could use it. "
                "Set PSGRAD_API_KEYS (and PSGRAD_ADMIN_KEYS), bind to 127.0.0.1, or pass "
                "--insecure-no-auth if a proxy in front of it authenticates",
                host,
            )
            return EXIT_REFUSED
        log.warning(
            "no API keys configured (PSGRAD_API_KEYS): running WITHOUT authentication on %s", host
        )
    mode = (
        "redis at " + settings.redis_url
        if settings.redis_url
        else (f"embedded broker, {settings.workers} worker thread(s)")
    )
    log.info("psgrad api on http://%s:%d (%s)", host, port, mode)
    app = create_app(settings)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False)
    uvicorn.Server(config).run()
    return EXIT_OK


def worker(device: str = "auto") -> int:
    """``psgrad worker``: one Redis worker process (:mod:`service.worker_process`)."""
    from service.worker_process import main

    return main(["--device", device])
