"""The request contract (psgrad._contract) against everything that reads it: a field or output
that exists on one side only (table, server validation, OpenAPI, client, chunk merger, server
output registry) fails here."""

from __future__ import annotations

import ast
import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from psgrad import AsyncClient, Client
from psgrad._contract import (
    FIELDS,
    ID_PATTERN,
    OUTPUT_NAMES,
    OUTPUTS,
    POSITIONAL,
    REF_PATTERN,
    REQUEST,
    RUN_ID_PATTERN,
    SAMPLE_FIELDS,
    Field,
    Options,
)
from psgrad._errors import BadRequest
from psgrad._merge import COMBINE, grads_plan
from psgrad._request import grads_fields
from service.api.body import held_to_contract, precheck
from service.api.schemas import GradsRequest
from service.outputs import OUTPUTS as SERVER_OUTPUTS
from service.validate import asked_outputs
from tests.support.api import open_client

ROOT = Path(__file__).resolve().parents[2]
# the modules that read a request's fields by name
READERS = ("service/validate/__init__.py", "service/validate/attribution.py", "service/dp/steps.py",
           "service/api/body.py", "service/api/routes/grads.py", "service/api/routes/jobs.py")
EXAMPLE_REF = {REF_PATTERN: "mlp", RUN_ID_PATTERN: "dp-" + "0" * 24, ID_PATTERN: "refs"}
# what psgrad._merge combines
MERGED = {"concat", "mean", "variance", "clipped_sum", "cosine", "gns"}


def example(spec: Field) -> Any:
    """A value the contract accepts for ``spec`` (numpy arrays for tensors)."""
    kind = spec.kind
    if kind == "ref":
        assert spec.pattern is not None
        value = EXAMPLE_REF[spec.pattern]
        assert re.fullmatch(spec.pattern, value)
        return value
    if kind in ("inputs", "tensor"):
        return np.ones((2, 3), dtype=np.float32)
    if kind == "tensors":
        return {"0.weight": np.ones((2, 3), dtype=np.float32)}
    if kind == "choice":
        return spec.choices[-1] if spec.choices else "mse"
    if kind == "names":
        return list(spec.choices[:1]) if spec.choices else ["0.weight"]
    if kind == "int":
        return int(spec.ge if spec.ge is not None else 0) + 1
    assert kind == "float", kind
    return 0.5


def test_server_validation_knows_every_field_and_reads_no_other() -> None:
    read: set[str] = set()
    for path in READERS:
        for node in ast.walk(ast.parse((ROOT / path).read_text())):
            name = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr == "get" and isinstance(node.func.value, ast.Name) and \
                    node.func.value.id == "fields" and node.args:
                name = node.args[0]
            elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and \
                    node.value.id == "fields":
                name = node.slice
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                read.add(name.value)
    assert read, "no field reads found: the scan is broken"
    assert read <= set(FIELDS), f"read by the server, not in the contract: {read - set(FIELDS)}"
    precheck({f.name: example(f) for f in REQUEST})  # no field refused as unknown
    held_to_contract({**{f.name: example(f) for f in REQUEST},  # nor a valid value refused
                      "outputs": ["dots"]})  # (an output that reads the reference fields)
    with pytest.raises(Exception, match="unknown fields: nope"):
        precheck({"model": "mlp", "nope": 1})


async def test_openapi_is_the_table() -> None:
    async with open_client() as c:
        schemas = (await c.get("/openapi.json")).json()["components"]["schemas"]
    request, response = schemas["GradsRequest"], schemas["GradsResponse"]
    assert list(request["properties"]) == [f.name for f in REQUEST]
    assert set(request["required"]) == {f.name for f in REQUEST if f.required}
    for spec in REQUEST:
        prop = request["properties"][spec.name]
        assert prop["description"] == spec.doc, spec.name
        if spec.default is not None:
            assert prop["default"] == spec.default, spec.name
        text = str(prop)
        for bound, key in (("ge", "minimum"), ("le", "maximum"), ("gt", "exclusiveMinimum"),
                           ("lt", "exclusiveMaximum")):
            if getattr(spec, bound) is not None:
                assert f"'{key}': {getattr(spec, bound)}" in text, (spec.name, bound)
    outputs = [k for k in response["properties"] if k in OUTPUT_NAMES]
    assert outputs == list(OUTPUT_NAMES)
    for out in OUTPUTS:
        assert response["properties"][out.name]["description"] == out.doc
    doc = {f.name: example(f) for f in REQUEST}
    doc = {k: [] if isinstance(v, np.ndarray) else {p: [] for p in v}
           if f.kind == "tensors" else v for (k, v), f in zip(doc.items(), REQUEST, strict=True)}
    doc["inputs"] = {"a": [], "b": 1.0}  # named inputs
    GradsRequest.model_validate(doc, strict=True)  # every field, as /jobs checks a body


