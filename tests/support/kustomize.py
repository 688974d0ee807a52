"""The part of kustomize that deploy/kubernetes/ uses, in Python, so CI renders the manifests
without kubectl: resources (files and kustomization folders), ``namespace``, ``images``,
``configMapGenerator`` from env files (``behavior: merge`` in an overlay), and JSON 6902
``patches`` aimed by kind and name.

Generated ConfigMaps keep their plain names (kustomize appends a hash of the contents and
rewrites the references; :func:`unhashed` takes that suffix off kubectl's output, so the two
renderings compare equal where kubectl is installed). Anything else in a kustomization is
refused, so a new feature cannot be skipped silently.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml

KNOWN = {"apiVersion", "kind", "namespace", "resources", "images", "configMapGenerator",
         "patches"}
CLUSTER_SCOPED = {"Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding",
                  "PersistentVolume", "StorageClass"}


def render(folder: Path) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize folder`` would print (generated names unhashed)."""
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(spec) - KNOWN
    if unknown:
        raise ValueError(f"{folder}: kustomization fields this renderer lacks: {unknown}")
    objects: list[dict[str, Any]] = []
    for resource in spec.get("resources", []):
        path = folder / resource
        if path.is_dir():
            objects += render(path)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for generator in spec.get("configMapGenerator", []):
        data: dict[str, str] = {}
        for env in generator.get("envs", []):
            data.update(read_env(folder / env))
        if generator.get("behavior", "create") == "merge":  # an overlay's values over the base's
            find_one(objects, "ConfigMap", generator["name"])["data"].update(data)
            continue
        objects.append({"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": generator["name"]}, "data": data})
    for patch in spec.get("patches", []):
        ops = yaml.safe_load((folder / patch["path"]).read_text())
        target = patch["target"]
        apply_json_patch(find_one(objects, target["kind"], target["name"]), ops)
    for image in spec.get("images", []):
        for obj in objects:
            for container in containers(obj):
                name, _, _tag = container["image"].partition(":")
                if name == image["name"]:
                    container["image"] = f"{image.get('newName', name)}:{image['newTag']}"
    if "namespace" in spec:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = spec["namespace"]
    return objects


def find_one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    hits = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    if len(hits) != 1:
        raise ValueError(f"{len(hits)} objects are {kind} {name}")
    return hits[0]


def read_env(path: Path) -> dict[str, str]:
    """KEY=VALUE lines (``#`` comments and blank lines skipped), as kustomize's ``envs``."""
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, sep, value = line.partition("=")
            if not sep:
                raise ValueError(f"{path}: not KEY=VALUE: {line!r}")
            out[key.strip()] = value
    return out


def pod_spec(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The pod template's spec of a workload (None for other kinds)."""
    if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return dict(obj["spec"]["template"]["spec"])
    return None


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod_spec(obj)
    if spec is None:
        return []
    return [*spec.get("initContainers", []), *spec["containers"]]


def apply_json_patch(doc: dict[str, Any], ops: list[dict[str, Any]]) -> None:
    """RFC 6902 add, remove and replace (what the overlays use), in place."""
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~")
                          for p in op["path"].split("/")[1:]]
        node: Any = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        key: Any = last
        if isinstance(node, list):
            key = len(node) if last == "-" else int(last)
        if op["op"] == "remove":
            del node[key]
        elif op["op"] == "replace":
            if isinstance(node, dict) and key not in node:
                raise KeyError(f"replace of a missing {op['path']}")
            node[key] = copy.deepcopy(op["value"])
        elif op["op"] == "add":
            if isinstance(node, list):
                node.insert(key, copy.deepcopy(op["value"]))
            else:
                node[key] = copy.deepcopy(op["value"])
        else:
            raise ValueError(f"unsupported patch op {op['op']}")


def unhashed(objects: list[dict[str, Any]], generated: set[str]) -> list[dict[str, Any]]:
    """kubectl's objects with the hash suffix taken off the generated ConfigMaps' names."""
    pattern = re.compile(rf"^({'|'.join(map(re.escape, generated))})-[a-z0-9]{{10}}$")

    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items()}
        if isinstance(node, list):
            return [strip(v) for v in node]
        if isinstance(node, str):
            return pattern.sub(r"\1", node)
        return node

    return [strip(obj) for obj in objects]
