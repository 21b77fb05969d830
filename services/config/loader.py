"""Loading the mesh config: the file, then `MESHSERVE_<SECTION>__<KEY>` variables, then overrides (flags);
errors that name the layer, section and key."""

from __future__ import annotations

import typing
from pathlib import Path

from pydantic import (
    BaseModel,
    ValidationError,
)

from services.common.envs import config_keys
from services.config.sections import MeshConfig


class ConfigError(ValueError):
    """A config value that does not validate; the message names its source, section and key."""


def read_file(path: str | None) -> dict:
    """The raw mapping of a YAML or TOML mesh file ({} without a file)."""
    if not path:
        return {}
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    try:
        if path.endswith(".toml"):
            import tomllib
            raw = tomllib.loads(text)
        else:
            import yaml
            raw = yaml.safe_load(text) or {}
    except Exception as e:
        raise ConfigError(f"{path}: cannot parse ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the file must be a mapping of sections")
    return raw


def load_mesh_config(path: str | None, overrides: dict | None = None, env: dict | None = None) -> MeshConfig:
    """The whole validated mesh config: file, then MESHSERVE_<SECTION>__<KEY> variables, then overrides
    ({section: {key: value}}, e.g. from flags). Raises ConfigError naming file, section and key."""
    raw = read_file(path)
    layers = [(path or "defaults", raw), ("environment", env_overrides(env)), ("flags", overrides or {})]
    merged: dict = {}
    for _, layer in layers:
        for section, values in layer.items():
            if isinstance(values, dict) and isinstance(merged.get(section), dict):
                merged[section] = {**merged[section], **values}
            else:
                merged[section] = values
    try:
        return MeshConfig.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(describe(e, _source(e, layers))) from None


def _source(e: ValidationError, layers: list) -> str:
    """Which layer set the first failing value (the flags, the environment, or the file)."""
    loc = e.errors()[0]["loc"][:2] if e.errors() else ()
    for name, layer in reversed(layers):
        node = layer
        for part in loc:
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            if loc:
                return name
    return layers[0][0]


def describe(e: ValidationError, source: str) -> str:
    lines = []
    for err in e.errors():
        where = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            section = _model_at(err["loc"][:-1])
            known = ", ".join(section.model_fields) if section else ""
            lines.append(f"{source}: {where}: unknown {'section' if len(err['loc']) == 1 else 'key'}"
                         + (f" (known: {known})" if known else ""))
        else:
            msg = err["msg"].removeprefix("Value error, ")
            if not where:  # a check across sections: the message names the keys
                lines.append(f"{source}: {msg}")
                continue
            lines.append(f"{source}: {where}: {msg[:1].lower() + msg[1:]} (got {err.get('input')!r})")
    return "\n".join(lines)


def _model_at(loc: tuple):
    """The section model at an error's location (through lists of sections: tenants.0), or None."""
    model = MeshConfig
    for part in loc:
        if isinstance(part, int):
            args = typing.get_args(model)
            model = args[0] if args else None
            continue
        field = model.model_fields.get(part) if _is_model(model) else None
        if field is None:
            return None
        model = field.annotation
    return model if _is_model(model) else None


def _is_model(t) -> bool:
    return isinstance(t, type) and issubclass(t, BaseModel)


def env_overrides(env: dict | None = None) -> dict:
    """{section: {key: value}} from MESHSERVE_<SECTION>__<KEY> variables (values parsed as YAML scalars)."""
    import yaml

    out: dict = {}
    for name, value in config_keys(env).items():
        section, key = name.split("__", 1)
        if section in MeshConfig.model_fields:
            out.setdefault(section, {})[key] = yaml.safe_load(value) if value else value
    return out
