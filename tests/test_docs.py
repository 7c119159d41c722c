"""The docs name only what exists: README.md and docs/*.md against the repository, the config
dataclasses and the real argument parser.

Docs drift silently when code moves (a renamed key, a deleted test, a reworded heading under a link),
so every code block and backtick span is read the way a user copies from it, and each name in it is
checked against the thing it names:

- repository paths (`megakd/engine/trainer.py`, `configs/x.yaml`, `launch/hostfile.example`, module
  paths inside megakd/ such as `engine/losses.py`, bare source names such as `test_kill.py`);
- pytest node ids (`tests/x.py::test_y`, `test_x.py::test_y[param]`, a bare `test_y`): the test exists;
- config keys with a section in front (`train.max_steps`, `model.*.fused_qkv`, `backend.name=deepspeed`):
  a field of `Config` (megakd/config.py) or `FinetuneConfig` (megakd/finetune/config.py), and a value
  among the choices of a `Literal` field;
- commands (`megakd <cmd> [<subcmd>] --flag key=value`, also behind launch/ scripts and `-m megakd.cli`):
  walked through `megakd.cli.build_parser()`, overrides checked against the command's config class;
  `python tools/x.py --flag`: a flag that tool's parser adds;
- relative links and images, `#anchors` included (GitHub heading slugs).

What is not checked, by rule: paths the user or a run creates (a first component that the checkout
does not hold or that .gitignore ignores: runs/, data/, corpus/, models/, hf-out/, /tmp/...),
placeholders (a component in capitals such as CONFIG, DIR, OUT; anything with <>, …, {}, $), code
blocks that are not shell (json, python), and lines of unlabeled blocks that are not commands
(diagrams, directory listings, output). `ALLOWED` lists the few remaining exceptions, each with why.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import fnmatch
import math
import re
import shlex
import typing
from functools import cache
from pathlib import Path
from typing import Literal
from urllib.parse import unquote

import pytest

from megakd.cli import build_parser
from megakd.config import Config
from megakd.configio import config_key
from megakd.finetune.config import FinetuneConfig
from megakd.glue.config import GlueConfig

ROOT = Path(__file__).parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Names that look like a path or a config key but are neither; each with the reason.
ALLOWED = {
    "run.forward": "a method of the MicroBatch run a backend hands a layout (docs/architecture.md)",
    "run.backward": "a method of the MicroBatch run a backend hands a layout (docs/architecture.md)",
    "backend.train_step": "the backend contract's method (docs/architecture.md), not the backend.* section",
    "config.yaml": "the resolved config a run and every checkpoint write, not a recipe",
    "model.yaml": "the description file of a megakd model directory, not a recipe",
    "other.yaml": "the placeholder of the `inherit: other.yaml` syntax",
    "configs/x.yaml": "the placeholder file name of an error message's example",
    "key": "the placeholder of the `key=value` override syntax",
}
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
SOURCE_SUFFIXES = (".py", ".sh", ".sbatch", ".yaml", ".md", ".example")
BARE_SUFFIXES = (".py", ".sh", ".sbatch", ".yaml")  # a bare name with one of these is a repository file
COMMAND_WORDS = ("megakd", "python", "python3", "torchrun", "sbatch", "launch/", "bash", "pip", "TRITON_INTERPRET=")
PLACEHOLDER = re.compile(r"[<>…{}$|]|\.\.\.|^[A-Z][A-Z0-9_]*$")
OVERRIDE = re.compile(r"^([A-Za-z_][\w.*]*)=(.*)$")
KEY = re.compile(r"^([a-z_][a-z0-9_]*(?:\.[a-z0-9_*]+)+)(.*)$")
CONFIG_CLASSES = (Config, FinetuneConfig, GlueConfig)
CONFIG_FILES = {Config: "megakd/config.py", FinetuneConfig: "megakd/finetune/config.py",
                GlueConfig: "megakd/glue/config.py"}
SECTIONS = {config_key(f.name) for cls in CONFIG_CLASSES for f in dataclasses.fields(cls)}
FILE_EXTENSIONS = {"safetensors", "yaml", "yml", "json", "jsonl", "py", "pt", "bin", "md", "txt", "npy", "png", "gz"}


# ---------------------------------------------------------------------------------------------
# Reading markdown: code blocks, code spans, links, headings (each with its line number).


@dataclasses.dataclass
class Markdown:
    path: Path
    spans: list[tuple[int, str]]  # inline code outside blocks
    commands: list[tuple[int, str, bool]]  # (line, logical line of a code block, block is labeled shell)
    links: list[tuple[int, str]]
    anchors: set[str]


def read_markdown(path: Path) -> Markdown:
    doc = Markdown(path, [], [], [], set())
    fence, lang, pending, slugs = None, "", None, {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        opening = re.match(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)", line)
        if fence is None and opening:
            fence, lang = opening.group(1), opening.group(2).lower()
            continue
        if fence is not None:
            if line.strip().startswith(fence):
                fence = None
            elif lang in SHELL_LANGS:
                start, text = pending or (number, "")
                text += line
                pending = (start, text[:-1] + " ") if line.endswith("\\") else None
                if pending is None:
                    doc.commands.append((start, text, lang != ""))
            continue
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            doc.anchors.add(_slug(heading.group(1), slugs))
        doc.anchors.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", line))
        doc.spans += [(number, m.group(2)) for m in re.finditer(r"(`+)(.+?)\1", line)]
        prose = re.sub(r"(`+)(.+?)\1", "", line)
        doc.links += [(number, m.group(1)) for m in re.finditer(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\)", prose)]
        doc.links += [(number, m.group(1)) for m in re.finditer(r"<img[^>]*\ssrc=\"([^\"]+)\"", prose)]
        doc.links += [(number, m.group(1)) for m in re.finditer(r"^\s*\[[^\]]+\]:\s*(\S+)", prose)]
    return doc


def _slug(heading: str, seen: dict[str, int]) -> str:
    """GitHub's anchor for a heading: its text, lowercased, punctuation dropped, spaces to hyphens, -N for repeats."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("*", "")
    slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
    count = seen.get(slug, 0)
    seen[slug] = count + 1
    return f"{slug}-{count}" if count else slug


