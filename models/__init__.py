"""The model zoo: one file per family, each registered by ``@register_model``.

Importing this package imports every family file so that the decorators run; an operator adds a
family by dropping a file here and adding it to the import below.
"""

from models import cnn, mlp, sequential, transformer, value
from models.base import ZOO, ModelFamily, TensorSpec, get_family, register_model

__all__ = ["ZOO", "ModelFamily", "TensorSpec", "cnn", "get_family", "mlp", "register_model",
           "sequential", "transformer", "value"]
