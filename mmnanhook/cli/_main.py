"""The ``mmnan`` command line (also ``python -m mmnanhook``).

Exit codes: 0 success (``replay``: the failure reproduced), 1 ``scan`` found
bad samples, ``doctor`` found anything or a ``drill`` verdict fails, 2 bad input (one line on stderr, no
traceback), 3 ``replay`` came out finite, 130 ``scan`` interrupted (Ctrl-C
or SIGTERM; its progress kept for ``--resume``).

Over 500 lines because it is one concern, the command line: each command's
arguments, their checks (a bad value is one line and exit 2) and the call
into its room; the work itself lives in those rooms.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from typing import List, Optional

from .. import compat
from ..errors import BundleError

EXIT_OK, EXIT_FOUND, EXIT_BAD_INPUT, EXIT_NOT_REPRODUCED = 0, 1, 2, 3
# As a shell reports a process ended by SIGINT.
EXIT_INTERRUPTED = 130


def _log_to_stderr():
    """Make the current MMLogger one that writes to stderr.

    MMLogger prints to stdout, where ``replay``, ``inspect`` and ``scan``
    print their result (``replay --json`` must stay parseable).
    """
    from mmengine.logging import MMLogger
    logger = MMLogger.get_instance('mmnan')
    for handler in logger.handlers:
        if (isinstance(handler, logging.StreamHandler)
                and handler.stream is sys.stdout):
            handler.setStream(sys.stderr)


def _replay(args):
    from ..bundle import ALLOWLIST_FALLBACK, to_strict_json
    from ..report import format_report
    from ._replay import replay_bundle
    if ALLOWLIST_FALLBACK:
        print('mmnan replay: warning: ' + ALLOWLIST_FALLBACK,
              file=sys.stderr)
    bundle, report = replay_bundle(args.bundle, device=args.device,
                                   fp32=args.fp32)
    if args.json:
        print(json.dumps(to_strict_json(report.to_dict()), indent=2,
                         sort_keys=True))
    else:
        print(format_report(report))
        print('bundle: {}'.format(bundle.path))
    if report.kind == 'not_reproduced':
        return EXIT_NOT_REPRODUCED
    return EXIT_OK


def _inspect(args):
    from ..bundle import REPORT_HTML, load_bundle
    from ..report import format_report
    from ._story import is_work_dir
    if is_work_dir(args.bundle):
        return _inspect_work_dir(args)
    if args.out:
        return _bad_input('inspect', '--out is for a work dir\'s page; {} '
                          'is no work dir'.format(args.bundle))
    bundle = load_bundle(args.bundle)
    if args.html or args.open:
        return _html(bundle, REPORT_HTML, args.open)
    if args.json:
        print(json.dumps(dict(manifest=bundle.manifest, report=bundle.report),
                         indent=1, sort_keys=True))
        return EXIT_OK
    m = bundle.manifest
    lines = ['bundle:     {}'.format(bundle.path)]
    for key in ('iter', 'epoch', 'rank', 'world_size', 'trigger', 'grad_norm',
                'amp_dtype', 'created'):
        if key in m:
            lines.append('{:<11} {}'.format(key + ':', m[key]))
    if m.get('losses'):
        lines.append('losses:     ' + ', '.join(
            '{}={}'.format(k, v) for k, v in sorted(m['losses'].items())))
    if m.get('nonfinite_losses'):
        lines.append('non-finite losses: ' + ', '.join(m['nonfinite_losses']))
    grads = m.get('nonfinite_grads') or {}
    if grads.get('count'):
        lines.append('non-finite grads: {} parameter(s): {}'.format(
            grads['count'], ', '.join(grads.get('names', []))))
    versions = m.get('versions') or {}
    lines.append('versions:   ' + ', '.join(
        '{} {}'.format(k, v) for k, v in sorted(versions.items()) if v))
    lines.append(bundle.state_note())
    lines.append('files:      ' + ', '.join(
        '{} ({} B)'.format(f['name'], f['size']) for f in m['files']))
    lines.append('')
    lines.append(format_report(bundle.report))
    print('\n'.join(lines))
    return EXIT_OK


def _inspect_work_dir(args):
    """What happened to the runs of the work dir ``args.bundle``, from its
    files alone (nothing of it is executed or unpickled): the story in the
    terminal (after what the runs that died inside a step had in flight,
    as before), ``--json``, or the page (``--html``, ``--open``). A file
    that cannot be read is one warning line on stderr naming it; the rest
    is told."""
    from ..quarantine import flight_dir, read_flights
    from ._story import read_story, story_lines
    work_dir = args.bundle
    story, scalars = read_story(work_dir)
    for problem in story.problems:
        print('mmnan inspect: warning: ' + problem, file=sys.stderr)
    if args.json:
        print(json.dumps(story.to_dict(), indent=1, sort_keys=True))
        return EXIT_OK
    if args.html or args.open or args.out:
        return _story_page(story, scalars, args)
    if not story.quiet:
        flights = read_flights(flight_dir(work_dir))
        if not flights:
            print('{}: no run with mmnanhook died inside a train step here '
                  'since the last run started'.format(work_dir))
        for flight in flights:
            print(flight.describe())
            if flight.stack:
                print(flight.stack)
        print('')
    print('\n'.join(story_lines(story)))
    return EXIT_OK


def _story_page(story, scalars, args):
    """Write the work dir's page (``--out``, else ``nan_inspect.html`` in
    it), print its path (and open it)."""
    from ._story_page import PAGE_FILE, render_story
    path = os.path.abspath(args.out or os.path.join(story.work_dir,
                                                    PAGE_FILE))
    try:
        text = render_story(story, scalars, os.path.dirname(path))
        with open(path, 'w') as f:
            f.write(text)
    except OSError as error:
        return _bad_input('inspect', 'cannot write {}: {} (--out FILE '
                          'writes it elsewhere)'.format(
                              path, error.strerror or error))
    print(path)
    if args.open:
        import webbrowser
        if not webbrowser.open('file://' + path):
            print('mmnan inspect: no browser to open it with; open the path '
                  'above', file=sys.stderr)
    return EXIT_OK


def _html(bundle, name, open_it):
    """Print the path of a bundle's ``report.html`` (and open it)."""
    if name not in bundle.files:
        raise BundleError('{} has no {} (an older mmnanhook wrote '
                          'it)'.format(bundle.path, name))
    path = os.path.abspath(os.path.join(bundle.path, name))
    print(path)
    if open_it:
        import webbrowser
        if not webbrowser.open('file://' + path):
            print('mmnan inspect: no browser to open it with; open the path '
                  'above', file=sys.stderr)
    return EXIT_OK


