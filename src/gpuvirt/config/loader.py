"""Loading: file or text, overrides, and one ConfigError listing every problem.

A pydantic `ValidationError` never reaches a caller: each error becomes one
line ``dotted.key = value: reason``, with "did you mean" for unknown keys.
"""

from __future__ import annotations

import copy
import difflib
import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from gpuvirt import paths
from gpuvirt.config.model import HostConfig, InvalidConfig
from gpuvirt.config.sections import VFSettings
from gpuvirt.config.toml import show, toml_type
from gpuvirt.errors import ConfigError


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> HostConfig:
    """Read, merge and validate the host configuration.

    ``path`` None means ``$GPUVIRT_CONFIG``, then /etc/gpuvirt/gpuvirt.toml if
    it exists, then the built-in defaults. ``overrides`` are dotted keys
    (``{"sriov.vf_num": 8}``) with TOML-typed values, applied over the file;
    a None value means "not overridden". Raises ConfigError, never anything
    from pydantic.
    """
    if path is None:
        env = os.environ.get(paths.CONFIG_ENV)
        if env:
            return _load_file(Path(env), overrides, f" (from ${paths.CONFIG_ENV})")
        if paths.DEFAULT_CONFIG_PATH.exists():
            return _load_file(paths.DEFAULT_CONFIG_PATH, overrides, "")
        return _merge_and_build({}, overrides, "built-in defaults")
    return _load_file(Path(path), overrides, "")


def parse_config(
    text: str, overrides: Mapping[str, object] | None = None, *, source: str = "<string>"
) -> HostConfig:
    """Like `load_config`, from TOML text instead of a file."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: TOML syntax error: {e}") from None
    return _merge_and_build(data, overrides, source)


def config_from_dict(data: Mapping[str, Any], *, source: str = "<dict>") -> HostConfig:
    """Validate parsed TOML; every problem becomes one line of a ConfigError."""
    return _build(data, source, frozenset())


def parse_vf_settings(data: object, source: str = "VF settings") -> VFSettings:
    """`VFSettings` from a JSON-like object such as ``{"fb": "4GiB", "weight": 3}``.

    Raises ConfigError with one ``key = value: reason`` line per problem.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(
            f'{source}: expected an object such as {{"fb": "4GiB", '
            f'"weight": 2}}, got {toml_type(data)}'
        )
    try:
        return VFSettings.model_validate(data)
    except ValidationError as e:
        problems = [_describe(err, frozenset(), VFSettings) for err in e.errors(include_url=False)]
    raise ConfigError(f"{source}: " + "; ".join(problems))


def _load_file(path: Path, overrides: Mapping[str, object] | None, how: str) -> HostConfig:
    where = f"config file {path}{how}"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{where} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"{where} is a directory, not a TOML file") from None
    except PermissionError:
        raise ConfigError(f"{where} cannot be read: permission denied") from None
    except OSError as e:
        raise ConfigError(f"{where} cannot be read: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8 (byte {e.start}); TOML files are UTF-8") from None
    return parse_config(text, overrides, source=str(path))


def _merge_and_build(
    data: dict[str, Any], overrides: Mapping[str, object] | None, source: str
) -> HostConfig:
    keys: set[tuple[str, ...]] = set()
    if overrides:
        data = copy.deepcopy(data)
        for dotted, value in overrides.items():
            if value is None:
                continue
            parts = tuple(dotted.split("."))
            if not all(parts):
                raise ConfigError(f"override {dotted!r}: not a dotted key such as sriov.vf_num")
            node: Any = data
            for i, part in enumerate(parts[:-1]):
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    where = ".".join(parts[: i + 1])
                    raise ConfigError(
                        f"override {dotted!r}: {where} is {toml_type(node)}, not a table"
                    )
            node[parts[-1]] = value
            keys.add(parts)
        source += " with overrides"
    return _build(data, source, frozenset(keys))


def _build(
    data: Mapping[str, Any], source: str, override_keys: frozenset[tuple[str, ...]]
) -> HostConfig:
    if not isinstance(data, Mapping):
        raise ConfigError(f"invalid configuration ({source}): expected a table, got {data!r}")
    try:
        return HostConfig.model_validate(data)
    except ValidationError as e:
        problems = [_describe(err, override_keys) for err in e.errors(include_url=False)]
    except InvalidConfig as e:
        problems = e.problems
    raise ConfigError(
        f"invalid configuration ({source}):\n" + "\n".join(f"  {p}" for p in problems)
    )


def _dotted(loc: Sequence[int | str]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


_EXPECTED = {
    "int_type": "expected an integer",
    "float_type": "expected a number",
    "string_type": "expected a string",
    "path_type": "expected a path string",
    "list_type": "expected an array",
    "model_type": "expected a table",
    "model_attributes_type": "expected a table",
    "dict_type": "expected a table",
}


def _fields_at(loc: Sequence[int | str], root: type[BaseModel] = HostConfig) -> list[str]:
    """Field names of the model a location points into, for 'did you mean'."""
    model: Any = root
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return []
        annotation = field.annotation
        if getattr(annotation, "__origin__", None) is list:
            annotation = annotation.__args__[0]
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def _describe(
    err: Mapping[str, Any],
    override_keys: frozenset[tuple[str, ...]],
    root: type[BaseModel] = HostConfig,
) -> str:
    loc = tuple(err["loc"])
    key = _dotted(loc)
    kind = err["type"]
    value = err.get("input")
    ctx = err.get("ctx") or {}
    if kind == "missing":
        return f"{key}: missing; this key is required"
    if kind == "extra_forbidden":
        known = _fields_at(loc[:-1], root)
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f"did you mean {close[0]}?" if close else "known keys here: " + ", ".join(known)
        reason = f"unknown key; {hint}"
    elif kind == "literal_error":
        reason = f"must be one of {ctx.get('expected')}"
    elif kind == "value_error" and "error" in ctx:
        reason = str(ctx["error"])
    elif kind == "list_type" and loc == ("vf",):
        reason = f"expected an array of tables, got {toml_type(value)}: write each VF as [[vf]]"
    elif kind in _EXPECTED:
        reason = f"{_EXPECTED[kind]}, got {toml_type(value)}"
    else:
        reason = str(err.get("msg", kind))
    line = f"{key} = {show(value)}: {reason}"
    if any(loc[: len(k)] == k or k[: len(loc)] == loc for k in override_keys):
        line += " (set by an override)"
    return line
