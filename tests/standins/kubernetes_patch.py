"""The three PATCH flavours the API server accepts for built-in types: JSON patch (RFC 6902),
JSON merge patch (RFC 7386) and the strategic merge patch.

The official client sends a dict body as ``application/strategic-merge-patch+json`` and a list
body as ``application/json-patch+json``; a provider that patches ``metadata.ownerReferences``
must see lists merged by key the way a real server merges them, or a test passes here and the
same patch loses an owner on a cluster."""

from __future__ import annotations

import copy
import json
from typing import Any

from tests.standins.kubernetes_api import bad_request, unsupported_media_type

# Lists whose patch strategy is "merge", by field name, with the key that identifies an item.
MERGE_KEYS: dict[str, str] = {
    "ownerReferences": "uid",
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "imagePullSecrets": "name",
    "conditions": "type",
}
# Lists of scalars whose strategy is "merge": the union is kept.
MERGED_SETS = frozenset({"finalizers"})

JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge, ``null`` removes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _merge_keyed_list(name: str, current: list[Any], patch: list[Any]) -> list[Any]:
    key = MERGE_KEYS[name]
    result = [copy.deepcopy(item) for item in current]
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise bad_request(f"map: {item} does not contain declared merge key: {key}")
        index = next((i for i, old in enumerate(result) if old.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if index is not None:
                del result[index]
        elif index is None:
            result.append(strategic_merge(None, item))
        else:
            result[index] = strategic_merge(result[index], item)
    return result


def strategic_merge(target: Any, patch: Any) -> Any:
    """The subset of the strategic merge patch that built-in objects need: maps merge,
    ``null`` deletes, lists named in ``MERGE_KEYS`` merge by key, ``$patch: replace|delete``
    directives apply, other lists replace."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    directive = patch.get("$patch")
    if directive == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue  # $setElementOrder/, $retainKeys, $deleteFromPrimitiveList/: hints
        current = result.get(key)
        if value is None:
            result.pop(key, None)
        elif key in MERGE_KEYS and isinstance(value, list):
            result[key] = _merge_keyed_list(
                key, current if isinstance(current, list) else [], value
            )
        elif key in MERGED_SETS and isinstance(value, list):
            merged = list(current) if isinstance(current, list) else []
            result[key] = merged + [item for item in value if item not in merged]
        else:
            result[key] = strategic_merge(current, value)
    for key, removed in patch.items():
        if key.startswith("$deleteFromPrimitiveList/") and isinstance(removed, list):
            name = key.split("/", 1)[1]
            result[name] = [item for item in result.get(name, []) if item not in removed]
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise bad_request(f"invalid JSON pointer: {path!r}")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def _walk(doc: Any, parts: list[str]) -> Any:
    for part in parts:
        if isinstance(doc, list):
            doc = doc[int(part)]
        elif isinstance(doc, dict) and part in doc:
            doc = doc[part]
        else:
            raise KeyError(part)
    return doc


def _apply_operation(doc: Any, operation: dict[str, Any]) -> Any:
    op = operation.get("op")
    parts = _pointer(str(operation.get("path", "")))
    if op in ("copy", "move"):
        value = copy.deepcopy(_walk(doc, _pointer(str(operation.get("from", "")))))
        if op == "move":
            doc = _apply_operation(doc, {"op": "remove", "path": operation["from"]})
        return _apply_operation(doc, {"op": "add", "path": operation["path"], "value": value})
    if op == "test":
        if _walk(doc, parts) != operation.get("value"):
            raise bad_request(f"testing value {operation.get('path')} failed")
        return doc
    if not parts:
        return copy.deepcopy(operation.get("value"))
    parent = _walk(doc, parts[:-1])
    last = parts[-1]
    if op == "remove":
        del parent[int(last) if isinstance(parent, list) else last]
    elif op in ("add", "replace") and isinstance(parent, list):
        index = len(parent) if last == "-" else int(last)
        if op == "add":
            parent.insert(index, copy.deepcopy(operation.get("value")))
        else:
            parent[index] = copy.deepcopy(operation.get("value"))
    elif op == "add" or (op == "replace" and last in parent):
        parent[last] = copy.deepcopy(operation.get("value"))
    else:
        raise KeyError(last)
    return doc


def json_patch(target: Any, operations: Any) -> Any:
    """RFC 6902 operations applied in order; a missing path fails the whole patch."""
    if not isinstance(operations, list):
        raise bad_request("json: cannot unmarshal object into Go value of type jsonpatch.Patch")
    doc = copy.deepcopy(target)
    for operation in operations:
        try:
            doc = _apply_operation(doc, operation)
        except (KeyError, IndexError, ValueError, TypeError) as error:
            message = f"the server rejected our request due to an error in our request: {error}"
            raise bad_request(message) from error
    return doc


def apply_patch(target: dict[str, Any], content_type: str, body: bytes) -> dict[str, Any]:
    """Apply a PATCH body by its content type, as the API server dispatches it."""
    media = content_type.split(";", 1)[0].strip().lower()
    if media not in (JSON_PATCH, MERGE_PATCH, STRATEGIC_PATCH):
        raise unsupported_media_type(media or "none")
    try:
        patch = json.loads(body or b"null")
    except ValueError as error:
        raise bad_request(f"error decoding patch: {error}") from error
    if media == JSON_PATCH:
        result = json_patch(target, patch)
    elif not isinstance(patch, dict):
        raise bad_request(
            "json: cannot unmarshal array into Go value of type map[string]interface {}"
        )
    elif media == MERGE_PATCH:
        result = merge_patch(target, patch)
    else:
        result = strategic_merge(target, patch)
    if not isinstance(result, dict):
        raise bad_request("the patched object is not an object")
    return result