def test_server_outputs_are_the_table() -> None:
    assert tuple(SERVER_OUTPUTS.names()) == OUTPUT_NAMES
    for out in OUTPUTS:
        served = SERVER_OUTPUTS[out.name]
        assert (served.description, served.per_sample, served.per_param,
                served.per_param_tensor, served.td0_only) == (
            out.doc, out.per_sample, out.per_param, out.per_param_tensor, out.td0_only)


@pytest.mark.parametrize("cls", [Client, AsyncClient])
def test_client_signatures_take_every_field(cls: type) -> None:
    options = set(Options.__annotations__)
    assert options == set(FIELDS) - set(POSITIONAL)
    for method in ("per_sample_grads", "submit", "td0"):
        params = inspect.signature(getattr(cls, method)).parameters
        assert str(params["options"].annotation) == "Unpack[Options]", method
        assert not (set(params) - {"self", "options"}) & options - {"rewards"}, method
    head = list(inspect.signature(cls.per_sample_grads).parameters)[1:4]
    assert head == list(POSITIONAL)
    doc = inspect.getdoc(cls.per_sample_grads) or ""
    missing = [f.name for f in REQUEST if not re.search(rf"\b{f.name}\b", doc)]
    assert not missing, f"per_sample_grads does not document {missing}"


def test_the_request_builder_sends_every_field_as_the_server_reads_it() -> None:
    sent = grads_fields("mlp", example(FIELDS["inputs"]), example(FIELDS["targets"]),
                        **{f.name: example(f) for f in REQUEST if f.name not in POSITIONAL})
    defaults = {"answer_dtype", "autocast", "verify"}  # unsent when the server's default
    assert set(sent) | defaults == set(FIELDS)
    precheck(sent)
    sent["inputs"] = {"a": np.ones((2, 3)), "b": np.zeros((2, 4))}  # named inputs too
    precheck(sent)
    with pytest.raises(TypeError, match="unexpected keyword argument 'nope'"):
        grads_fields("mlp", [[1.0]], nope=1)  # type: ignore[call-arg]


def test_the_merger_slices_every_per_sample_field_and_combines_every_output() -> None:
    assert set(COMBINE) == set(OUTPUT_NAMES) and set(COMBINE.values()) <= MERGED
    fields: dict[str, Any] = {"model": "mlp", "outputs": ["norms"]}
    for name in SAMPLE_FIELDS:
        rows = np.arange(5, dtype=np.float32)[:, None]
        fields[name] = {"a": rows, "b": -rows} if name == "inputs" else rows
    plan = grads_plan(fields, limit=2)
    sent = [next(plan)]
    starts = []
    try:
        while True:
            part = sent[-1]
            starts.append(int(part["inputs"]["a"][0, 0]))
            n = len(part["inputs"]["a"])
            for name in SAMPLE_FIELDS:
                value = part[name]["b"] if name == "inputs" else part[name]
                assert len(value) == n, name
                assert abs(int(value[0, 0])) == starts[-1], name
            sent.append(plan.send({"model": "mlp@v", "batch_size": n, "loss": "mse",
                                   "norms": np.ones(n, np.float32), "meta": {}}))
    except StopIteration as stop:
        assert stop.value.fields["batch_size"] == 5
    assert starts == [0, 2, 4]


def test_the_stores_bodies_share_the_contract_fields() -> None:
    from service.api.routes.stores import QueryBody, SamplesBody, StoreBody

    shared = 0
    for body in (StoreBody, SamplesBody, QueryBody):
        for name, prop in body.model_json_schema()["properties"].items():
            if name in FIELDS and name != "model":  # a store's model: its own meaning
                assert prop["description"] == FIELDS[name].doc, (body.__name__, name)
                shared += 1
    assert shared >= 5 + 5 + 4


