"""psgrad: per-sample gradients as a service. The light client: imports httpx, numpy, safetensors.

    import psgrad

    with psgrad.Client() as client:            # $PSGRAD_URL, $PSGRAD_API_KEY; or Client(url)
        result = client.per_sample_grads("simple-cnn", images, labels, outputs=["norms"])
        result.norms                           # numpy array [B]

The error tree is shared with the server (:mod:`psgrad._errors`); torch, fastapi and redis are
never imported by ``import psgrad``.
"""

from psgrad._async_client import AsyncClient
from psgrad._client import Client
from psgrad._errors import *  # noqa: F403
from psgrad._errors import __all__ as _errors_all
from psgrad._jobs import AsyncJob, Job
from psgrad._models import AsyncModels, Models
from psgrad._noise_scale import NoiseScale
from psgrad._progress import Progress
from psgrad._stores import AsyncStore, AsyncStores, QueryResult, Store, Stores
from psgrad._types import GradsResult, JobStatus, ModelInfo
from psgrad._version import ServerVersionWarning
from psgrad._version import __version__ as __version__

__all__ = [
    "AsyncClient",
    "AsyncJob",
    "AsyncModels",
    "AsyncStore",
    "AsyncStores",
    "Client",
    "GradsResult",
    "Job",
    "JobStatus",
    "ModelInfo",
    "Models",
    "NoiseScale",
    "Progress",
    "QueryResult",
    "ServerVersionWarning",
    "Store",
    "Stores",
    *_errors_all,
]
