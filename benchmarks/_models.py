"""What the benchmarks share: which of their models can run here, and the
options every one of them takes to choose them."""
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


def model_arguments(parser, models):
    """Add ``--models`` (keys of ``models``), ``--threads`` and
    ``--work-dir`` to ``parser``."""
    parser.add_argument('--models', nargs='+', choices=[m[0] for m in models],
                        help='default: every model whose packages import')
    parser.add_argument('--threads', type=int,
                        help="torch intra-op threads (default: torch's "
                        'choice); 1 gives the steadiest timings')
    parser.add_argument('--work-dir', help='default: a temporary directory')


def set_threads(args):
    """Apply ``--threads`` (:func:`model_arguments`)."""
    if args.threads is not None:
        import torch
        torch.set_num_threads(args.threads)