# The one edit that adds two request fields: an option with a range and a per-sample tensor.
ADDED = '''
    temperature: Annotated[float | None, spec(
        "float", "a field added in one place: a positive number up to 4", gt=0.0, le=4.0)]
    sample_tag: Annotated[Any, spec(
        "tensor", "a field added in one place: one value per sample", per_sample=True)]
'''
# Run against that copy of the client package: the SDK, the OpenAPI document, the server's
# validation at the door (JSON and safetensors) and the chunk merger all take the new fields.
FOLLOW = '''
import httpx, numpy as np, torch
import psgrad
from psgrad._merge import grads_plan
from service.api import create_app
from tests.support.api import safetensors_body, serving, settings

assert psgrad.__file__.startswith(NEW), psgrad.__file__
x = np.random.default_rng(0).standard_normal((3, 784)).astype(np.float32)
y = [1, 2, 3]
tags = np.arange(3, dtype=np.float32)
with serving(create_app(settings())) as url, psgrad.Client(base_url=url) as client:
    schema = httpx.get(url + "/openapi.json").json()["components"]["schemas"]["GradsRequest"]
    prop = schema["properties"]["temperature"]
    assert "'maximum': 4.0" in str(prop) and prop["description"].startswith("a field added"), prop
    assert "sample_tag" in schema["properties"]
    plain = client.per_sample_grads("mlp", x, y, outputs=["norms"])
    added = client.per_sample_grads("mlp", x, y, outputs=["norms"], temperature=2.0,
                                    sample_tag=tags)
    assert np.array_equal(plain["norms"], added["norms"])  # taken, and used by nothing yet
    try:
        client.per_sample_grads("mlp", x, y, temperature=9.0)
        raise AssertionError("the SDK sent temperature=9")
    except psgrad.InvalidInput as exc:
        assert "'temperature'" in str(exc), exc
    doc = {"model": "mlp", "inputs": x.tolist(), "targets": y, "outputs": ["norms"]}
    for bad in (9.0, "hot"):
        for body, ctype in ((doc | {"temperature": bad}, None),
                            (safetensors_body(doc | {"temperature": bad}),
                             "application/x-safetensors")):
            r = (httpx.post(url + "/per-sample-grads", json=body, timeout=60) if ctype is None
                 else httpx.post(url + "/per-sample-grads", content=body, timeout=60,
                                 headers={"content-type": ctype}))
            assert r.status_code in (400, 422), (bad, r.status_code, r.text)
            assert "temperature" in r.json()["error"]["message"], r.text
plan = grads_plan({"model": "mlp", "inputs": x, "targets": np.array(y), "sample_tag": tags,
                   "temperature": 2.0, "outputs": ["norms"]}, limit=2)
part = next(plan)
assert part["sample_tag"].tolist() == [0.0, 1.0] and part["temperature"] == 2.0, part
print("followed")
'''


def test_a_field_added_in_one_place_reaches_every_reader(tmp_path: Path) -> None:
    package = tmp_path / "psgrad"
    shutil.copytree(ROOT / "client" / "psgrad", package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    contract = package / "_contract.py"
    anchor = ":data:`REQUEST` is read from here.\"\"\"\n"
    text = contract.read_text()
    assert text.count(anchor) == 1, "Options' docstring moved: update the anchor"
    contract.write_text(text.replace(anchor, anchor + ADDED))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(tmp_path), str(ROOT)))}
    done = subprocess.run([sys.executable, "-c", f"NEW = {str(package)!r}\n{FOLLOW}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("followed")


def test_every_refusal_of_a_field_names_the_field_and_what_was_sent() -> None:
    """Field.check, the one check of a field's value (the door's and the client's): a value of
    the wrong type, or out of the field's range, is refused naming the field and the value."""
    wrong = {"int": "x7", "float": "x7", "names": 7, "choice": 7, "ref": 7}
    checked = 0
    for spec in REQUEST:
        if spec.kind not in wrong:
            continue
        with pytest.raises(BadRequest) as info:
            spec.check(wrong[spec.kind])
        assert f"'{spec.name}'" in info.value.message and "7" in info.value.message, info.value
        checked += 1
        if spec.kind in ("int", "float") and (spec.le is not None or spec.lt is not None):
            with pytest.raises(BadRequest) as info:  # InvalidInput (422) for a float's range
                spec.check(10**30 if spec.kind == "int" else 1e30)
            message = info.value.message
            assert f"'{spec.name}'" in message and ("1e+30" in message or str(10**30) in message)
    assert checked >= 10, checked


def test_no_outputs_means_the_default_on_both_sides() -> None:
    """outputs=[] is ['grads'] to the server (service.validate.asked_outputs) and to the client,
    which used to refuse it; an empty params list is refused by both."""
    x, y = np.ones((2, 784), np.float32), np.array([1, 2])
    sent = grads_fields("mlp", x, y, outputs=[])
    assert sent["outputs"] == FIELDS["outputs"].default == asked_outputs({"outputs": []})
    with pytest.raises(BadRequest, match="'params' must name at least one"):
        grads_fields("mlp", x, y, params=[])
    with pytest.raises(BadRequest, match="'params' must be a non-empty list"):
        held_to_contract({"model": "mlp", "params": []})
