"""A work dir's story as one self-contained page (``mmnan inspect --html
WORK_DIR``), in ``report.html``'s style: no script, nothing fetched.

* The loss and the gradient norm over every run, from the runs' own logged
  scalars (an inline SVG, each run a colour; a long run thinned to the
  lowest and highest value of each of :data:`POINTS` stretches, so a spike
  stays in the picture), with every incident marked where it happened, a
  trigger's mark a link to its bundle's ``report.html``.
* Each run's incidents in a table, the bundles linked.
* The quarantined samples' pictures in a gallery: the pictures of the
  bundle that names the sample (its input as the model saw it, with the bad
  box in red; the file), else the image file itself where a browser shows
  it; inline up to :data:`EMBED_BYTES` in all, linked beyond.
"""
from __future__ import annotations

import base64
import html
import math
import os.path as osp
from typing import Sequence
from urllib.parse import quote

from ..records import IncidentKind
from ..report import page
from ._story import Scalars, Story, entry_lines

PAGE_FILE = 'nan_inspect.html'
# Stretches of a run's series the plot draws (two points each).
POINTS = 800
# Incidents marked by a line over the plot where there are no more; else
# the crashes, stops and rewinds among them.
LINES = 60
# What the gallery embeds in all, and one picture at most.
EMBED_BYTES = 32 << 20
EMBED_ONE = 4 << 20
_SHOWN = {'.png': 'image/png', '.jpg': 'image/jpeg', '.jpeg': 'image/jpeg',
          '.gif': 'image/gif', '.webp': 'image/webp', '.bmp': 'image/bmp'}

_RUN_COLOURS = ('#1864ab', '#2b8a3e', '#862e9c', '#e67700', '#0b7285',
                '#5c940d', '#a61e4d', '#495057')
# A mark's colour by what happened (a trigger's by what became of its step).
MARK_COLOURS = {
    'drop': '#e8590c', 'skip': '#7048e8', 'rewind': '#1c7ed6',
    'raise': '#c92a2a', 'propagate': '#c92a2a', 'apply': '#f59f00',
    'trigger': '#868e96', 'spike': '#f08c00', 'crash': '#000000',
    'quarantine': '#0ca678',
}
_STYLE = '''<style>
svg.plot { font: 11px sans-serif; background: #fff; border: 1px solid #ddd; }
svg.plot .axis { stroke: #888; stroke-width: 1; }
svg.plot .grid { stroke: #eee; stroke-width: 1; }
svg.plot polyline { fill: none; stroke-width: 1.5; }
svg.plot .mark line { stroke-width: 2; stroke-dasharray: 4 3; }
.legend span { display: inline-block; margin-right: 1.2em; }
.legend i { display: inline-block; width: 14px; height: 4px;
            vertical-align: middle; margin-right: 4px; }
.gallery { display: flex; flex-wrap: wrap; gap: 12px; }
.gallery figure { width: 360px; margin: 0; }
.gallery img { height: 160px; width: auto; max-width: 340px;
               margin-right: 4px; image-rendering: pixelated; }
td.act { white-space: nowrap; }
</style>'''

_W, _H, _LEFT, _RIGHT, _TOP, _GAP, _BOTTOM = 1000, 190, 70, 20, 24, 30, 36


def _e(value):
    return html.escape('' if value is None else str(value))


def _mark_kind(incident):
    if incident.kind == IncidentKind.TRIGGER:
        return incident.act or 'trigger'
    return incident.kind.value


def _link(path, page_dir):
    """A link from the page to ``path``: relative, so that the work dir
    can be copied or moved with its page."""
    try:
        target = osp.relpath(path, page_dir)
    except ValueError:
        return 'file://' + quote(path)
    return quote(target)


def _report_link(story, entry, page_dir):
    for path in entry.bundles:
        bundle = story.bundle(path)
        if bundle is not None and bundle.report_html:
            return _link(osp.join(path, 'report.html'), page_dir)
    return None


def _thin(iters, values):
    """``(iter, value)`` of the finite positive-or-not values, thinned to
    the lowest and highest of each of :data:`POINTS` stretches."""
    points = [(i, v) for i, v in zip(iters, values)
              if v is not None and math.isfinite(v)]
    if len(points) <= 2 * POINTS:
        return points
    size = len(points) / float(POINTS)
    thinned = []
    for n in range(POINTS):
        stretch = points[int(n * size):int((n + 1) * size)]
        if not stretch:
            continue
        low = min(stretch, key=lambda p: p[1])
        high = max(stretch, key=lambda p: p[1])
        thinned.extend(sorted({low, high}))
    return thinned


