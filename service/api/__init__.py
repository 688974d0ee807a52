"""The HTTP api: :func:`create_app` builds it (see :mod:`service.api.app`)."""

from service.api.app import create_app

__all__ = ["create_app"]
