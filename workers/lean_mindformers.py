"""MindFormers' model classes without the text-metric and Hugging Face data packages its
package imports at start.

`import mindformers` (which any `from mindformers.models... import` runs first) imports its
metrics module (nltk's BLEU, which brings scipy.stats; jieba; rouge_chinese) and its
Hugging Face data loader (`datasets`, which brings pandas, pyarrow and aiohttp). The recipe
uses neither: it builds the LLaMA model and feeds it its own token windows. Measured with
MindFormers 1.9.0: those packages are 2.8 s of the 3.6 s MindFormers takes to import
(nltk 1.3 s, datasets 1.4 s), paid by every rank at start on the cores its peers import
on too.

`model_classes()` imports MindFormers' LLaMA with those packages stood in for: each is an
empty package whose names are placeholders that raise `ImportError` when called or
instantiated (so a MindFormers feature that needs one says which package was left out,
instead of failing somewhere inside it). The stand-ins leave `sys.modules` once MindFormers
is imported: a later `import datasets` (the user's own code in the same process) gets the
real package. Where MindFormers or one of these packages was imported before, nothing is
stood in for: the real ones are used.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Iterator
from typing import Any

from mindpulse.common.errors import MindpulseError

LEFT_OUT = ("nltk", "datasets", "jieba", "rouge_chinese")
"""Imported by MindFormers' package at start, used only by features the recipe does not use
(text metrics, Hugging Face data loading)."""


class LeftOut(MindpulseError, ImportError):
    """A MindFormers feature needed a package that was left out of its import."""


def _placeholder(package: str, qualname: str) -> type:
    def refuse(*_args: Any, **_kwargs: Any) -> None:
        raise LeftOut(f"{qualname} is not available: mindpulse imported MindFormers without {package!r} "
                      "(mindpulse.workers.lean_mindformers: the recipe needs only the model); import "
                      "MindFormers yourself before the recipe builds its model to have it whole")

    # a class: it can be called, instantiated, subclassed and used in isinstance (never true)
    return type(qualname.rpartition(".")[2], (), {"__init__": refuse, "__module__": qualname.rpartition(".")[0]})


class StandIn(types.ModuleType):
    """An empty package in place of a left-out one: any name in it is a placeholder."""

    def __init__(self, name: str):
        super().__init__(name)
        self.__path__: list[str] = []  # a package: its submodules come from the finder too

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        value = _placeholder(self.__name__.partition(".")[0], f"{self.__name__}.{attr}")
        setattr(self, attr, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, packages: tuple[str, ...]):
        self.packages = packages

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.partition(".")[0] in self.packages:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return StandIn(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        return None


@contextlib.contextmanager
def standing_in_for(packages: tuple[str, ...] = LEFT_OUT) -> Iterator[tuple[str, ...]]:
    """Within: importing one of `packages` (not imported yet) gives a `StandIn`; after: they
    leave `sys.modules`. Yields the packages actually stood in for."""
    left_out = tuple(p for p in packages if p not in sys.modules)
    finder = _Finder(left_out)
    sys.meta_path.insert(0, finder)
    try:
        yield left_out
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n, m in list(sys.modules.items()) if isinstance(m, StandIn)]:
            del sys.modules[name]


def model_classes() -> tuple[type, type]:
    """(LlamaConfig, LlamaForCausalLM), MindFormers imported without `LEFT_OUT` when it was
    not imported yet."""
    guard = standing_in_for() if "mindformers" not in sys.modules else contextlib.nullcontext()
    with guard:
        from mindformers.models.llama import LlamaConfig, LlamaForCausalLM
    return LlamaConfig, LlamaForCausalLM
