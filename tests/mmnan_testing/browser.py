"""Headless Chromium for the tests that look at ``report.html``.

``make setup`` installs Debian's ``chromium`` where it can
(``scripts/setup_browser.sh``); where it could not, :data:`SKIP_REASON` says
so and the tests skip with it.
"""
import os
import shutil
import subprocess

BINARIES = ('chromium', 'chromium-browser', 'google-chrome')
SKIP_REASON = ('no headless Chromium on PATH ({}); `make setup` installs '
               'Debian\'s chromium when it runs as root with apt-get'.format(
                   ', '.join(BINARIES)))
_FLAGS = ('--headless', '--no-sandbox', '--disable-gpu',
          '--disable-dev-shm-usage', '--no-first-run',
          '--disable-background-networking', '--disable-extensions',
          '--hide-scrollbars', '--force-device-scale-factor=1')


def chromium():
    """The path of a Chromium binary, or ``None``."""
    for name in BINARIES:
        path = shutil.which(name)
        if path:
            return path
    return None


def _run(page, work_dir, *flags):
    profile = os.path.join(work_dir, 'chromium-profile')
    command = [chromium()] + list(_FLAGS) + [
        '--user-data-dir=' + profile] + list(flags) + [
            'file://' + os.path.abspath(page)]
    return subprocess.run(command, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, timeout=120, check=True)


def dump_dom(page, work_dir):
    """The DOM of ``page`` after Chromium loaded and laid it out."""
    return _run(page, work_dir, '--dump-dom').stdout.decode('utf-8')


def screenshot(page, work_dir, size=(1200, 2400)):
    """A PNG screenshot of ``page``; returns its path."""
    path = os.path.join(work_dir, 'screenshot.png')
    _run(page, work_dir, '--screenshot=' + path,
         '--window-size={},{}'.format(*size))
    return path