class _Axis(object):
    """Value -> pixel, log10 where the values are positive and span more
    than a factor of 20."""

    def __init__(self, low, high, top, height, log=None):
        if log is None:
            log = low > 0 and high / low > 20
        self.log = log
        f = math.log10 if log else float
        self.low, self.high = f(low), f(high)
        if self.high <= self.low:
            self.low, self.high = self.low - 1, self.high + 1
        self.f, self.top, self.height = f, top, height

    def __call__(self, value):
        if self.log and value <= 0:
            value = 10 ** self.low
        share = (self.f(value) - self.low) / (self.high - self.low)
        return self.top + self.height * (1 - share)

    def ticks(self):
        values = [self.low + (self.high - self.low) * k / 4.0
                  for k in range(5)]
        return [(10 ** v if self.log else v) for v in values]


def _panel(name, top, series, x):
    """One panel (``loss`` or ``grad_norm``): its axes, each run's line."""
    values = [v for _, points in series for _, v in points]
    parts = ['<text x="%d" y="%d" font-weight="bold">%s</text>' % (
        _LEFT, top - 6, _e(name))]
    bottom = top + _H
    parts.append('<line class="axis" x1="%d" y1="%d" x2="%d" y2="%d"/>' % (
        _LEFT, bottom, _W - _RIGHT, bottom))
    parts.append('<line class="axis" x1="%d" y1="%d" x2="%d" y2="%d"/>' % (
        _LEFT, top, _LEFT, bottom))
    if not values:
        parts.append('<text x="%d" y="%d" fill="#888">not logged</text>' % (
            _LEFT + 10, top + _H // 2))
        return parts
    y = _Axis(min(values), max(values), top, _H)
    for tick in y.ticks():
        py = y(tick)
        parts.append('<line class="grid" x1="%d" y1="%.1f" x2="%d" '
                     'y2="%.1f"/><text x="%d" y="%.1f" text-anchor="end">'
                     '%.3g</text>' % (_LEFT, py, _W - _RIGHT, py, _LEFT - 4,
                                      py + 4, tick))
    if y.log:
        parts.append('<text x="%d" y="%d" fill="#888">log scale</text>' % (
            _W - _RIGHT - 60, top - 6))
    for colour, points in series:
        if points:
            parts.append('<polyline stroke="%s" points="%s"/>' % (
                colour, ' '.join('%.1f,%.1f' % (x(i), y(v))
                                 for i, v in points)))
    return parts


def _plot(story: Story, scalars: Sequence[Scalars], page_dir: str
          ) -> str:
    """The SVG of the loss and gradient norm, the incidents marked."""
    colours = dict((run.run, _RUN_COLOURS[n % len(_RUN_COLOURS)])
                   for n, run in enumerate(story.runs))
    marked = [(run, e) for run in story.runs for e in run.entries
              if e.incident.iter is not None]
    iters = [i for s in scalars for i in s.iters] + [
        e.incident.iter for _, e in marked]
    if not iters:
        return ('<p id="plot">No scalars to plot: no run logged any '
                '(MMEngine writes them with a LocalVisBackend) and no '
                'incident has an iteration.</p>')
    low, high = min(iters), max(iters)
    if high <= low:
        high = low + 1
    width = _W - _LEFT - _RIGHT

    def x(i):
        return _LEFT + width * (i - low) / float(high - low)

    height = _TOP + 2 * _H + _GAP + _BOTTOM
    parts = ['<svg class="plot" id="plot" xmlns="http://www.w3.org/2000/svg" '
             'width="%d" height="%d" viewBox="0 0 %d %d">' % (
                 _W, height, _W, height)]
    for n, name in enumerate(('loss', 'grad_norm')):
        series = [(colours.get(s.run, '#000'),
                   _thin(s.iters, getattr(s, name))) for s in scalars]
        parts.extend(_panel(name, _TOP + n * (_H + _GAP), series, x))
    bottom = _TOP + 2 * _H + _GAP
    for tick in _ticks(low, high):
        parts.append('<line class="grid" x1="%.1f" y1="%d" x2="%.1f" '
                     'y2="%d"/><text x="%.1f" y="%d" text-anchor="middle">'
                     '%d</text>' % (x(tick), bottom, x(tick), bottom + 4,
                                    x(tick), bottom + 16, tick))
    parts.append('<text x="%d" y="%d" text-anchor="middle">iteration '
                 '(0-based, as mmnanhook counts; MMEngine logs it '
                 '1-based)</text>' % (_LEFT + width // 2, bottom + 32))
    # Every incident gets a line over both panels while there are few;
    # else only the crashes, stops and rewinds do, the rest a marker: a
    # long run's thousands of spikes would hide the plot.
    telling = sorted(range(len(marked)), key=lambda n: _RANK.get(
        _mark_kind(marked[n][1].incident), 4))
    lined = set(telling if len(telling) <= LINES else [
        n for n in telling[:LINES]
        if _RANK.get(_mark_kind(marked[n][1].incident), 4) <= 1])
    # A trigger's mark over the quarantine and spike of its iteration.
    for n in reversed(telling):
        entry = marked[n][1]
        parts.append(_mark(story, entry, n, x(entry.incident.iter), bottom,
                           page_dir, n in lined))
    parts.append('</svg>')
    legend = ''.join(
        '<span><i style="background:%s"></i>run %s</span>' % (
            colours[run.run], _e(run.run)) for run in story.runs)
    legend += ''.join(
        '<span><i style="background:%s"></i>%s</span>' % (colour, _e(name))
        for name, colour in sorted(MARK_COLOURS.items()))
    return '\n'.join(parts) + '<p class="legend">%s</p>' % legend


# Which incidents a line marks first (the rest: a marker).
_RANK = {'crash': 0, 'raise': 0, 'propagate': 0, 'rewind': 1, 'drop': 2,
         'skip': 2, 'apply': 3, 'trigger': 3, 'spike': 5, 'quarantine': 6}


def _ticks(low, high):
    """Whole iterations from ``low`` to ``high``, 1, 2 or 5 times a power
    of ten apart, at most 10 of them."""
    span = max(high - low, 1)
    step = next(m * 10 ** p for p in range(16) for m in (1, 2, 5)
                if span / float(m * 10 ** p) <= 10)
    first = -(-low // step) * step
    return list(range(int(first), int(high) + 1, int(step)))


def _mark(story, entry, n, px, bottom, page_dir, line=True):
    """One incident's mark: a dashed line over both panels (``line``) and
    a marker above them; a link to its bundle's report where it has
    one."""
    incident = entry.incident
    kind = _mark_kind(incident)
    colour = MARK_COLOURS.get(kind, '#868e96')
    title = ' '.join(entry_lines(story, entry)[0].split())
    top = _TOP - 2
    if incident.kind == IncidentKind.QUARANTINE:
        # Below the plot, and no line over it: its trigger's is there.
        top = bottom - 24
        marker = '<path d="M%.1f %d l5 6 l-5 6 l-5 -6 z" fill="%s"/>' % (
            px, bottom - 12, colour)
    elif incident.kind == IncidentKind.SPIKE:
        marker = '<circle cx="%.1f" cy="%d" r="5" fill="%s"/>' % (
            px, top + 5, colour)
    else:
        marker = '<path d="M%.1f %d l-6 -10 h12 z" fill="%s"/>' % (
            px, top + 10, colour)
    body = ('<g class="mark mark-%s" id="mark-%d" data-iter="%d" '
            'data-kind="%s"><title>%s</title>%s%s</g>' % (
                _e(kind), n, incident.iter, _e(incident.kind.value),
                _e(title), '<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" '
                'stroke="%s"/>' % (px, top, px, bottom, colour)
                if line else '', marker))
    link = _report_link(story, entry, page_dir)
    if link is not None:
        body = '<a href="%s">%s</a>' % (_e(link), body)
    return body


def _incidents(story: Story, page_dir: str) -> str:
    rows = []
    for run in story.runs:
        head = 'run %s' % run.run
        if run.journaled:
            head += ': %s at iter %s, world size %s, policy %r' % (
                'resumed' if run.resumed else 'began', run.start_iter,
                run.world_size, run.policy)
            if run.continues:
                head += ', continuing run %s' % run.continues
        end = ('ended at iter %s: %s' % (run.end_iter, run.ended)
               if run.ended is not None else 'its end is not journaled')
        rows.append('<tr class="run"><th colspan="5">%s; %s</th></tr>' % (
            _e(head), _e(end)))
        for entry in run.entries:
            rows.append(_incident_row(story, entry, page_dir))
    return ('<h2 id="incidents">Incidents</h2><table><tr><th>iter</th>'
            '<th>what</th><th>act</th><th>cause</th><th>bundle</th></tr>%s'
            '</table>' % ''.join(rows))


def _incident_row(story, entry, page_dir):
    incident = entry.incident
    lines = entry_lines(story, entry, at=False)
    what = incident.kind.value
    if incident.kind == IncidentKind.TRIGGER:
        what = '%s trigger' % (incident.trigger or '?')
    elif incident.kind == IncidentKind.SPIKE:
        what = '%s spike' % incident.series
    link = _report_link(story, entry, page_dir)
    bundle = '<a href="%s">report</a>' % _e(link) if link else ''
    return ('<tr class="incident" data-iter="%s" data-kind="%s"><td>%s</td>'
            '<td>%s</td><td class="act">%s</td><td>%s</td><td>%s</td></tr>'
            % (_e(incident.iter), _e(incident.kind.value), _e(incident.iter),
               _e(what), _e(incident.act or ''),
               '<br>'.join(_e(' '.join(line.split())) for line in lines),
               bundle))


class _Budget(object):
    """What the gallery may still embed."""

    def __init__(self):
        self.left = EMBED_BYTES

    def image(self, path, mime, alt, page_dir):
        try:
            size = osp.getsize(path)
        except OSError:
            return None
        if size > EMBED_ONE or size > self.left:
            return '<a href="%s">%s</a>' % (
                _e(_link(path, page_dir)), _e(osp.basename(path)))
        try:
            with open(path, 'rb') as f:
                data = f.read()
        except OSError:
            return None
        self.left -= len(data)
        return '<img alt="%s" src="data:%s;base64,%s">' % (
            _e(alt), mime, base64.b64encode(data).decode('ascii'))


def _gallery(story: Story, page_dir: str) -> str:
    if not story.quarantine:
        return ''
    budget, figures = _Budget(), []
    for q in story.quarantine:
        images = []
        bundle = story.bundle(q.bundle) if q.bundle else None
        if bundle is not None:
            for name in bundle.pictures.get(q.file, []):
                found = budget.image(osp.join(bundle.path, name), 'image/png',
                                     name, page_dir)
                if found:
                    images.append(found)
        if not images and q.file:
            mime = _SHOWN.get(osp.splitext(q.file)[1].lower())
            found = budget.image(q.file, mime, osp.basename(q.file),
                                 page_dir) if mime else None
            if found:
                images.append(found)
        caption = '%s: %s (%s, iter %s%s%s)' % (
            q.file or 'indices %s' % q.indices, q.reason or '?',
            q.source or '?', q.iter,
            ', rank %s' % q.rank if q.rank is not None else '',
            ', run %s' % q.run if q.run else '')
        figures.append('<figure class="quarantined">%s<figcaption>%s'
                       '</figcaption></figure>' % (
                           ''.join(images) or '<p>no picture: no bundle '
                           'names it and its file is not one a browser '
                           'shows</p>', _e(caption)))
    return ('<h2 id="quarantine">Quarantined samples</h2><div class='
            '"gallery">%s</div>' % ''.join(figures))


def _totals(story: Story) -> str:
    t = story.totals
    rows = [('triggers', t.triggers), ('steps skipped', t.skipped),
            ('steps taken again without samples (drop)', t.dropped),
            ('rewinds', t.rewinds), ('steps rewound', t.rewound_steps),
            ('steps left out in all', t.steps_left_out),
            ('triggers that stopped the run', t.raised),
            ('triggers warned of (the step applied)', t.warned),
            ('spikes', t.spikes), ('crashes (ranks that died in a step)',
                                   t.crashes),
            ('samples quarantined', t.quarantined), ('bundles', t.bundles),
            ('bundle bytes', t.bundle_bytes),
            ('journal lines left out (bounded)', t.omitted)]
    return '<h2 id="totals">Totals</h2><table>%s</table>' % ''.join(
        '<tr><th>%s</th><td>%s</td></tr>' % (_e(k), _e(v)) for k, v in rows)


def render_story(story: Story, scalars: Sequence[Scalars],
                 page_dir: str) -> str:
    """The page.

    Args:
        story (Story): :func:`~._story.read_story`'s.
        scalars (list[Scalars]): Its runs' scalars.
        page_dir (str): Where the page goes (its links are relative to
            it).

    Returns:
        str: HTML.
    """
    runs = len(story.runs)
    intro = ('<p class="summary" id="summary">%s</p>' % _e(
        '%d run%s; %d trigger%s, %d spike%s, %d crash%s, %d sample%s '
        'quarantined, %d step%s left out' % (
            runs, 's' if runs != 1 else '', story.totals.triggers,
            's' if story.totals.triggers != 1 else '', story.totals.spikes,
            's' if story.totals.spikes != 1 else '', story.totals.crashes,
            'es' if story.totals.crashes != 1 else '',
            story.totals.quarantined,
            's' if story.totals.quarantined != 1 else '',
            story.totals.steps_left_out,
            's' if story.totals.steps_left_out != 1 else '')))
    body = [_STYLE, intro, '<h2>Loss and gradient norm</h2>',
            _plot(story, scalars, page_dir), _incidents(story, page_dir),
            _gallery(story, page_dir), _totals(story)]
    if story.problems:
        body.append('<h2>Not read</h2><ul>%s</ul>' % ''.join(
            '<li>%s</li>' % _e(p) for p in story.problems))
    return page('mmnan inspect: %s' % story.work_dir, body)
