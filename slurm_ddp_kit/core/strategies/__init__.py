"""The strategies: every module of this package defines one, and this registry finds them.

`get(name)` is the strategy `--mode name` picks; `STRATEGIES` holds them all in the table's order.
Adding a strategy is adding one module here: its class says what it is (process shape, the
options it refuses, its label), and how a job wraps, saves and loads its model.
"""

from __future__ import annotations

import importlib
import pkgutil

from slurm_ddp_kit.core.settings.schema import Config, ConfigError
from slurm_ddp_kit.core.strategies.base import Column, Strategy, bare

__all__ = ["STRATEGIES", "Column", "Strategy", "bare", "columns", "get", "names", "of"]


def _discover() -> dict[str, Strategy]:
    """One instance of each Strategy subclass a module of this package defines, by name."""
    found: dict[str, Strategy] = {}
    for module in pkgutil.iter_modules(__path__):
        if module.name != "base":
            importlib.import_module(f"{__name__}.{module.name}")
    for cls in _subclasses(Strategy):
        if "name" in vars(cls):
            found[cls.name] = cls()
    return dict(sorted(found.items(), key=lambda item: item[1].order))


def _subclasses(cls: type[Strategy]) -> list[type[Strategy]]:
    direct = cls.__subclasses__()
    return direct + [deeper for sub in direct for deeper in _subclasses(sub)]


STRATEGIES = _discover()


def names() -> list[str]:
    return list(STRATEGIES)


def get(name: str) -> Strategy:
    """The strategy `--mode name` picks; an unknown name is an error listing the known ones."""
    try:
        return STRATEGIES[str(name)]
    except KeyError:
        raise ConfigError(
            f"mode={name!r} is not valid; choose one of: {', '.join(STRATEGIES)}"
        ) from None


def of(cfg: Config) -> Strategy:
    """The run's strategy."""
    return get(cfg.mode)


def columns() -> list[Column]:
    """Every column the comparison table can show, in its order."""
    return [column for strategy in STRATEGIES.values() for column in strategy.columns()]
