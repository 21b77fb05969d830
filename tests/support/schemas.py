"""Random JSON Schemas whose instances are bounded (strings with maxLength, integers with bounds, arrays with
maxItems, closed objects), so that a constrained output always completes: for tests through the mesh, where one
seeded list is sent at once (the engine's own tests draw theirs with hypothesis)."""

from __future__ import annotations

import random

NAMES = ("id", "name", "kind", "tags", "count", "ok", "note", "level", "items", "code")
PATTERNS = ("^[a-z]{1,6}$", "^[0-9]{3}-[0-9]{2}$", "^(red|green|blue)$")


def random_schema(rng: random.Random, depth: int = 2) -> dict:
    """One schema: a leaf, or (while depth lasts) a closed object, an array or an anyOf of two."""
    kind = rng.randrange(10 if depth > 0 else 7)
    if kind == 0:
        return {"type": "string", "maxLength": rng.randint(0, 12)}
    if kind == 1:
        lo = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 1000)}
    if kind == 2:
        return {"type": rng.choice(["boolean", "null"])}
    if kind == 3:
        return {"enum": rng.sample(["a", "b c", "d\"e", 1, -2, True, None], rng.randint(1, 4))}
    if kind == 4:
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind in (5, 6):
        return {"const": rng.choice(["x", "y z", 7])}
    if kind == 7:
        props = {n: random_schema(rng, depth - 1) for n in rng.sample(NAMES, rng.randint(1, 4))}
        return {"type": "object", "properties": props, "additionalProperties": False,
                "required": sorted(rng.sample(sorted(props), rng.randint(0, len(props))))}
    if kind == 8:
        lo = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth - 1), "minItems": lo, "maxItems": lo + 2}
    return {"anyOf": [random_schema(rng, depth - 1), random_schema(rng, depth - 1)]}


def random_schemas(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [random_schema(rng) for _ in range(n)]
