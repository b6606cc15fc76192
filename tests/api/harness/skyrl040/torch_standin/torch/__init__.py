"""A stand-in ``torch`` for importing SkyRL 0.4.0's HTTP client without PyTorch.

``skyrl.backends.skyrl_train.inference_servers.remote_inference_client`` imports modules that
import torch at module level (type hints, tensor helpers of the training side), although
the client's own code (aiohttp, orjson, numpy) never calls torch. PyTorch is gigabytes, and
SkyRL 0.4.0 needs Python >= 3.12, for which this machine has no torch on disk: this module
lets the client import, and would fail loudly (a placeholder is not a tensor) if the code
under test ever used torch. Every attribute is a placeholder class (subscriptable, callable,
usable in ``X | None``), and every ``torch.*`` submodule is made on import by a meta-path
finder. Only ``tests/api/harness/skyrl040/driver.py`` puts it on ``sys.path``, in its own
Python 3.12 process.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any


class _Any(type):
    def __getattr__(cls, name: str) -> _Any:
        return _Any(name, (), {})

    def __call__(cls, *args: Any, **kwargs: Any) -> _Any:
        return _Any("placeholder", (), {})

    def __getitem__(cls, item: Any) -> _Any:
        return cls

    def __or__(cls, other: Any) -> _Any:
        return cls

    def __ror__(cls, other: Any) -> _Any:
        return cls


def __getattr__(name: str) -> _Any:
    return _Any(name, (), {})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.startswith("torch."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = __getattr__  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


__path__: list[str] = []
__version__ = "0.0.0+standin"
sys.meta_path.insert(0, _Finder())
