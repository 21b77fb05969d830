"""Just enough of kustomize to build deploy/k8s without the binary: resources (files and folders), patches
(strategic merge: maps merged, lists of named items merged by name, other lists replaced, `$patch: delete`),
images (newName/newTag), namespace, and labels on metadata. And a strict check of an object against the
official `kubernetes` client's models: unknown fields, wrong types and missing required fields are errors."""

from __future__ import annotations

from pathlib import Path

import yaml

CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding"}


def load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def key(obj: dict) -> tuple:
    return obj["kind"], obj["metadata"]["name"]


def merge(base, patch):
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = merge(base[k], v) if k in base else v
        return out
    if (isinstance(base, list) and isinstance(patch, list) and base and patch
            and all(isinstance(x, dict) and "name" in x for x in base + patch)):
        out = list(base)
        names = [x["name"] for x in out]
        for item in patch:
            if item["name"] in names:
                i = names.index(item["name"])
                out[i] = merge(out[i], item)
            else:
                out.append(item)
        return out
    return patch


def build(folder: Path) -> list[dict]:
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert spec["kind"] == "Kustomization", folder
    objects: list[dict] = []
    for res in spec.get("resources", []):
        path = (folder / res).resolve()
        objects += build(path) if path.is_dir() else load_docs(path)
    for patch in spec.get("patches", []):
        for doc in load_docs(folder / patch["path"]):
            found = [i for i, o in enumerate(objects) if key(o) == key(doc)]
            assert found, f"{folder}: patch {patch['path']} targets {key(doc)}, which is not in the build"
            i = found[0]
            if doc.get("$patch") == "delete":
                del objects[i]
            else:
                objects[i] = merge(objects[i], doc)
    for image in spec.get("images", []):
        for obj in objects:
            for c in containers(obj):
                name, _, tag = c["image"].partition(":")
                if name == image["name"]:
                    c["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
    for obj in objects:
        if spec.get("namespace") and obj["kind"] not in CLUSTER_SCOPED:
            obj["metadata"]["namespace"] = spec["namespace"]
        for pairs in spec.get("labels", []):
            obj["metadata"].setdefault("labels", {}).update(pairs["pairs"])
    return objects


def pod_spec(obj: dict) -> dict | None:
    return obj["spec"]["template"]["spec"] if obj["kind"] in ("Deployment", "StatefulSet") else None


def containers(obj: dict, init: bool = True) -> list[dict]:
    spec = pod_spec(obj)
    if spec is None:
        return []
    return spec["containers"] + (spec.get("initContainers", []) if init else [])


def check(obj: dict) -> None:
    """Raise ValueError naming the path of the first field the API's model does not accept."""
    from kubernetes import client

    _value(obj, f"V1{obj['kind']}", client, obj["kind"])


def _value(value, type_name: str, client, path: str):
    scalars = {"str": str, "int": int, "bool": bool, "float": (int, float)}
    if type_name in scalars:
        ok = isinstance(value, scalars[type_name]) and not (type_name == "int" and isinstance(value, bool))
        if not ok:
            raise ValueError(f"{path}: expected {type_name}, got {value!r}")
        return value
    if type_name == "object":  # int-or-string, quantities
        return value
    if type_name.lower().startswith("list["):  # the client writes List[X]
        if not isinstance(value, list):
            raise ValueError(f"{path}: expected a list, got {value!r}")
        return [_value(v, type_name[5:-1], client, f"{path}[{i}]") for i, v in enumerate(value)]
    if type_name.lower().startswith(("dict[", "dict(")):  # Dict[str, X]
        if not isinstance(value, dict):
            raise ValueError(f"{path}: expected a map, got {value!r}")
        inner = type_name[5:-1].split(", ", 1)[1]
        return {k: _value(v, inner, client, f"{path}.{k}") for k, v in value.items()}
    cls = getattr(client, type_name)
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a {type_name} map, got {value!r}")
    by_json = {j: attr for attr, j in cls.attribute_map.items()}
    kwargs = {}
    for k, v in value.items():
        if k not in by_json:
            raise ValueError(f"{path}.{k}: not a field of {type_name}")
        kwargs[by_json[k]] = _value(v, cls.openapi_types[by_json[k]], client, f"{path}.{k}")
    try:
        return cls(**kwargs)
    except ValueError as e:  # a required field missing, or a value outside its enum
        raise ValueError(f"{path}: {e}") from None
