"""Strict loading, saving and describing of dataclass config trees, whatever the tree.

A tree is a dataclass whose fields are scalars, `Literal` choices, unions, tuples, lists or further
dataclasses; a root class has `validate() -> self`. `load_tree` reads a YAML recipe (`inherit:`
other recipes), applies `a.b=c` overrides and builds the tree field by field: an unknown or mistyped
key, or a value of the wrong type, raises `ConfigError` with a one-line message naming the key (and
the file it came from), so a typo in a 125K-step job fails in the first second instead of silently
training the wrong model. A key that was renamed still loads: a root class lists `RENAMES`
({old dotted key: new one}), and an old key in a recipe, an `inherit:` parent or an override is
moved to its new name with a one-line warning naming where it was (`upgrade_saved` does the same,
silently, for the config a checkpoint saved). `config_keys` and `config_sections` read what each
key means from the comments beside the fields (`megakd config keys`, docs/configuration.md).

The trees themselves live in `megakd.config` (pretraining) and `megakd.finetune.config`.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import functools
import inspect
import keyword
import logging
import math
import reprlib
import tokenize
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from megakd.errors import UserError, redact_values

log = logging.getLogger(__name__)

class ConfigError(UserError):
    """A config file or override is invalid; the message names the key."""


SHOWN_CHARS = 200
_shown = reprlib.Repr()
_shown.maxstring = _shown.maxother = _shown.maxlong = SHOWN_CHARS
_shown.maxlist = _shown.maxtuple = _shown.maxdict = 8
_shown.maxlevel = 3


def shown(value: Any) -> str:
    """`repr(value)` for an error message, at most ~SHOWN_CHARS characters: a 1 MB string or a deeply
    shared YAML structure would otherwise make the one-line message megabytes (or gigabytes) long."""
    text = _shown.repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


def check_choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{key}: expected one of {', '.join(map(str, choices))}, got {shown(value)}")


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """`typing.get_type_hints(cls)`, evaluated once per class (read-only): a config is resolved field by
    field, and `megakd repro --plan` resolves hundreds."""
    return typing.get_type_hints(cls)


def check_literals(obj: Any, prefix: str = "") -> None:
    """Every `Literal[...]`-typed field in a config dataclass tree holds one of its choices.

    The one place choices are checked: `_coerce` applies the same rule while parsing, and this
    covers values set in code before `validate()`.
    """
    hints = field_types(type(obj))
    for f in dataclasses.fields(obj):
        value, tp = getattr(obj, f.name), hints[f.name]
        if typing.get_origin(tp) is Literal:
            check_choice(prefix + f.name, value, typing.get_args(tp))
        elif dataclasses.is_dataclass(value):
            check_literals(value, f"{prefix}{f.name}.")


# ---------------------------------------------------------------------------------------------
# Building dataclasses from nested dicts, strictly.


def _coerce(value: Any, tp: Any, key: str, default: Any = None) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        check_choice(key, value, typing.get_args(tp))
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key, default)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if errors else f"{key}: unexpected value {shown(value)}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {shown(value)}")
        return _build(tp, value, key, default if isinstance(default, tp) else None)
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key}: expected a list of {len(args)} values, got {shown(value)}")
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is list:
        (arg,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {shown(value)}")
        return [_coerce(v, arg, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {shown(value)}")
    if tp is int:
        number = None
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif isinstance(value, float) and value.is_integer():
            number = int(value)
        if number is None:
            raise ConfigError(f"{key}: expected an integer, got {shown(value)}")
        # Every integer key is used as a 64-bit value somewhere (seeds, tensor sizes, counters); a
        # larger one would only fail later as an OverflowError deep inside torch or numpy.
        if not -2**63 <= number < 2**63:
            raise ConfigError(f"{key}: expected a 64-bit integer, got {shown(value)}")
        return number
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an integer beyond the float range: as good as inf
                number = math.inf
        elif isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{key}: expected a number, got {shown(value)}")
        # No key means anything with inf or nan (clip_norm uses 0 for "off"): a non-finite loss
        # weight, LR or temperature would only surface as NaN gradients hours into a run.
        if not math.isfinite(number):
            raise ConfigError(f"{key}: expected a finite number, got {shown(value)}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {shown(value)}")
    if tp is Any:
        return value
    raise ConfigError(f"{key}: unsupported type {tp}")


def config_key(field_name: str) -> str:
    """The config key of a dataclass field: a Python keyword is spelled with a trailing _ (`from_` → `from`)."""
    bare = field_name.removesuffix("_")
    return bare if bare != field_name and keyword.iskeyword(bare) else field_name


def _build(cls: type, data: dict, prefix: str = "", base: Any = None) -> Any:
    """Instantiate `cls` from `data`, starting from `base` (or the class defaults) field by field.

    Starting from the parent's default object keeps section-specific defaults (e.g. the
    generator's own peak LR) when an override touches only one key of that section.
    """
    hints = field_types(cls)
    fields = {config_key(f.name): f.name for f in dataclasses.fields(cls)}
    obj = copy.deepcopy(base) if base is not None else cls()
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in fields:
            close = difflib.get_close_matches(str(name), list(fields), n=1)
            hint = f"; did you mean '{prefix + '.' if prefix else ''}{close[0]}'?" if close else ""
            raise ConfigError(f"unknown config key '{key}'{hint}")
        attr = fields[name]
        setattr(obj, attr, _coerce(value, hints[attr], key, getattr(obj, attr)))
    return obj


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_recipe(path: Path, seen: tuple[Path, ...] = (), renames: Mapping[str, str] = types.MappingProxyType({})
                ) -> dict:
    """Read a YAML recipe, resolving `inherit: other.yaml` (relative to the file) recursively; each file's
    keys renamed by `renames` (a tree's `RENAMES`) are moved to their new names, with a warning naming it."""
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"{path}: circular 'inherit'")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    data = read_yaml_file(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    parents = data.pop("inherit", None) or []
    if isinstance(parents, str):
        parents = [parents]
    merged: dict = {}
    for parent in parents:
        merged = _merge(merged, read_recipe(path.parent / parent, (*seen, path), renames))
    return _merge(merged, _renamed(data, renames, f"in {path}"))


def _renamed(data: dict, renames: Mapping[str, str], where: str | None) -> dict:
    """`data` (changed in place) with each old key of `renames` moved to its new name; a warning names
    `where` the old key was (None: silently). Both names given is refused in one line."""
    for old, new in renames.items():
        *parents, leaf = old.split(".")
        section = _section(data, parents)
        if section is None or leaf not in section:
            continue
        *new_parents, new_leaf = new.split(".")
        target = _section(data, new_parents, create=True)
        if target is None:  # the new section holds a non-mapping: the build names that key
            continue
        if new_leaf in target:
            raise ConfigError(f"{old} and {new} both given{f' ({where})' if where else ''}: {old} is now called "
                              f"{new}; keep only {new}")
        target[new_leaf] = section.pop(leaf)
        if where is not None:
            log.warning("%s is now called %s (%s)", old, new, where)
    return data


def _section(data: dict, parts: list[str], create: bool = False) -> dict | None:
    """The mapping at `parts` below `data` (created if asked and absent); None if there is none."""
    for part in parts:
        if create and part not in data:
            data[part] = {}
        data = data.get(part)
        if not isinstance(data, dict):
            return None
    return data


def upgrade_saved(cls: type, saved: dict) -> dict:
    """A config dict saved by an older megakd (a checkpoint's config.yaml) as tree `cls` reads it today: in
    today's key names, and with each key added since at its default (a new key defaults to what megakd did
    before it existed), so that comparing it with the current config sees neither as a change."""
    return _with_defaults(_renamed(copy.deepcopy(saved), getattr(cls, "RENAMES", {}), None), config_to_dict(cls()))


def _with_defaults(saved: dict, defaults: dict) -> dict:
    for key, value in defaults.items():
        if key not in saved:
            saved[key] = copy.deepcopy(value)
        elif isinstance(value, dict) and isinstance(saved[key], dict):
            _with_defaults(saved[key], value)
    return saved


# Values a config may hold once YAML aliases are expanded. A recipe has a few hundred; anchors and
# aliases stay allowed (configs/electra-base.yaml shares one model section as `*base`), but a
# "billion laughs" document of a few hundred bytes would expand to billions.
MAX_YAML_VALUES = 100_000


class _Refused(Exception):
    """A YAML document megakd will not construct: (line, reason), named by the caller."""


class _ConfigLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` with a bound on alias expansion and on integer length, checked before any
    value is built (the composed node graph shares aliased nodes, so checking it is cheap)."""

    def compose_document(self):
        node = super().compose_document()
        _count_values(node, {}, set())
        return node

    def construct_yaml_int(self, node):
        try:
            return super().construct_yaml_int(node)
        except ValueError:  # Python refuses int() of more than 4300 digits
            reason = f"an integer of {len(node.value)} characters is too long (expected a config value)"
            raise _Refused(node.start_mark.line + 1, reason) from None


_ConfigLoader.add_constructor("tag:yaml.org,2002:int", _ConfigLoader.construct_yaml_int)


def _count_values(node: yaml.Node, sizes: dict[int, int], open_nodes: set[int]) -> int:
    """How many values `node` expands to, each shared (aliased) node counted at every use."""
    if id(node) in sizes:
        return sizes[id(node)]
    if id(node) in open_nodes:
        raise _Refused(node.start_mark.line + 1, "a YAML alias refers to a node that contains it")
    open_nodes.add(id(node))
    children = node.value if isinstance(node, yaml.SequenceNode) else (
        [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else [])
    total = 1 + sum(_count_values(child, sizes, open_nodes) for child in children)
    if total > MAX_YAML_VALUES:
        raise _Refused(node.start_mark.line + 1, f"YAML aliases expand this node to more than "
                       f"{MAX_YAML_VALUES} values (expected a config; share settings with inherit:)")
    open_nodes.discard(id(node))
    sizes[id(node)] = total
    return total


def load_yaml(text: str) -> Any:
    """Parse YAML as `yaml.safe_load` does, within `_ConfigLoader`'s bounds (raises `_Refused`). Each
    caller gets its own copy: `megakd repro --plan` loads the same recipes and overrides hundreds of
    times, and the pure-Python parser took most of its seconds."""
    return copy.deepcopy(_parsed(text))


@functools.lru_cache(maxsize=4096)
def _parsed(text: str) -> Any:
    return yaml.load(text, Loader=_ConfigLoader)


def read_yaml_file(path: Path) -> Any:
    """Parse a YAML file with `load_yaml`, with anything unreadable as a one-line `ConfigError` naming it."""
    try:
        return load_yaml(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a YAML text file (not UTF-8)") from None
    except _Refused as err:
        line, reason = err.args
        raise ConfigError(f"{path}, line {line}: {reason}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None


def parse_override(text: str) -> dict:
    """`a.b.c=value` → {'a': {'b': {'c': value}}}, the value parsed as YAML (so 1e-4, true, [1, 2] work)."""
    if "=" not in text:
        raise ConfigError(f"override {shown(text)}: expected key=value")
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {shown(text)}: empty key")
    try:
        value = load_yaml(raw) if raw != "" else ""
    except _Refused as err:
        raise ConfigError(f"override {key}: {err.args[1]}") from None
    except yaml.YAMLError:
        value = raw
    out: dict = {}
    node = out
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


def config_to_dict(cfg: Any) -> dict:
    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {config_key(f.name): plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (tuple, list)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(cfg)


def load_tree(cls: type, path: str | Path | None = None, overrides: list[str] = ()) -> Any:
    """Load a recipe (or the defaults) into the tree `cls`, apply overrides, build and validate it.

    Keys `cls.RENAMES` names by their old names are moved to the new ones, with a warning each."""
    renames = getattr(cls, "RENAMES", {})
    data = read_recipe(Path(path), renames=renames) if path else {}
    if path:  # the file alone first, so an error names where the bad value came from
        try:
            _build(cls, data)
        except ConfigError as err:
            raise ConfigError(f"{err} (in {path})") from None
    given: dict = {}
    for text in overrides:
        given = _merge(given, parse_override(text))
    data = _merge(data, _renamed(given, renames, "on the command line"))
    try:
        cfg = _build(cls, data)
    except ConfigError as err:
        raise ConfigError(f"{err} (on the command line)" if overrides else str(err)) from None
    return cfg.validate()


# ---------------------------------------------------------------------------------------------
# What each key means, read from the comments above and beside the fields (`megakd config keys`,
# docs/configuration.md), so the reference cannot drift from the code.


@dataclass(frozen=True)
class KeyDoc:
    """A leaf key of a config tree: its type, its default in that tree, the comment that documents it."""

    key: str
    type: str
    default: Any
    meaning: str


def config_keys(cls: type) -> list[KeyDoc]:
    """Every leaf key of the dataclass tree `cls`, in source order; defaults are those of `cls()`."""
    return [item for item in _walk(cls, cls(), "") if isinstance(item, KeyDoc)]


def config_sections(cls: type) -> dict[str, str]:
    """{section key: what it is} for every dataclass in the tree below `cls`, parents first.

    The text is the comment on the field that holds the section followed by its class docstring."""
    return dict(item for item in _walk(cls, cls(), "") if isinstance(item, tuple))


def _walk(cls: type, obj: Any, prefix: str):
    """(section key, text) for each section and a KeyDoc for each leaf below `obj`, in source order."""
    hints, meanings = field_types(cls), field_meanings(cls)
    for f in dataclasses.fields(cls):
        key, tp, value = prefix + config_key(f.name), hints[f.name], getattr(obj, f.name)
        if dataclasses.is_dataclass(tp):
            yield key, " ".join(filter(None, (meanings[f.name], _class_docstring(tp))))
            yield from _walk(tp, value, key + ".")
        else:
            yield KeyDoc(key, type_text(tp), value, meanings[f.name])


def field_meanings(cls: type) -> dict[str, str]:
    """{field: its comment} for dataclass `cls`: the comment lines right above the field, then the comment
    at the end of its line(s), as one line ("" where there is none). A field declared again in a subclass
    (another default) keeps its base class's comment unless it has one of its own."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):
        if dataclasses.is_dataclass(klass):
            out.update({name: text for name, text in _own_meanings(klass).items() if text or name not in out})
    return out


def _own_meanings(cls: type) -> dict[str, str]:
    """`field_meanings` of the fields declared in `cls`'s own body."""
    node, comments = _class_source(cls)
    out = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above, line = [], stmt.lineno - 1
        while comments.get(line, (False, ""))[0]:
            above.insert(0, comments[line][1])
            line -= 1
        after = [comments[n][1] for n in range(stmt.lineno, stmt.end_lineno + 1)
                 if n in comments and not comments[n][0]]
        out[stmt.target.id] = " ".join(" ".join([*above, *after]).split())
    return out


def _class_docstring(cls: type) -> str:
    """The class's own docstring, one line (without one, a dataclass's `__doc__` is its signature)."""
    return " ".join((ast.get_docstring(_class_source(cls)[0]) or "").split())


def _class_source(cls: type) -> tuple[ast.ClassDef, dict[int, tuple[bool, str]]]:
    tree, comments = _parsed_module(inspect.getsourcefile(cls))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    return node, comments


@functools.cache
def _parsed_module(path: str) -> tuple[ast.Module, dict[int, tuple[bool, str]]]:
    """The module's syntax tree and {line: (whole line is a comment, comment text)}."""
    source = Path(path).read_text(encoding="utf-8")
    lines = source.splitlines()
    comments = {}
    for tok in tokenize.generate_tokens(iter(source.splitlines(keepends=True)).__next__):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            comments[row] = (not lines[row - 1][:col].strip(), tok.string.lstrip("#").strip())
    return ast.parse(source), comments


def type_text(tp: Any) -> str:
    """A field's type as a recipe writes it: `electra|mlm` for a Literal, `[float, float]` for a pair."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "|".join(map(str, args))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_text(a) for a in args)
    if origin is tuple:
        return f"[{', '.join(type_text(a) for a in args)}]"
    if origin is list:
        return f"list[{type_text(args[0])}]"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def value_text(value: Any) -> str:
    """A value as YAML flow style writes it (`null`, `true`, `[0.9, 0.98]`, `""`), on one line."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, (list, tuple)):
        return f"[{', '.join(value_text(v) for v in value)}]"
    if value == "":
        return '""'
    return str(value)


def save_config(cfg: Any, path: str | Path) -> None:
    """``cfg`` as YAML at ``path`` (written aside, then renamed), credentials in URLs redacted."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(yaml.safe_dump(redact_values(config_to_dict(cfg)), sort_keys=False))
    tmp.replace(path)
