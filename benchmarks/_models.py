"""What the benchmarks share: which of their models can run here."""
import importlib


def available(modules):
    """Whether ``modules`` and compiled mmcv ops import in this environment.

    Args:
        modules (Sequence[str]): Packages a model needs, e.g. ``('mmdet',)``.
    """
    try:
        for module in modules:
            importlib.import_module(module)
        importlib.import_module('mmcv.ops')
        return True
    except Exception:  # noqa: BLE001 - not installed in this environment
        return False


def select(models, wanted, modules_of):
    """The entries of ``models`` that were asked for and can run here.

    Args:
        models (list[tuple]): Benchmark model entries, key first.
        wanted (list[str] | None): Keys asked for; ``None`` means all.
        modules_of (callable): Entry -> the packages it needs.

    Raises:
        SystemExit: When none can run, with the reason.
    """
    chosen = [m for m in models
              if (wanted is None or m[0] in wanted)
              and available(modules_of(m))]
    if not chosen:
        raise SystemExit('none of the requested models can run here (mmdet '
                         '/ mmrotate with compiled mmcv ops are needed)')
    return chosen
