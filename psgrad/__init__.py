"""psgrad: per-sample gradients as a service. The light client: imports httpx, numpy, safetensors.

The SDK (``Client``, ``AsyncClient``) is added by the client issue; the error tree is shared with
the server.
"""

from psgrad._errors import *  # noqa: F403
from psgrad._errors import __all__ as _errors_all

__all__ = [*_errors_all]
__version__ = "0.1.0"
