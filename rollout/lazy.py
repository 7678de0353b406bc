"""Package namespaces that import a name's module only when the name is first asked for (PEP 562), so that importing
a package (rollout, a backend's) costs nothing until something in it is used."""

import importlib


def lazy_getattr(package: str, names: dict[str, str]):
    """The module `__getattr__` of `package`: each name in `names` (name -> the module that defines it) imported from
    its module at its first use; AttributeError for any other name."""

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(names[name]), name)

    return __getattr__
