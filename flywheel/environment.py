"""Which ``FLYWHEEL_*`` variables of a process's environment are settings, and their raw values.

flywheel/settings.py owns the names and the types; this module only sorts the environment:

- ``FLYWHEEL_<NAME>`` that names a setting is its value;
- ``FLYWHEEL_<NAME>_FILE=/path``, where ``FLYWHEEL_<NAME>`` names a setting, is that setting's
  value read from the file, its trailing newline dropped: Kubernetes and Docker mount secrets as
  files, and a value kept out of the environment is kept out of ``/proc/<pid>/environ`` and crash
  reports too. A name that is itself a setting (``FLYWHEEL_RELEASE_PROMPTS_FILE``) stays that
  setting. Both forms at once is an error naming both: which one wins would be a guess;
- anything else under the prefix is ignored with a warning logged once per process. An
  orchestrator puts variables of its own there: Kubernetes injects, for every Service in the
  namespace, ``<NAME>_SERVICE_HOST``, ``<NAME>_SERVICE_PORT`` and ``<NAME>_PORT=tcp://IP:PORT``
  (the Service's name upper-cased, ``-`` as ``_``), so a Service named ``flywheel`` injects
  ``FLYWHEEL_SERVICE_HOST`` and one named ``flywheel-serve`` injects ``FLYWHEEL_SERVE_PORT``,
  which is also ``serve.port``'s name. A ``tcp://`` value under a ``_PORT`` setting's name is
  such a link, never a port, and is ignored the same way.

No value is ever logged: the variable that was ignored may be a secret under a misspelt name.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

log = logging.getLogger("flywheel.settings")

PREFIX = "FLYWHEEL_"
FILE_SUFFIX = "_FILE"

#: The names Kubernetes gives a Service's links, after the Service's own name.
_SERVICE_LINK_NAME = re.compile(
    r"_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?|PORT(_\d+_(TCP|UDP|SCTP)(_PROTO|_PORT|_ADDR)?)?)$")
#: A link's address value, ``tcp://10.0.0.1:8000`` (``[fd00::1]`` for IPv6).
_SERVICE_LINK_VALUE = re.compile(r"^(tcp|udp|sctp)://\S+:\d+$", re.IGNORECASE)


class VariableError(ValueError):
    """A variable that names a setting but cannot be read; the message names it."""


class Ignored(Enum):
    """Why a ``FLYWHEEL_*`` variable is not read as a setting."""

    NOT_A_SETTING = "not_a_setting"
    SERVICE_LINK = "service_link"


@dataclass(frozen=True)
class IgnoredVariable:
    name: str
    why: Ignored

    def message(self) -> str:
        if self.why is Ignored.SERVICE_LINK:
            return (f"{self.name} looks like a Kubernetes service link (injected for a Service whose name "
                    "starts with 'flywheel'), not a setting's value: ignored. Set enableServiceLinks: false "
                    "on the pod to keep them out")
        return (f"{self.name} is not a setting: ignored (a misspelt name? `flywheel config example` "
                "lists every setting's variable)")


@dataclass(frozen=True)
class Variable:
    """A setting's raw value from the environment."""

    #: The setting's field path, e.g. ``("serve", "port")``.
    path: tuple[str, ...]
    raw: str
    #: The variable it came from: the setting's name, or that name with ``_FILE``.
    source: str


@dataclass(frozen=True)
class Reading:
    values: tuple[Variable, ...]
    ignored: tuple[IgnoredVariable, ...]


def read_environment(env: Mapping[str, str], resolve: Callable[[str], tuple[str, ...] | None],
                     skip: Collection[str] = ()) -> Reading:
    """Sort ``env``'s ``FLYWHEEL_*`` variables (see the module docstring). ``resolve`` maps a
    variable's name to its setting's field path, or None when it names none; ``skip`` are names
    under the prefix that are someone else's (the config file's path), passed over in silence."""
    values: list[Variable] = []
    ignored: list[IgnoredVariable] = []
    for key, raw in sorted(env.items()):
        if not key.startswith(PREFIX) or key in skip:
            continue
        path = resolve(key)
        if path is not None:
            if key.endswith("_PORT") and _SERVICE_LINK_VALUE.match(raw.strip()):
                ignored.append(IgnoredVariable(key, Ignored.SERVICE_LINK))
            else:
                values.append(Variable(path, raw, key))
            continue
        stem = key.removesuffix(FILE_SUFFIX)
        path = resolve(stem) if stem != key and stem not in skip else None
        if path is not None:
            if stem in env:
                raise VariableError(f"{stem} and {key} are both set: set one, the value or the file that holds it")
            values.append(Variable(path, read_file(key, raw), key))
        else:
            why = Ignored.SERVICE_LINK if _SERVICE_LINK_NAME.search(key) else Ignored.NOT_A_SETTING
            ignored.append(IgnoredVariable(key, why))
    return Reading(tuple(values), tuple(ignored))


def read_file(key: str, path: str) -> str:
    """A value from the file ``path`` that ``key`` (a variable or a flag) names, its trailing
    newline dropped; :class:`VariableError` names both when it cannot be read, never the content.
    The one rule for a secret kept in a file (``flywheel release --token-file`` reads it too)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise VariableError(f"{key}: cannot read {path}: {reason}") from None
    # `echo secret > file` and most secret tools end the file with a newline that is no part of it
    return text.rstrip("\r\n")


#: Names already warned about in this process: settings are loaded more than once in some
#: commands, and one warning per name is enough.
_warned: set[str] = set()


def warn_once(ignored: Iterable[IgnoredVariable]) -> None:
    for var in ignored:
        if var.name not in _warned:
            _warned.add(var.name)
            log.warning("%s", var.message())
