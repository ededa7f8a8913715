"""The C-symbol table shared by the simulator's fake libraries (libnvidia-ml, libdcgm).

The real bindings look each C function up with `getattr(lib, name)` and call it with
ctypes arguments. A fake library marks its Python implementations `_nvmlXxx` /
`_dcgmXxx` with `@symbol(kind)`; `install_symbols` exposes each as the attribute
`nvmlXxx`, a callable that carries ctypes' `restype`/`argtypes` and routes every call
through the library's `_invoke(name, impl, kind, args)`, where faults, hangs and the
initialisation state are applied in one place.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Collection
from typing import Any, Protocol

KIND = "_fake_symbol_kind"


def symbol(kind: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark `_prefixXxx` as the implementation of the C symbol `prefixXxx`."""

    def mark(method: Callable[..., Any]) -> Callable[..., Any]:
        setattr(method, KIND, kind)
        return method

    return mark


class FakeLib(Protocol):
    def _invoke(self, name: str, impl: Callable[..., Any], kind: str, args: tuple) -> Any: ...


class Symbol:
    """What `getattr(lib, name)` returns: callable, with ctypes' restype/argtypes."""

    def __init__(self, lib: FakeLib, name: str, impl: Callable[..., Any], kind: str) -> None:
        self.__name__ = name
        self._lib = lib
        self._impl = impl
        self._kind = kind
        self.restype: Any = ctypes.c_int
        self.argtypes: Any = None

    def __call__(self, *args: Any) -> Any:
        return self._lib._invoke(self.__name__, self._impl, self._kind, args)


def install_symbols(lib: FakeLib, missing: Collection[str] = ()) -> dict[str, Symbol]:
    """Set every marked implementation of `lib`'s class (and of the classes it is made
    of) as an instance attribute.

    A symbol in `missing` stays absent: the binding's getattr fails as it does against
    an older driver, and the binding raises its FunctionNotFound equivalent.
    """
    symbols = {}
    for klass in reversed(type(lib).__mro__):  # a library may be made of several classes
        for attr, impl in vars(klass).items():
            kind = getattr(impl, KIND, None)
            name = attr[1:]
            if kind is not None and name not in missing:
                symbols[name] = Symbol(lib, name, getattr(lib, attr), kind)
                setattr(lib, name, symbols[name])
    return symbols
