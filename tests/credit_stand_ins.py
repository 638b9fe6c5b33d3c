"""Stand-ins for what NCAR CREDIT's model modules import but these tests never use (see tests/test_credit_models.py).

``credit.postblock.gen1`` (the optional post block) needs torchvision and torch_harmonics, and timm
and segmentation_models_pytorch import torchvision at import time for names these models never
use: torchvision's wheels do not load beside the CPU torch this project pins. Each stand-in refuses
to be used; the real module is used wherever it imports.
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

import torch


def credit_models():
    """CREDIT's ``crossformer`` and ``wxformer.crossformer`` model modules (the post block's stand-in first)."""
    try:
        import credit.postblock.gen1  # noqa: F401
    except ImportError:
        stand_in = types.ModuleType("credit.postblock.gen1")

        class PostBlock:  # the configurations below never build one
            def __init__(self, *args, **kwargs):
                raise RuntimeError("credit.postblock.gen1 stand-in: the post block is not part of these tests")

        stand_in.PostBlock = PostBlock
        sys.modules["credit.postblock.gen1"] = stand_in
    from credit.models import crossformer
    from credit.models.wxformer import crossformer as wxformer

    return crossformer, wxformer


class _StandInClass(torch.nn.Module):
    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"torchvision stand-in: {type(self).__name__} is not part of these tests")


class _StandInModule(types.ModuleType):
    """A torchvision module whose every name is a class (or function) that refuses to be used."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "InterpolationMode":  # timm.data builds a table of it at import time
            value = enum.Enum(name, {n: n.lower() for n in "NEAREST NEAREST_EXACT BILINEAR BICUBIC BOX HAMMING LANCZOS".split()})
        elif name[:1].isupper():
            value = type(name, (_StandInClass,), {"__module__": self.__name__})
        else:
            def value(*args, **kwargs):
                raise RuntimeError(f"torchvision stand-in: {self.__name__}.{name} is not part of these tests")
        setattr(self, name, value)
        return value


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def timm_models():
    """``(fuxi, unet)`` CREDIT modules, or None when timm / segmentation_models_pytorch are not installed."""

    if importlib.util.find_spec("timm") is None or importlib.util.find_spec("segmentation_models_pytorch") is None:
        return None
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - missing, or a wheel built for another torch
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        sys.meta_path.insert(0, _StandInFinder())
    from credit.models import fuxi, unet

    return fuxi, unet
