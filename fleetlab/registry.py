"""``Registry``: one way to name every pluggable kind (attention backends, proposers, policies,
KV connectors).

Each kind is a base class and a registry of its subclasses by name. Wherever fleetlab takes
one (``LLM(backend=...)``, ``scheduling_policy=...``, ``speculative_config={"method": ...}``)
it accepts a registered name, a subclass, or an instance (:meth:`Registry.make`). Built-ins
are listed as ``"module:Class"`` strings and imported on first use, so that naming the Triton
backend does not import Triton. The rules are the same for every kind: an entry must be a
subclass of the kind's base and carry the name it is registered under, and replacing a
built-in takes ``replace=True`` (a user's own entry may be registered again: a notebook cell
that defines and registers a class can be re-run).
"""

from __future__ import annotations

import importlib

from fleetlab.errors import FieldTypeError, refuse


class Registry:
    """Names -> subclasses of ``base`` (``kind`` names the kind in messages)."""

    def __init__(self, kind: str, base: type, builtins: dict[str, str]):
        self.kind, self.base = kind, base
        self._entries: dict[str, type | str] = dict(builtins)
        self._builtins = dict(builtins)  # name -> 'module:Class', for the message refusing to replace one

    def register(self, name: str, cls, *, replace: bool = False):
        """Make ``cls`` (a subclass of the base, or ``"module:Class"`` imported on first use)
        selectable as ``name``; returns ``cls``. A built-in's name needs ``replace=True``."""
        lazy, builtin = isinstance(cls, str), name in self._builtins
        refuse([  # a FieldTypeError: a TypeError (a wrong kind) and a ValueError (an unknown name) at once
            (not isinstance(name, str) or not name, f"{self.kind} name must be a non-empty str, got {name!r}"),
            (builtin and not replace, f"{self.kind} {name!r} is built in ({self._builtins.get(name)}); "
             "pass replace=True to replace it, or choose another name"),
            (lazy and ":" not in cls, f"{self.kind} {name!r}: a lazy entry is spelled 'module:Class', got {cls!r}"),
        ], FieldTypeError)
        self._entries[name] = cls if lazy else self._check(name, cls)
        return cls

    def get(self, name: str) -> type:
        """The class registered as ``name`` (imported on first use)."""
        known = isinstance(name, str) and name in self._entries
        refuse([(not known, f"unknown {self.kind} {name!r:.80}; it must be a registered name ({self.names()}), "
                             f"a subclass of {self.base.__name__} or an instance of one")], FieldTypeError)
        entry = self._entries[name]
        if isinstance(entry, str):
            module, _, attr = entry.partition(":")
            entry = self._check(name, getattr(importlib.import_module(module), attr))
            self._entries[name] = entry
        return entry

    def resolve(self, spec) -> type:
        """The class ``spec`` names: a registered name, a subclass, or an instance's class."""
        if isinstance(spec, type) and issubclass(spec, self.base):
            return spec
        return type(spec) if isinstance(spec, self.base) else self.get(spec)

    def make(self, spec, *args, **kwargs):
        """An instance from ``spec``: a name or a class (built with ``args``), or an instance (as is)."""
        return spec if isinstance(spec, self.base) else self.resolve(spec)(*args, **kwargs)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def _check(self, name: str, cls) -> type:
        subclass = isinstance(cls, type) and issubclass(cls, self.base)
        refuse([
            (not subclass, f"{self.kind} {name!r} must be a subclass of {self.base.__module__}.{self.base.__name__}, "
             f"got {cls!r:.80}"),
            (subclass and getattr(cls, "name", name) != name,
             f"{self.kind} {name!r}: class {getattr(cls, '__name__', cls)} says name={getattr(cls, 'name', None)!r}; "
             f"register it under that name, or subclass it with name = {name!r}"),
        ], FieldTypeError)
        return cls