def _bad_input(command, error):
    print('mmnan {}: error: {}'.format(command, error), file=sys.stderr)
    return EXIT_BAD_INPUT


def _print_finding(item, paths=()):
    print('sample {} {}:'.format(item.index, item.img_path))
    for problem in item.problems:
        print('    ' + problem.text)
    for path in paths:
        print('    picture: ' + path)
    sys.stdout.flush()


def _interrupt(signum, frame):
    raise KeyboardInterrupt


@contextlib.contextmanager
def _killed_as_interrupted():
    """Meanwhile a kill (SIGTERM) ends the scan as Ctrl-C does: its
    progress saved for --resume. The caller's handler is put back after:
    :func:`main` may run inside a process whose SIGTERM is its own (a
    notebook, a training script). Python runs handlers in the main thread
    only: elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        # None: a handler not installed from Python, which cannot be put
        # back from Python either.
        if before is not None:
            signal.signal(signal.SIGTERM, before)


def _scan(args):
    if args.resume and not args.quarantine:
        return _bad_input('scan', '--resume needs --quarantine OUT: the '
                          'progress of a scan is kept beside its list')
    from ..doctor import DatasetError, scan_config
    try:
        with _killed_as_interrupted():
            total, bad, _ = scan_config(
                args.config, progress=not args.no_progress, show=args.show,
                workers=args.workers, on_finding=_print_finding,
                fast=args.fast, quarantine=args.quarantine,
                resume=args.resume)
    except DatasetError as error:
        return _bad_input('scan', error)
    except KeyboardInterrupt:
        print('mmnan scan: interrupted; {}'.format(
            'the samples found so far are in {0}, the progress in '
            '{0}.progress: the same command with --resume goes on'.format(
                args.quarantine) if args.quarantine else
            'with --quarantine OUT, --resume could have gone on from here'),
            file=sys.stderr)
        return EXIT_INTERRUPTED
    print('scanned {} samples: {} with invalid ground truth'.format(
        total, len(bad)))
    if args.quarantine:
        print('quarantine list of {} samples: {} (review it, then start a '
              "run with NanDetectHook(quarantine='{}'))".format(
                  len(bad), args.quarantine, args.quarantine))
    return EXIT_FOUND if bad else EXIT_OK


def _doctor_lines(report):
    from ..doctor import INIT_SCALE, NEAR
    lines = ['config: {} finding(s)'.format(len(report.config))]
    lines.extend('  - ' + f.line() for f in report.config)
    if report.scanned is not None:
        lines.append('dataset: {} of {} samples with problems'.format(
            len(report.samples), report.scanned))
        for item in report.samples:
            lines.append('  sample {} {}:'.format(item.index, item.img_path))
            lines.extend('    ' + p.text for p in item.problems)
    if report.dataset_unchecked is not None:
        lines.append('dataset: ' + report.dataset_unchecked)
    if report.headroom_skipped is not None:
        lines.append('fp16 headroom: ' + report.headroom_skipped)
        lines.extend('note: ' + n for n in report.notes)
        return lines
    lines.append('fp16 headroom: {} module(s) over or within {:g}x of '
                 "fp16's range".format(len(report.ranges), NEAR))
    lines.extend('  - {} {}'.format(r.verdict(report.loss_scale),
                                    r.line(report.loss_scale))
                 for r in report.ranges)
    if report.backoff is not None:
        lines.append(
            '  (info) a dynamic GradScaler halves its initial scale {:g} {} '
            'time(s), skipping as many steps, for {}\'s gradient; '
            'normal'.format(INIT_SCALE, report.backoff[1],
                            report.backoff[0]))
    if report.confirmed is not None:
        name, overflowed = report.confirmed
        lines.append('  fp16 autocast on the CPU: {} {}'.format(
            name, 'overflows (confirmed)' if overflowed else
            'stays finite (not confirmed)'))
    lines.extend('note: ' + n for n in report.notes)
    return lines


def _doctor_html(report, config):
    from html import escape

    from ..report import config_section, page
    body = [config_section(report.config)]
    samples = ''.join('<li><code>{}</code>: {}</li>'.format(
        escape(str(s.img_path)), escape('; '.join(p.text for p in s.problems)))
        for s in report.samples)
    if report.scanned is not None:
        body.append('<h2>Dataset</h2><p>{} of {} samples with problems</p>'
                    '<ul>{}</ul>'.format(len(report.samples), report.scanned,
                                         samples))
    if report.dataset_unchecked is not None:
        body.append('<h2>Dataset</h2><p>{}</p>'.format(escape(
            report.dataset_unchecked)))
    if report.headroom_skipped is not None:
        body.append('<h2>fp16 headroom</h2><p>{}</p>'.format(escape(
            report.headroom_skipped)))
        return page('mmnan doctor: ' + config, body)
    body.append('<h2>fp16 headroom</h2><ul>{}</ul>'.format(''.join(
        '<li class="bad">{} {}</li>'.format(
            escape(r.verdict(report.loss_scale)),
            escape(r.line(report.loss_scale))) for r in report.ranges)))
    return page('mmnan doctor: ' + config, body)


def _doctor(args):
    from ..doctor import DatasetError, run_doctor
    try:
        report = run_doctor(args.config, world_size=args.world_size,
                            data=not args.no_data,
                            headroom_iters=args.headroom_iters,
                            workers=args.workers)
    except DatasetError as error:
        return _bad_input('doctor', error)
    for line in _doctor_lines(report):
        print(line)
    if args.html:
        try:
            with open(args.html, 'w') as f:
                f.write(_doctor_html(report, args.config))
        except OSError as error:
            return _bad_input('doctor', 'cannot write {}: {}'.format(
                args.html, error.strerror or error))
        print('html: ' + args.html)
    return EXIT_FOUND if report.found else EXIT_OK


def _drill(args):
    from ..drill import run_drill
    from ..doctor import DatasetError
    say = (lambda line: None) if args.json else (
        lambda line: print('mmnan drill: ' + line, file=sys.stderr,
                           flush=True))
    faults = [f.strip() for f in args.faults.split(',') if f.strip()]
    try:
        drill = run_drill(args.config, faults=faults, iter=args.iter,
                          rank=args.rank, policy=args.policy,
                          launcher=args.launcher, work_dir=args.work_dir,
                          image_size=args.image_size,
                          synthetic=args.synthetic, timeout=args.timeout,
                          say=say)
    except (DatasetError, ValueError) as error:
        return _bad_input('drill', error)
    if args.json:
        print(json.dumps(drill.to_dict(), indent=2, sort_keys=True))
    else:
        print('drill of {} (rank {}), in {}'.format(
            args.config, drill.verdicts[0].rank, drill.work_dir))
        print('changed for the drill: ' + '; '.join(drill.changes))
        for verdict in drill.verdicts:
            print('\n'.join(verdict.lines()))
        failed = next((v for v in drill.verdicts if not v.ok), None)
        print('all hold' if failed is None else 'FAILS: {} {}: {}'.format(
            failed.run, failed.failed.name, failed.failed.detail))
    return EXIT_OK if drill.ok else EXIT_FOUND


def _demo(args):
    from ..demo import run_demo
    return run_demo(dota=args.dota, work_dir=args.work_dir)


def _version():
    """``mmnan --version``: ours and what it runs on, for bug reports."""
    import mmengine
    import torch

    from ..version import __version__
    return 'mmnanhook {} (python {}, torch {}, mmengine {})'.format(
        __version__, sys.version.split()[0], torch.__version__,
        mmengine.__version__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog='mmnan',
        description='mmnanhook: find where NaN/Inf came from in MMEngine '
        'training (mmdet / mmrotate).')
    parser.add_argument('--version', action='version', version=_version())
    sub = parser.add_subparsers(dest='command', metavar='COMMAND')

    p = sub.add_parser(
        'replay', help='re-run the failing iteration of a bundle and '
        'diagnose it (exit 0 reproduced, 3 finite, 2 bad input)',
        description="Re-run the failing iteration of a bundle. It executes "
        "the bundle's config.py (and its custom_imports) as tools/train.py "
        'would: replay only bundles you would train with. Its .pth files '
        'load with torch.load(weights_only=True) and an allowlist of the '
        'batch classes (torch < 2.6: the same allowlist in mmnanhook\'s own '
        'unpickler), so they run no code; anything else is refused (exit 2).')
    p.add_argument('bundle', help='bundle directory (.../nan_dumps/...)')
    p.add_argument('--device', choices=('cpu', 'cuda'), default='cpu')
    p.add_argument('--fp32', action='store_true',
                   help='replay in fp32 even if the run used autocast')
    p.add_argument('--json', action='store_true',
                   help='print the report as JSON (report.json schema)')
    p.set_defaults(func=_replay)

    p = sub.add_parser('inspect', help='show the manifest and report of a '
                       'bundle, or what happened to a work dir\'s runs',
                       description='Show the manifest and report of a '
                       'bundle: it reads JSON only, never unpickles nor '
                       'executes anything of the bundle. Given a work dir, '
                       'tell its runs\' story from its files alone: every '
                       'run (a resumed one joined to the run it continues), '
                       'each incident in order (triggers and what became of '
                       'each step, spikes, rewinds, crashes and what was in '
                       'flight, with the Python stack of a fatal signal, the '
                       'samples quarantined), the quarantine and the totals.')
    p.add_argument('bundle', help='bundle directory, or a work dir')
    p.add_argument('--html', action='store_true',
                   help='a bundle: print the path of its report.html; a '
                   'work dir: write its page (the loss and gradient norm '
                   'over every run, each incident marked and linked to its '
                   'bundle\'s report, the quarantined samples\' pictures) '
                   'and print its path')
    p.add_argument('--open', action='store_true',
                   help='open that page in a browser (implies --html)')
    p.add_argument('--json', action='store_true',
                   help='print it as JSON (a work dir: its story; a bundle: '
                   'its manifest and report)')
    p.add_argument('--out', metavar='FILE', default=None,
                   help='where a work dir\'s page is written (default '
                   'WORK_DIR/nan_inspect.html; implies --html)')
    p.set_defaults(func=_inspect)

    p = sub.add_parser('scan', help='pre-flight: run the train pipeline of a '
                       'config over its dataset and list invalid GT (exit 1 '
                       'when any)')
    p.add_argument('config')
    p.add_argument('--no-progress', action='store_true')
    p.add_argument('--workers', type=int, default=1, metavar='N',
                   help='processes checking samples at once (default 1); '
                   'findings are printed as they are found')
    p.add_argument('--show', metavar='DIR', default=None,
                   help='write pictures of every flagged sample into DIR')
    p.add_argument('--quarantine', metavar='OUT', default=None,
                   help='write the flagged samples as a quarantine list '
                   "(NanDetectHook(quarantine=OUT) never loads them), "
                   'updated while the scan runs, its progress in '
                   'OUT.progress')
    p.add_argument('--resume', action='store_true',
                   help='go on from where an interrupted scan with the same '
                   'config and --quarantine OUT stopped')
    p.add_argument('--fast', action='store_true',
                   help='check the annotations and the image files\' '
                   'headers only (declared vs real size, boxes, labels): '
                   'no decoding, no pipeline')
    p.set_defaults(func=_scan)

    p = sub.add_parser('doctor', help='before the run: the config rules, '
                       'the dataset and the fp16 headroom of a config (exit '
                       '1 when anything is found)')
    p.add_argument('config')
    p.add_argument('--world-size', type=int, default=None,
                   help='GPUs the run will use (default: what the config '
                   "name says, as 8xb2's 8)")
    p.add_argument('--no-data', action='store_true',
                   help='skip the pass over the dataset')
    p.add_argument('--workers', type=int, default=1, metavar='N',
                   help='processes of the dataset pass (default 1)')
    p.add_argument('--headroom-iters', type=int, default=2, metavar='N',
                   help='fp32 iterations measuring the fp16 headroom '
                   '(0: skip)')
    p.add_argument('--html', metavar='OUT', default=None,
                   help="write the findings as a page in report.html's "
                   'style')
    p.set_defaults(func=_doctor)

    p = sub.add_parser('drill', help='prove the protection on a config: a '
                       'clean run with and without mmnanhook, then planted '
                       'faults (exit 0 all hold, 1 one does not)',
                       description='Train a config a few iterations (its '
                       'data where it is at hand, else a synthetic dataset '
                       'in its format), clean with and without NanDetectHook '
                       '(they must agree bitwise), then once per planted '
                       'fault; say per fault whether it was caught before '
                       'the update, named, handled by the policy, and the '
                       'weights left finite.')
    p.add_argument('config')
    p.add_argument('--faults', default='data,loss,grad',
                   help='comma-separated, of data (a NaN image), loss (a '
                   'NaN loss term), grad (an infinite gradient)')
    p.add_argument('--iter', type=int, default=1, metavar='K',
                   help='the iteration the faults are planted in (default '
                   '1)')
    p.add_argument('--rank', type=int, default=0, metavar='R',
                   help='the rank they are planted on (default 0)')
    p.add_argument('--policy', default=None,
                   help="NanDetectHook's policy (default: the config's, "
                   "else 'raise')")
    p.add_argument('--launcher', choices=('none', 'pytorch'),
                   default='none', help="'pytorch': this is one rank of "
                   'torchrun; every rank drills')
    p.add_argument('--work-dir', default=None,
                   help='where runs, bundles and logs go (default: a new '
                   'temporary directory)')
    p.add_argument('--image-size', type=int, default=320, metavar='N',
                   help='scale the pipelines\' images to this short side '
                   '(0: keep the config\'s)')
    p.add_argument('--synthetic', action='store_true',
                   help='a synthetic dataset even where the config\'s data '
                   'is at hand')
    p.add_argument('--timeout', type=float, default=900, metavar='S',
                   help='seconds a run may take before it is killed '
                   '(default 900)')
    p.add_argument('--json', action='store_true',
                   help='print the verdicts as JSON')
    p.set_defaults(func=_drill)

    p = sub.add_parser('demo', help='train a tiny detector on a synthetic '
                       'dataset with one planted defect and diagnose it')
    p.add_argument('--dota', action='store_true',
                   help='mmrotate rotated RetinaNet on DOTA-format data')
    p.add_argument('--work-dir', default=None,
                   help='where to write data, logs and bundles '
                   '(default: a new temporary directory)')
    p.set_defaults(func=_demo)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``mmnan``; returns the process exit code.

    Args:
        argv (list[str], optional): Arguments; ``sys.argv[1:]`` by default.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_OK
    if args.command != 'demo':
        _log_to_stderr()
    try:
        return args.func(args)
    except BundleError as error:
        return _bad_input(args.command, error)


def run() -> None:
    """The ``mmnan`` process: :func:`main`, then the exit (see
    :func:`mmnanhook.compat.exit_process`)."""
    compat.exit_process(main())


if __name__ == '__main__':
    run()
