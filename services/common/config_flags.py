"""Build a service's frozen config from CLI flags with LLMSERVE_* environment fallbacks.

Each config dataclass field becomes a flag `--field-name` whose default is the environment
variable LLMSERVE_FIELD_NAME when set, else the field's default; the field's docstring (the
string literal after it) is the flag's help. Fields inherited from the shared groups
(services.common.serving_config) are flags like any other, and config_argv turns a group of a
built config back into the flags that rebuild it in a child process.

A `tuple[str, ...]` field is a repeatable flag (its environment variable: comma-separated
values); with `metadata={"values_per_flag": "+"}` one flag also takes several values
(`--lora-modules a=X b=Y`, as vLLM spells it). A field declared with
`metadata={"secret": True}` (API keys, the internal secret, a Redis URL that may hold a
password) never shows its value in --help, and config_argv leaves it out: a child gets secrets
through its environment, never its command line, which any local user can read.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import os
import sys
import textwrap
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def _field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under dataclass fields (not kept by Python at run time), the
    class's own over those of the groups it inherits."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_own_field_docs(klass))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, following in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _parser_for(annotation: Any) -> tuple[Any, bool]:
    """(converter, is_bool) for a field's type; Optional[X] converts as X."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = args[0]
        origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return str, False
    if annotation is bool:
        return bool, True
    if annotation in (int, float, str):
        return annotation, False
    return str, False


def _choices(annotation: Any) -> tuple[Any, ...] | None:
    """A Literal field's allowed values (Optional[Literal[...]] too), else None."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is typing.Literal:
        return typing.get_args(annotation)
    return None


def _is_repeatable(annotation: Any) -> bool:
    return typing.get_origin(annotation) is tuple


def is_secret(field: dataclasses.Field[Any]) -> bool:
    return bool(field.metadata.get("secret"))


def env_name(field_name: str) -> str:
    return "LLMSERVE_" + field_name.upper()


def add_config_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    hints = typing.get_type_hints(cls)
    docs = _field_docs(cls)
    for field in dataclasses.fields(cls):
        flag = "--" + field.name.replace("_", "-")
        env = env_name(field.name)
        converter, is_bool = _parser_for(hints[field.name])
        default = field.default
        repeatable = _is_repeatable(hints[field.name])
        if env in os.environ:
            raw = os.environ[env]
            if repeatable:
                default = tuple(part.strip() for part in raw.split(",") if part.strip())
            else:
                default = raw.lower() in ("1", "true", "yes") if is_bool else converter(raw)
        shown = ("set" if default else "unset") if is_secret(field) else default
        help_text = f"{docs.get(field.name, '')} (env {env}; default: {shown})"
        if repeatable:
            # Given flags replace the default (environment) values rather than add to them.
            parser.add_argument(
                flag,
                dest=field.name,
                action=_Repeat,
                default=default,
                nargs=field.metadata.get("values_per_flag"),
                help=help_text,
            )
        elif is_bool:
            parser.add_argument(
                flag,
                dest=field.name,
                default=default,
                action=argparse.BooleanOptionalAction,
                help=help_text,
            )
        else:
            parser.add_argument(
                flag,
                dest=field.name,
                type=converter,
                default=default,
                choices=_choices(hints[field.name]),
                help=help_text,
            )


class _Repeat(argparse.Action):
    """A repeatable flag collected into a tuple; the first use drops the default."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        given = getattr(namespace, self.dest, ())
        if given is self.default:
            given = ()
        # nargs="+" hands a list (several values after one flag), else one value.
        added = tuple(values) if isinstance(values, list) else (values,)
        setattr(namespace, self.dest, (*given, *added))


def add_deprecated_flag(
    parser: argparse.ArgumentParser,
    flag: str,
    *,
    dest: str,
    instead: str,
    convert: Callable[[str], Any] | None = None,
    const: Any = None,
) -> None:
    """Accept an older spelling of a field's flag: it writes `dest` (through `convert` when it
    takes a value, else `const`) and prints one line naming the spelling to use `instead`.
    Hidden from --help; default=SUPPRESS, so only a given flag writes the field."""
    parser.add_argument(
        flag,
        dest=dest,
        action=_Deprecated,
        nargs=None if convert is not None else 0,
        type=convert,
        const=const,
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
        instead=instead,
    )


class _Deprecated(argparse.Action):
    def __init__(self, *args: Any, instead: str, **kwargs: Any) -> None:
        self.instead = instead
        super().__init__(*args, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(f"{parser.prog}: {option_string} is deprecated; use {self.instead}", file=sys.stderr)
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def config_from_args(cls: type[T], args: argparse.Namespace) -> T:
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in vars(args).items() if k in names})


def config_argv(config: object, *groups: type) -> list[str]:
    """The flags that give a child process the values of `groups`' fields in `config`:
    `--name value`, `--name`/`--no-name` for booleans, the flag once per value of a tuple,
    nothing for unset (None) fields nor secrets (see secret_env)."""
    argv: list[str] = []
    for group in groups:
        for field in dataclasses.fields(group):
            value = getattr(config, field.name)
            flag = "--" + field.name.replace("_", "-")
            if is_secret(field):
                continue
            if isinstance(value, tuple):
                for item in value:
                    argv += [flag, str(item)]
            elif isinstance(value, bool):
                argv.append(flag if value else "--no-" + flag[2:])
            elif value is not None:
                argv += [flag, str(value)]
    return argv


def secret_env(config: object, *groups: type) -> dict[str, str]:
    """The environment that gives a child process the secret fields of `groups` in `config`
    (the values config_argv leaves out)."""
    env: dict[str, str] = {}
    for group in groups:
        for field in dataclasses.fields(group):
            value = getattr(config, field.name)
            if not is_secret(field) or value is None:
                continue
            env[env_name(field.name)] = ",".join(value) if isinstance(value, tuple) else str(value)
    return env
