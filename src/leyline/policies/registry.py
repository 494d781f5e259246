"""Policies by name: the built-ins, plus third-party ones that join via entry points.

A package adds a policy by declaring, in its pyproject.toml::

    [project.entry-points."leyline.policies"]
    redact = "my_pkg.policies:Redact"

where ``Redact`` subclasses :class:`~.base.Policy` with ``type: Literal["redact"]``.
Entry points load lazily, one name at a time, so a broken plugin only breaks its own name.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Annotated

from pydantic import BeforeValidator, SerializeAsAny, ValidationError

from .base import Policy
from .config import parse_pipeline
from .errors import PolicyConfigError, UnknownPolicyError

ENTRY_POINT_GROUP = "leyline.policies"

PolicyConfig = str | Mapping[str, object] | Policy
"""A policy, its dict form ``{"type": ..., ...}``, or its config string."""


def policy_name(cls: type[Policy]) -> str:
    default = cls.model_fields["type"].default
    if not isinstance(default, str) or not default:
        raise PolicyConfigError(cls.__name__, "a policy class needs a default 'type' name")
    return default


class PolicyRegistry:
    """Maps names to policy classes; :meth:`parse` builds policies from any config form."""

    def __init__(self, group: str | None = ENTRY_POINT_GROUP) -> None:
        self._classes: dict[str, type[Policy]] = {}
        self._group = group
        self._builtins_loaded = False

    def register(self, cls: type[Policy]) -> type[Policy]:
        """Add ``cls`` under its ``type`` name; usable as a class decorator."""
        if not (isinstance(cls, type) and issubclass(cls, Policy)):
            raise PolicyConfigError(repr(cls), "only subclasses of Policy can be registered")
        name = policy_name(cls)
        existing = self._classes.get(name)
        if existing is not None and existing is not cls:
            raise PolicyConfigError(name, f"name already taken by {existing.__qualname__}")
        self._classes[name] = cls
        return cls

    def names(self) -> tuple[str, ...]:
        self._load_builtins()
        plugins = {ep.name for ep in entry_points(group=self._group)} if self._group else set()
        return tuple(sorted(set(self._classes) | plugins))

    def get(self, name: str) -> type[Policy]:
        """The class registered as ``name``, loading its entry point if needed.

        Raises:
            UnknownPolicyError: no built-in, registered or entry-point policy has that name.
            PolicyConfigError: the entry point exists but does not load a Policy class.
        """
        self._load_builtins()
        if name in self._classes:
            return self._classes[name]
        found = [ep for ep in entry_points(group=self._group)] if self._group else []
        match = next((ep for ep in found if ep.name == name), None)
        if match is None:
            raise UnknownPolicyError(name, self.names())
        try:
            cls = match.load()
        except Exception as exc:  # a plugin's import error is the plugin's, name it
            raise PolicyConfigError(
                name, f"entry point {match.value!r} failed to load: {exc!r}"
            ) from exc
        if not (isinstance(cls, type) and issubclass(cls, Policy)) or policy_name(cls) != name:
            raise PolicyConfigError(
                name,
                f"entry point {match.value!r} must be a Policy subclass whose type is {name!r}",
            )
        return self.register(cls)

    def parse(self, config: PolicyConfig) -> Policy:
        """Build a policy from a config string, a dict, or pass a policy through.

        Raises:
            PolicyConfigError: naming the policy and the option that is wrong.
        """
        if isinstance(config, Policy):
            return config
        if isinstance(config, Mapping):
            data = dict(config)
            name = data.pop("type", None)
            if not isinstance(name, str):
                raise PolicyConfigError(repr(config), "a policy dict needs a 'type' name")
            return self._build(name, data, json.dumps(config, default=str))
        if not isinstance(config, str):
            raise PolicyConfigError(repr(config), "expected a config string, dict or Policy")
        text = config.strip()
        if text.startswith("{"):
            try:
                loaded = json.loads(text)
            except ValueError as exc:
                raise PolicyConfigError(config, f"invalid JSON: {exc}") from None
            if not isinstance(loaded, dict):
                raise PolicyConfigError(config, "a JSON policy config must be an object")
            return self.parse(loaded)
        stages = [self._build(name, params, config) for name, params in parse_pipeline(text)]
        if len(stages) == 1:
            return stages[0]
        return self.get("chain").model_validate({"type": "chain", "policies": stages})

    def _build(self, name: str, params: Mapping[str, object], config: str) -> Policy:
        cls = self.get(name)
        try:
            return cls.model_validate({**params, "type": name})
        except ValidationError as exc:
            raise PolicyConfigError(config, _explain(name, cls, exc)) from None

    def _load_builtins(self) -> None:
        if self._builtins_loaded:
            return
        self._builtins_loaded = True
        # Imported here: the built-in modules import this one (for nested policy fields).
        from .budget import TokenBudget
        from .clear import ClearToolUses
        from .combinators import Chain, When
        from .errata import FieldErrata
        from .failed import FailedAttempts
        from .retention import Pin, ScratchReasoning
        from .staleness import StaleToolOutputs
        from .summarize import Summarize
        from .truncate import TruncateOldToolOutputs

        for cls in (
            TruncateOldToolOutputs,
            StaleToolOutputs,
            FailedAttempts,
            TokenBudget,
            ClearToolUses,
            Summarize,
            FieldErrata,
            Pin,
            ScratchReasoning,
            Chain,
            When,
        ):
            self.register(cls)


def _explain(name: str, cls: type[Policy], exc: ValidationError) -> str:
    options = ", ".join(f for f in cls.model_fields if f != "type")
    problems: list[str] = []
    for error in exc.errors(include_url=False):
        where = ".".join(str(p) for p in error["loc"])
        message = str(error["msg"]).removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            problems.append(f"unknown option {where!r} (options: {options})")
        elif error["type"] == "missing":
            problems.append(f"option {where!r} is required")
        elif where:
            problems.append(f"{where}: {message} (got {error['input']!r})")
        else:
            problems.append(message)
    return f"{name}: " + "; ".join(problems)


default_registry = PolicyRegistry()
"""The process-wide registry that config strings resolve against."""


def parse_policy(config: PolicyConfig) -> Policy:
    """``parse_policy("stale | truncate:keep_last=2")`` -> ``Chain([...])``."""
    return default_registry.parse(config)


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Register a policy class in-process (entry points do it for installed packages)."""
    return default_registry.register(cls)


def _coerce(value: object) -> object:
    if isinstance(value, str | Mapping):
        return default_registry.parse(value)
    return value


PolicyField = Annotated[SerializeAsAny[Policy], BeforeValidator(_coerce)]
"""A field holding a nested policy, given as a policy, dict or config string."""