# ---------------------------------------------------------------------------------------------
# What the names are checked against.


@cache
def repository_roots() -> frozenset[str]:
    """Top-level entries of the checkout that the repository holds (not ignored by .gitignore)."""
    ignore = [p.strip().strip("/") for p in (ROOT / ".gitignore").read_text().splitlines()
              if p.strip() and not p.startswith("#")]
    return frozenset(p.name for p in ROOT.iterdir() if not any(fnmatch.fnmatch(p.name, g) for g in ignore))


@cache
def files_named(name: str) -> tuple[Path, ...]:
    return tuple(p for root in repository_roots() if (ROOT / root).is_dir() for p in (ROOT / root).rglob(name))


@cache
def defined_tests(path: Path) -> frozenset[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return frozenset(n.name for n in ast.walk(tree)
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test"))


@cache
def all_defined_tests() -> frozenset[str]:
    return frozenset().union(*(defined_tests(p) for p in (ROOT / "tests").rglob("test_*.py")))


@cache
def tool_flags(path: Path) -> frozenset[str]:
    """Option strings of every `add_argument(...)` call in a tool script (read, not run: tools import torch/CUDA)."""
    calls = [n for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "add_argument"]
    return frozenset(a.value for c in calls for a in c.args if isinstance(a, ast.Constant) and str(a.value)[:1] == "-")


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser] | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return None


@cache
def known_flags() -> frozenset[str]:
    """Every flag a doc may name on its own: megakd's parsers, the tools' parsers, and the launchers' own."""
    flags, stack = set(), [build_parser()]
    while stack:
        parser = stack.pop()
        flags.update(parser._option_string_actions)
        stack.extend((subcommands(parser) or {}).values())
    for tool in (ROOT / "tools").glob("*.py"):
        flags |= tool_flags(tool)
    for script in (ROOT / "launch").iterdir():
        flags.update(re.findall(r"(--[\w-]+)", script.read_text(encoding="utf-8")))
    return frozenset(flags)


def config_fields(key: str, classes=CONFIG_CLASSES) -> list[typing.Any]:
    """The type hints of the fields `key` names (a `*` in a part matches any field); [] if none."""
    found = []
    for cls in classes:
        level = [cls]
        for part in key.split("."):
            nxt = []
            for tp in level:
                if not dataclasses.is_dataclass(tp):
                    continue
                hints = typing.get_type_hints(tp)
                nxt += [hints[f.name] for f in dataclasses.fields(tp) if fnmatch.fnmatchcase(config_key(f.name), part)]
            level = [a for tp in nxt for a in (typing.get_args(tp) if typing.get_origin(tp) is typing.Union else [tp])]
        found += level
    return found


# ---------------------------------------------------------------------------------------------
# The checks; each returns problems as messages.


def check_path(token: str) -> list[str]:
    token = token.strip("\"'()[],;:").removeprefix("./")
    if "::" in token or not token or token in ALLOWED or token.startswith(("/", "~", "-")):
        return []
    parts = [p for p in token.split("/") if p]
    if not parts or any(PLACEHOLDER.search(p) for p in parts):
        return []
    first, name = parts[0], parts[-1]
    if "/" not in token:
        if not name.endswith(BARE_SUFFIXES) or "*" in name or name.startswith("."):
            return []  # not a file name, a glob or an extension (`.py`)
        where = [ROOT / "configs" / name] if name.endswith(".yaml") else files_named(name)
        return [] if any(p.exists() for p in where) else [f"file `{token}` is not in the repository"]
    if first in repository_roots():
        candidates = [ROOT / token]
    elif name.endswith(SOURCE_SUFFIXES) and (ROOT / "megakd" / first).is_dir():
        candidates = [ROOT / "megakd" / token]  # engine/losses.py: a module path inside megakd/
    else:
        return []  # a path the user or a run creates (runs/, data/, corpus/, models/, ...)
    for path in candidates:
        if "*" in token and any(path.parent.glob(path.name)) or path.exists():
            return []
    return [f"path `{token}` does not exist"]


def check_test_id(token: str) -> list[str]:
    token = token.strip("\"'(),;:")
    file_part, _, rest = token.partition("::") if "::" in token else ("", "", token)
    name = re.split(r"[\[:]", rest, maxsplit=1)[0]
    if file_part:
        files = [ROOT / file_part] if "/" in file_part else [p for p in (ROOT / "tests").rglob(file_part)]
        files = [p for p in files if p.is_file()]
        if not files:
            return [f"test file `{file_part}` does not exist"]
        names = frozenset().union(*(defined_tests(p) for p in files))
    else:
        names = all_defined_tests()
    if not name or name == "…":
        return []
    pattern = name.replace("…", "*")
    if any(fnmatch.fnmatchcase(n, pattern) for n in names):
        return []
    return [f"test `{token}`: no test function {name} in {file_part or 'tests/'}"]


def check_key(token: str, classes=CONFIG_CLASSES, value: str | None = None) -> list[str]:
    """A `section.key` (with `=value`, `: value`, `>1` ... after it) names a config field."""
    m = KEY.match(token)
    if not m or m.group(1).split(".")[0] not in SECTIONS or m.group(2)[:1] in ("(", "/"):
        return []
    key, tail = m.group(1), m.group(2)
    if key in ALLOWED or key.rsplit(".", 1)[-1] in FILE_EXTENSIONS:
        return []
    fields = config_fields(key, classes)
    if not fields:
        names = " or ".join(f"{c.__name__} ({CONFIG_FILES[c]})" for c in classes)
        return [f"config key `{key}` is not a field of {names}"]
    if value is None and tail.startswith("="):
        value = tail[1:]
    choices = list(dict.fromkeys(c for f in fields if typing.get_origin(f) is Literal for c in typing.get_args(f)))
    if value and choices and all(typing.get_origin(f) is Literal for f in fields):
        bad = [v for v in value.split("|") if v and not PLACEHOLDER.search(v) and v not in map(str, choices)]
        if bad:
            return [f"config value `{key}={value}`: {', '.join(bad)} is not one of {', '.join(map(str, choices))}"]
    return []


def check_name(token: str) -> list[str]:
    """One word of prose code: a test id, a config key or a path (whichever it looks like)."""
    if "::" in token or re.match(r"^test_\w", token) and not token.endswith(".py"):
        return check_test_id(token)
    problems = check_key(token)
    m = OVERRIDE.match(token)
    return problems + check_path(m.group(2) if m else token)


def check_megakd(words: list[str]) -> list[str]:
    """`megakd` arguments, walked through the real parser: commands, flags, choices, override keys."""
    parsers, chain, problems = [build_parser()], "megakd", []
    classes, pending, flags_seen = CONFIG_CLASSES, 0, False
    for raw in words:
        word = raw.strip("[]()")
        if not word or word in ("...", "…", "|"):
            continue
        if word.startswith("-") and not re.match(r"^-\d", word):
            flag = word.split("=", 1)[0]
            missing = [p for p in parsers if flag not in p._option_string_actions]
            if missing:
                problems.append(f"`{chain} {flag}`: {chain} has no option {flag}")
                pending = 0
                continue
            nargs = parsers[0]._option_string_actions[flag].nargs
            pending = 0 if nargs == 0 or "=" in word else math.inf if nargs in ("+", "*") else nargs or 1
            flags_seen = True
            continue
        if pending:
            pending -= 1
            problems += check_path(word)
            continue
        override = OVERRIDE.match(word)
        if override:  # on a megakd command line every key=value is an override: its key must exist
            key = override.group(1)
            if key not in ALLOWED and not PLACEHOLDER.search(key):
                problems += check_key(word, classes) if KEY.match(key) and key.split(".")[0] in SECTIONS else [
                    f"`{chain} {word}`: {key} is not a config key"]
            problems += check_path(override.group(2))
            continue
        subs = subcommands(parsers[0])
        if subs is not None and not flags_seen:
            names = [w for w in word.split("|") if w and not PLACEHOLDER.search(w)]
            unknown = [w for w in names if w not in subs]
            if unknown:  # the rest of the line belongs to a command that does not exist
                return [*problems, f"`{chain} {word}`: {chain} has no command {', '.join(unknown)}"]
            if names:
                parsers, chain = [subs[w] for w in names], f"{chain} {names[0]}"
                classes = {"finetune": (FinetuneConfig,), "glue": (GlueConfig,)}.get(names[0], (Config,))
            continue
        choices = [a.choices for a in parsers[0]._actions if not a.option_strings and a.choices and subs is None]
        for alternative in word.split("|"):
            if choices and not flags_seen and re.match(r"^[a-z_]+$", alternative) and alternative not in choices[0]:
                problems.append(f"`{chain} {alternative}`: expected one of {', '.join(choices[0])}")
        problems += check_path(word)
    return problems


def check_command(text: str) -> list[str]:
    """A shell line: megakd (directly, behind a launch/ script or `-m megakd.cli`), a tool, or anything else."""
    code, _, comment = (re.split(r"(^|\s)#", text, maxsplit=1) + ["", ""])[:3]  # a comment is prose: names only
    problems = [p for word in comment.split() for p in check_name(word)]
    # A command substitution, `$(megakd plan ... --emit-overrides)`, is a command of its own; its output is a
    # placeholder in the line around it.
    for inner in re.findall(r"\$\(([^()]*)\)", code):
        problems += check_command(inner)
    code = re.sub(r"\$\([^()]*\)", "$SUBSTITUTED", code)
    for segment in re.split(r"&&|\|\||;|\s\|\s", code):
        try:
            words = shlex.split(segment)
        except ValueError:
            words = segment.split()
        for i, word in enumerate(words):
            if word == "megakd" or word == "megakd.cli" and i and words[i - 1] == "-m":
                return problems + check_megakd(words[i + 1:])
            if word.startswith("launch/") and word.endswith((".sh", ".sbatch")):
                problems += check_path(word)
                rest = words[i + 1:]
                subs = subcommands(build_parser())
                start = next((j for j, w in enumerate(rest) if w == "-c" or w in subs), None)
                if start is None:
                    return problems + check_megakd(["pretrain", *(w for w in rest if OVERRIDE.match(w))])
                return problems + check_megakd(["pretrain", *rest[start:]] if rest[start] == "-c" else rest[start:])
            if word.startswith("tools/") and word.endswith(".py"):
                problems += check_path(word)
                flags = tool_flags(ROOT / word) if (ROOT / word).is_file() else frozenset()
                problems += [f"`python {word} {w}`: {word} has no option {w.split('=')[0]}"
                             for w in words[i + 1:] if flags and w.startswith("--") and w.split("=")[0] not in flags]
                return problems
            problems += check_name(word)
    return problems


def check_span(text: str) -> list[str]:
    """A backtick span of prose: a command, a flag, `key: value`, or words each checked by what they look like."""
    if re.match(r"^(megakd|python3?|torchrun|launch/|bash|sbatch)\b", text):
        return check_command(text)
    flag = re.match(r"^(--?[\w-]+)", text)
    if flag:
        if flag.group(1) in known_flags():
            return []
        return [f"option `{flag.group(1)}` is not megakd's, a tool's or a launcher's"]
    colon = re.match(r"^([\w.*]+):\s+(\S+)$", text)
    if colon:
        return check_key(colon.group(1), value=colon.group(2))
    return [p for word in text.split() for p in check_name(word)]


def check_link(doc: Path, target: str) -> list[str]:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("//"):
        return []  # http:, https:, mailto:
    where, _, anchor = unquote(target).partition("#")
    path = (doc.parent / where).resolve() if where else doc
    if not path.exists():
        return [f"link `{target}`: {where} does not exist"]
    if anchor and path.suffix == ".md" and anchor not in read_markdown(path).anchors:
        return [f"link `{target}`: no heading with anchor #{anchor} in {path.name}"]
    return []


def check_markdown(path: Path) -> list[str]:
    """Every problem in one markdown file, as `file:line: what is missing`."""
    doc = read_markdown(path)
    name = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
    found = []
    for line, text in doc.spans:
        found += [(line, p) for p in check_span(text)]
    for line, text, shell in doc.commands:
        stripped = text.strip()
        if not shell:  # an unlabeled block: only its command lines, without the description after 3+ spaces
            if not stripped.startswith(COMMAND_WORDS):
                continue
            stripped = re.split(r"\s{3,}", stripped)[0]
        found += [(line, p) for p in check_command(stripped)]
    for line, target in doc.links:
        found += [(line, p) for p in check_link(path, target)]
    return [f"{name}:{line}: {problem}" for line, problem in sorted(found)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_docs_name_only_what_exists(doc):
    problems = check_markdown(doc)
    assert not problems, f"{len(problems)} stale names:\n" + "\n".join(problems)


PLANTED = """\
# Planted

## A heading

Run `megakd pretrain -c configs/electra-tiny.yaml train.max_stpes=3` and `megakd pretrian -c x`.
The code is in `megakd/engine/trainers.py`; see `tests/engine/test_trainer.py::test_no_such_test`.
Set `backend.name=deepspeed` or `backend.name=gpu`; `optim.generator.learning_rate` is no key.
Links: [ok](#a-heading), [gone](#no-heading), [file](missing.md), [other](other.md#planted).

```bash
megakd finetune -c configs/finetune-rt.yaml --resum auto labelreg.alpha=0.5 train.max_steps=3
python tools/gpu_check.py --fast
```
"""


def test_each_kind_of_stale_name_is_reported_with_its_line(tmp_path):
    doc = tmp_path / "planted.md"
    doc.write_text(PLANTED)
    (tmp_path / "other.md").write_text("# Planted\n")
    problems = check_markdown(doc)
    expected = [
        (5, "config key `train.max_stpes`"),
        (5, "megakd has no command pretrian"),
        (6, "path `megakd/engine/trainers.py` does not exist"),
        (6, "no test function test_no_such_test in tests/engine/test_trainer.py"),
        (7, "config value `backend.name=gpu`: gpu is not one of"),
        (7, "config key `optim.generator.learning_rate`"),
        (8, "no heading with anchor #no-heading in planted.md"),
        (8, "link `missing.md`: missing.md does not exist"),
        (11, "megakd finetune has no option --resum"),
        (11, "config key `train.max_steps` is not a field of FinetuneConfig (megakd/finetune/config.py)"),
        (12, "tools/gpu_check.py has no option --fast"),
    ]
    for line, text in expected:
        assert any(p.startswith(f"{doc}:{line}: ") and text in p for p in problems), (line, text, problems)
    assert len(problems) == len(expected), problems


def test_user_paths_placeholders_and_good_names_pass(tmp_path):
    doc = tmp_path / "good.md"
    doc.write_text(
        "# Good\n\n`runs/electra-tiny/hf/discriminator`, `data/shards`, `corpus/`, `/tmp/x.yaml`, `CONFIG`,\n"
        "`megakd pretrain -c CONFIG [--resume auto|PATH] [key=value ...]`, `model.*.fused_qkv`, `train.probe_*`,\n"
        "`init.from=PATH`, `engine/losses.py`, `test_kill.py`, `megakd repro dwt --quick`, `launch/*.sh`,\n"
        "`finetune.lr: auto`, [top](#good), `--allow-change`.\n\n"
        "```\nmegakd data shards --input corpus/ --tokenizer DIR --seq-len N --out DIR   description words\n```\n"
        "```bash\nlaunch/torchrun.sh 2 finetune -c configs/finetune-rt.yaml backend.name=ddp  # a comment\n"
        "megakd convert to-hf SRC OUT --force\n```\n")
    assert check_markdown(doc) == []


# ---------------------------------------------------------------------------------------------
# Figures that come from code (tools/doc_figures.py): generated, never typed.


@cache
def _doc_figures():
    import importlib.util

    spec = importlib.util.spec_from_file_location("doc_figures", ROOT / "tools" / "doc_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_figures_in_the_docs_are_what_the_code_gives_now():
    """The planner's rows, the storage example, the findings' scale gap and which findings older code
    measured: a change to the code that moves one fails here until `python tools/doc_figures.py --write`."""
    problems = _doc_figures().stale_blocks()
    assert not problems, "\n".join(problems) + "\n(regenerate: python tools/doc_figures.py --write)"


def test_a_stale_or_missing_figure_block_is_named_and_rewritten_in_place(tmp_path):
    figures = _doc_figures()
    (tmp_path / "a.md").write_text("Before <!-- figures:speed -->1.18 s<!-- /figures:speed --> after.\n"
                                   "<!-- figures:other -->kept<!-- /figures:other -->\n")
    table = {"speed": ("a.md", lambda: "1.15 s"), "rows": ("a.md", lambda: "x")}
    assert figures.stale_blocks(tmp_path, table) == [
        "a.md: figures:speed is stale: the code now gives '1.15 s'", "a.md: no <!-- figures:rows --> block"]
    assert figures.write_blocks(tmp_path, table) == ["speed"]
    assert (tmp_path / "a.md").read_text() == ("Before <!-- figures:speed -->1.15 s<!-- /figures:speed --> after.\n"
                                               "<!-- figures:other -->kept<!-- /figures:other -->\n")
    assert figures.stale_blocks(tmp_path, {"speed": table["speed"]}) == []


def test_a_command_substitution_is_checked_as_its_own_command():
    line = ("launch/torchrun.sh 8 -c configs/electra-tiny.yaml train.max_steps=2 "
            "$(megakd plan configs/electra-base.yaml --gpus 8 --gpu-mem 80 --emit-overides)")
    assert check_command(line) == ["`megakd plan --emit-overides`: megakd plan has no option --emit-overides"]


def test_a_fingerprinted_figure_is_stale_when_its_code_changes(tmp_path):
    """The read simulation takes minutes: its blocks are checked by the fingerprint of the code that computed
    them, which --write stamps; an older stamp is named."""
    figures = _doc_figures()
    (tmp_path / "a.md").write_text("<!-- figures:reads code=0123456789ab -->1.27<!-- /figures:reads -->\n")
    table, code = {"reads": ("a.md", lambda: "1.24")}, {"reads": ("tools/sim_reads.py",)}
    assert figures.stale_blocks(tmp_path, table, code) == [
        "a.md: figures:reads was written by other code than tools/sim_reads.py is now (--write re-runs it: minutes)"]
    assert figures.write_blocks(tmp_path, table, code) == ["reads"]
    stamp = figures.code_fingerprint(code["reads"])
    assert (tmp_path / "a.md").read_text() == f"<!-- figures:reads code={stamp} -->1.24<!-- /figures:reads -->\n"
    assert figures.stale_blocks(tmp_path, table, code) == []
