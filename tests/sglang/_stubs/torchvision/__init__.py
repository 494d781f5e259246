"""Test-only stand-in for torchvision (never installed; tests/sglang/conftest.py puts it on
sys.path).

PyPI's torchvision does not load beside the CPU torch wheel (``torchvision::nms``), and
sglang imports it only for multimodal preprocessing, which these tests never run. Every
``torchvision.*`` module and name resolves to a placeholder that raises if it is used.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.0.0+leyline.stub"


class _PlaceholderMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}")


def _placeholder(name: str) -> type:
    def refuse(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError(f"{name} is the test stand-in for torchvision; it does nothing")

    return _PlaceholderMeta(name, (), {"__init__": refuse, "__qualname__": name})


def _module_getattr(module_name: str) -> Any:
    def getattr_(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{module_name}.{name}")

    return getattr_


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves every ``torchvision.<sub>`` to an empty module with placeholder names."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> Any:
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
    sys.meta_path.append(_StubFinder())


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _placeholder(f"torchvision.{name}")
