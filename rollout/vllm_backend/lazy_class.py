"""A class on a vLLM base class, built when vLLM first asks its module for it: the module's `__getattr__` calls
`build_on_vllm`, so the module imports without vLLM (speculator.py, speculator_config.py)."""

import importlib


def build_on_vllm(namespace: dict, requested: str, name: str, base: str, mixins: tuple = (),
                  attrs: dict | None = None) -> type:
    """`name` for a module `__getattr__(requested)`: the class (*mixins, base) with `attrs`, base given as
    "module.Class"; built once and kept in the module's namespace (its globals()). AttributeError for another name."""
    if requested != name:
        raise AttributeError(f"module {namespace['__name__']!r} has no attribute {requested!r}")
    module, _, class_name = base.rpartition(".")
    built = type(name, (*mixins, getattr(importlib.import_module(module), class_name)),
                 {"__module__": namespace["__name__"], "__qualname__": name, **(attrs or {})})
    namespace[name] = built
    return built
