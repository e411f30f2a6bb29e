"""Kill a piece of code at each of its steps, in process: the k-th call to any of the patched step functions
raises :class:`Killed` before it does anything, as a SIGKILL at that point would leave the disk."""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from typing import Any


class Killed(BaseException):
    """Raised in place of a step (a BaseException, so no ``except Exception`` in the code swallows it)."""


class KillAt:
    """Counts the calls of the wrapped steps; the ``kill_at``-th (from 1) raises :class:`Killed`."""

    def __init__(self, kill_at: int | None) -> None:
        self.kill_at = kill_at
        self.calls: list[str] = []

    def wrap(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            if len(self.calls) == self.kill_at:
                raise Killed(f"killed before step {self.kill_at}: {name}")
            return function(*args, **kwargs)

        return step


def module_proxy(module: types.ModuleType, killer: KillAt, names: tuple[str, ...]) -> types.SimpleNamespace:
    """A stand-in for ``module`` (os, shutil) whose ``names`` are counted steps, everything else the same."""
    proxy = types.SimpleNamespace(
        **{key: getattr(module, key) for key in dir(module) if not key.startswith("__")}
    )
    for name in names:
        setattr(proxy, name, killer.wrap(f"{module.__name__}.{name}", getattr(module, name)))
    return proxy


def kill_points(run: Callable[[KillAt], None]) -> Iterator[tuple[int, KillAt]]:
    """Yield (k, killer) after running ``run`` killed before its k-th step, for k = 1, 2, ... until a run
    completes without reaching its kill point. ``run`` patches the steps with the killer it is given."""
    k = 1
    while True:
        killer = KillAt(k)
        try:
            run(killer)
        except Killed:
            yield k, killer
            k += 1
            continue
        assert k > 1, "the code ran no patched step: the kill points test nothing"
        return
