"""The fields of a gradients request, checked against the contract before anything is sent.

What the client can see is wrong without asking the server (an empty ``outputs``, a seed out of
range, a NaN option, a field the server does not take) is refused here, with the server's own
error classes; every field is read as :data:`psgrad._contract.REQUEST` declares it. The arrays
are made numpy (:func:`psgrad._arrays.to_numpy`) and cast to the model's dtype later, by the
client that can ask the server for it (:func:`psgrad._arrays.cast_floats`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from psgrad._arrays import param_arrays, to_numpy
from psgrad._contract import FIELDS, OUTPUT_NAMES, POSITIONAL, Field
from psgrad._errors import BadRequest
from psgrad._merge import Fields

if TYPE_CHECKING:
    from typing import Unpack

    from psgrad._contract import Options

__all__ = ["grads_fields"]


def grads_fields(model: str, inputs: Any, targets: Any = None,
                 **options: Unpack[Options]) -> Fields:
    """The request of ``per_sample_grads``, ``td0`` and ``submit``: unset options (None, and
    the defaults ``answer_dtype='float32'``, ``autocast='off'`` and ``verify=0``) left out."""
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a model id such as 'mlp' or 'id@version'")
    fields: Fields = {"model": model, "inputs": _value(FIELDS["inputs"], inputs)}
    given: dict[str, Any] = {"targets": targets, "outputs": ("grads",), **options}
    for name, value in given.items():
        spec = FIELDS.get(name)
        if spec is None or name in POSITIONAL[:2]:
            raise TypeError(f"unexpected keyword argument {name!r}: a request's fields are "
                            f"{', '.join(f for f in FIELDS if f not in POSITIONAL)}")
        if value is None or (name in _UNSENT and value == _UNSENT[name]):
            continue
        fields[name] = _value(spec, value)
    return fields


_UNSENT: dict[str, Any] = {"answer_dtype": "float32", "autocast": "off",  # the server's
                           "verify": 0}  # defaults


def _value(spec: Field, value: Any) -> Any:
    """``value`` as the wire carries ``spec``'s kind, checked where the client can check it."""
    name, kind = spec.name, spec.kind
    if kind == "tensor":
        return to_numpy(value, name)
    if kind == "inputs":  # one array, or {input name: array} for a model with several inputs
        if isinstance(value, Mapping):
            if not value:
                raise BadRequest("'inputs' as an object must name at least one input")
            return {str(k): to_numpy(v, f"inputs.{k}") for k, v in value.items()}
        return to_numpy(value, name)
    if kind == "tensors":
        return param_arrays(value, name)
    if kind == "names":
        names = [value] if isinstance(value, str) else [str(v) for v in value]
        if not names and spec.default is not None:  # outputs=[]: the default, as the server
            return list(spec.default)                 # reads it
        if not names:
            raise BadRequest(f"'{name}' must name at least one of: "
                             f"{', '.join(spec.choices or ('the parameters',))}")
        return names
    if kind == "float":
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise BadRequest(f"'{spec.name}' must be a number; got {value!r}") from None
    return spec.check(value)


assert FIELDS["outputs"].choices == OUTPUT_NAMES
