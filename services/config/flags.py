"""The flags of a service, generated from its config sections, and the config a service runs with."""

from __future__ import annotations

import argparse
import json
import types
import typing
from typing import Literal

from services.common import envs
from services.config.loader import ConfigError, load_mesh_config
from services.config.sections import MeshConfig


def add_section_flags(ap: argparse.ArgumentParser, section: str, prefix: str = "") -> None:
    """--{prefix}key flags for every key of a section (absent = not given); read back with flag_overrides()."""
    model = MeshConfig.model_fields[section].annotation
    g = ap.add_argument_group(f"{section} (the mesh file's {section} section)")
    for name, field in model.model_fields.items():
        flag, dest = "--" + prefix + name.replace("_", "-"), f"_{section}__{name}"
        kind, choices = _flag_type(field.annotation)
        var = f"{envs.CONFIG_PREFIX}{section.upper()}__{name.upper()}"
        help_text = (field.description or "") + f" (config {section}.{name}; env {var})"
        if kind is bool:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, dest=dest,
                           help=help_text)
        else:
            g.add_argument(flag, type=kind, choices=choices, default=argparse.SUPPRESS, dest=dest, help=help_text)


def flag_overrides(args: argparse.Namespace, *sections: str) -> dict:
    """{section: {key: value}} for the flags given on the command line."""
    out: dict = {}
    for dest, value in vars(args).items():
        section, _, key = dest.removeprefix("_").partition("__")
        if dest.startswith("_") and key and section in sections:
            out.setdefault(section, {})[key] = value
    return out


def _flag_type(annotation):
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in args if a is not type(None))
        args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Literal:
        return str, list(args)
    if annotation in (int, float, str, bool):
        return annotation, None
    if typing.get_origin(annotation) is typing.Annotated:
        return _flag_type(args[0])
    return json.loads, None  # mappings and nested sections: JSON on the command line


def add_config_flag(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", default=envs.CONFIG.get(),
                    help="the mesh config file (YAML or TOML; env MESHSERVE_CONFIG); this service reads its sections")


def config_from_args(ap: argparse.ArgumentParser, args: argparse.Namespace, *sections: str,
                     own: dict | None = None) -> MeshConfig:
    """The validated config of a service: --config file, environment, then its flags; errors exit via ap.error.
    own: {"section.key": value, None when not given}: the service's own flags for keys of the config (--mode for
    mesh.mode, ...), which override the file as the generated section flags do."""
    overrides = flag_overrides(args, *sections)
    for dotted, value in (own or {}).items():
        if value is not None:
            section, key = dotted.split(".", 1)
            overrides.setdefault(section, {})[key] = value
    try:
        return load_mesh_config(args.config, overrides)
    except ConfigError as e:
        ap.error(str(e))


def announce(service: str, cfg: MeshConfig, *names: str) -> dict:
    """Print, as one line `<service> config: {json}`, the config a service runs with (owned()); returns it."""
    out = owned(cfg, *names)
    print(f"{service} config: {json.dumps(out, sort_keys=True)}", flush=True)
    return out


def owned(cfg: MeshConfig, *names: str) -> dict:
    """The parts of cfg a service runs with: each name a section it owns ("kv") or one key it reads from another
    ("mesh.mode"); tenants by name only."""
    out: dict = {}
    for name in names:
        section, _, key = name.partition(".")
        if section == "tenants":
            out["tenants"] = [t.name for t in cfg.tenant_objects()]
            continue
        values = getattr(cfg, section).model_dump(mode="json")
        if key:
            out.setdefault(section, {})[key] = values[key]
        else:
            out[section] = values
    return out
