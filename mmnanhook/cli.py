"""The ``mmnan`` command line (also ``python -m mmnanhook``)."""
import argparse
import sys


def build_parser():
    parser = argparse.ArgumentParser(
        prog='mmnan',
        description='mmnanhook: find where NaN/Inf came from in MMEngine '
        'training (mmdet / mmrotate).')
    parser.add_subparsers(dest='command', metavar='COMMAND')
    return parser


def main(argv=None):
    """Entry point of ``mmnan``; returns the process exit code.

    Args:
        argv (list[str], optional): Arguments; ``sys.argv[1:]`` by default.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == '__main__':
    sys.exit(main())
