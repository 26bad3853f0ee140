"""``report.html``: one self-contained page per bundle (images inline).

Summary, kind, hints, where the first non-finite value was made (module,
op, ``file:line`` and the source lines around it), the loss terms, the
divergence if any, the history plot, the sample pictures, the versions and
the traceback. Nothing is fetched: it opens from a USB stick.
"""
from __future__ import annotations

import base64
import html
import linecache
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .._format import format_value
from ._summary import divergence_words, rise_words
from ._text import verified_hints

_STYLE = '''
body { font: 14px/1.45 -apple-system, "Segoe UI", Helvetica, Arial,
       sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.5em; margin-bottom: .2em; }
h2 { font-size: 1.15em; border-bottom: 1px solid #ddd; padding-bottom: .2em;
     margin-top: 1.8em; }
.kind { display: inline-block; background: #b00020; color: #fff;
        border-radius: 4px; padding: 2px 8px; font-weight: bold; }
.summary { font-size: 1.1em; background: #fff4f4; border-left: 4px solid
           #b00020; padding: .6em .9em; }
table { border-collapse: collapse; }
td, th { border: 1px solid #ddd; padding: 3px 8px; text-align: left;
         vertical-align: top; }
pre { background: #f6f8fa; padding: .7em; overflow-x: auto; }
.src .hit { background: #ffe08a; display: block; }
figure { margin: 1em 0; }
figcaption { color: #555; font-size: .9em; }
img { max-width: 100%; border: 1px solid #ddd; }
.bad { color: #b00020; }
.verified, .refuted, .untested { display: inline-block; border-radius: 4px;
        padding: 0 6px; font-size: .85em; color: #fff; }
.verified { background: #1b7f3b; } .refuted { background: #b00020; }
.untested { background: #777; }
'''


def _e(value):
    return html.escape('' if value is None else str(value))


def _image(data, alt):
    return '<img alt="{}" src="data:image/png;base64,{}">'.format(
        _e(alt), base64.b64encode(data).decode('ascii'))


def source_lines(location: Optional[str], context: int = 3
                 ) -> Optional[Tuple[int, List[str], int]]:
    """``(first line number, lines, hit line number)`` around a
    ``file:line``, or ``None`` when the file cannot be read."""
    if not location or ':' not in location:
        return None
    path, _, line = location.rpartition(':')
    try:
        line = int(line)
    except ValueError:
        return None
    lines = linecache.getlines(path)
    if not lines or line > len(lines):
        return None
    first = max(1, line - context)
    return first, lines[first - 1:line + context], line


def _where(report):
    rows = [(key, getattr(report, key)) for key in ('module', 'op',
                                                      'location', 'code')]
    parts = ['<table id="where">'] + [
        '<tr><th>{}</th><td><code>{}</code></td></tr>'.format(k, _e(v))
        for k, v in rows if v is not None] + ['</table>']
    found = source_lines(report.location)
    if found is not None:
        first, lines, hit = found
        body = ''.join(
            '<span class="{}">{:>5}  {}</span>'.format(
                'hit' if first + i == hit else '', first + i,
                _e(text.rstrip('\n')))
            if first + i == hit else '{:>5}  {}\n'.format(
                first + i, _e(text.rstrip('\n')))
            for i, text in enumerate(lines))
        parts.append('<pre class="src">{}</pre>'.format(body))
    return '\n'.join(parts)


def _losses(report, manifest):
    losses = dict(manifest.get('losses') or {})
    losses.update(report.losses or {})
    if not losses:
        return ''
    bad = set(report.nonfinite_losses or []) | set(
        manifest.get('nonfinite_losses') or [])
    rows = ''.join('<tr><th>{}</th><td class="{}">{}</td></tr>'.format(
        _e(k), 'bad' if k in bad else '', _e(format_value(v)))
        for k, v in losses.items())
    extra = ''
    for key, label in (('grad_norm', 'grad_norm'),
                       ('loss_scale', 'AMP loss scale')):
        value = manifest.get(key)
        if value is not None:
            extra += '<tr><th>{}</th><td>{}</td></tr>'.format(
                label, _e(format_value(value)))
    return '<h2>Loss terms</h2><table>{}{}</table>'.format(rows, extra)


def _samples(report, pictures):
    if not report.samples and not pictures:
        return ''
    parts = ['<h2>Samples</h2>']
    for sample in report.samples:
        parts.append('<p><b>sample {}</b> <code>{}</code></p><ul>{}</ul>'
                     .format(sample.index, _e(sample.name), ''.join(
                         '<li>{}</li>'.format(_e(p.text))
                         for p in sample.problems) or
                         '<li>no data problem found</li>'))
    for picture in pictures:
        parts.append('<figure id="{}">{}<figcaption>{}</figcaption>'
                     '</figure>'.format(_e(picture.name),
                                        _image(picture.png(), picture.title),
                                        _e(picture.title)))
    return '\n'.join(parts)


def _divergence(report):
    d = report.divergence
    if not d:
        return ''
    name, over = divergence_words(d)
    rows = [('began at iteration', d.began_at),
            ('series', name),
            ('value', format_value(d.value)),
            ('factor', '{}x {}'.format(format_value(d.factor), over)),
            ('rise', rise_words(d) or ''),
            ('lr there', format_value(d.lr)),
            ('spikes before the trigger', d.spikes)]
    grown = ''.join('<tr><td><code>{}</code></td><td>{}</td><td>{}</td></tr>'
                    .format(_e(g['name']), _e(format_value(g['before'])),
                            _e(format_value(g['after'])))
                    for g in d.grown)
    table = ''.join('<tr><th>{}</th><td>{}</td></tr>'.format(_e(k), _e(v))
                    for k, v in rows)
    if grown:
        grown = ('<p>Parameter norms that grew most:</p><table><tr><th>'
                 'parameter</th><th>before</th><th>now</th></tr>{}</table>'
                 .format(grown))
    return '<h2>Divergence</h2><table>{}</table>{}'.format(table, grown)


def _hints(report):
    if not report.hints:
        return ''
    verified = verified_hints(report)
    return '<h2>Hints</h2><ul>{}</ul>'.format(''.join(
        '<li>{}{}</li>'.format(
            '<span class="verified">verified</span> ' if i in verified
            else '', _e(h)) for i, h in enumerate(report.hints)))


def _fixes(report):
    """Each fix, marked verified (finite with it), refuted or untested."""
    if not report.fixes:
        return ''
    rows = []
    for fix in report.fixes:
        if fix.kind == 'none':
            rows.append('<tr><td><span class="untested">none</span></td>'
                        '<td colspan="3">no fix can be applied mechanically: '
                        '{}</td></tr>'.format(_e(fix.detail)))
            continue
        rows.append('<tr><td><span class="{0}">{0}</span></td><td>{1}</td>'
                    '<td>{2}</td><td>{3}</td></tr>'.format(
                        fix.status, _e(fix.fix),
                        _e(format_value(fix.loss)) if fix.loss is not None
                        else '', _e(fix.detail)))
    return ('<h2>Fixes, replayed</h2><p>The failing iteration replayed from '
            'the same weights, batch and RNG state with each fix.</p><table>'
            '<tr><th>result</th><th>fix</th><th>loss</th><th>how</th></tr>'
            '{}</table>'.format(''.join(rows)))


def config_section(findings: Sequence[Any]) -> str:
    """The config findings (``mmnan doctor``'s rules) as a page section;
    ``''`` when there are none.

    Args:
        findings (list[ConfigFinding]): The findings.
    """
    if not findings:
        return ''
    return ('<h2 id="config">Config findings (mmnan doctor)</h2><table>'
            '<tr><th>rule</th><th>where</th><th>what</th><th>seen in</th>'
            '<th>fix</th></tr>{}</table>').format(''.join(
                '<tr><td>{}</td><td><code>{}</code></td><td>{}</td><td>{}'
                '</td><td><code>{}</code></td></tr>'.format(
                    _e(f.rule), _e(f.where), _e(f.what), _e(f.why),
                    _e(f.fix)) for f in findings))


def page(title: str, body: List[str]) -> str:
    """A self-contained page in ``report.html``'s style.

    Args:
        title (str): Its title and heading.
        body (list[str]): Its sections, HTML.
    """
    return '\n'.join(
        ['<!DOCTYPE html><html><head><meta charset="utf-8">',
         '<title>{}</title><style>{}</style></head><body>'.format(
             _e(title), _STYLE),
         '<h1>{}</h1>'.format(_e(title))] + [b for b in body if b]
        + ['</body></html>'])


def render_html(report: Any, manifest: Dict[str, Any],
                pictures: Sequence[Any] = (),
                history_png: Optional[bytes] = None) -> str:
    """The page.

    Args:
        report (Report): The diagnosis.
        manifest (dict): The bundle's manifest (trigger, losses, versions).
        pictures (list[Picture]): Sample pictures.
        history_png (bytes, optional): ``history.png``.

    Returns:
        str: HTML.
    """
    kind = report.kind.value if report.kind is not None else 'unknown'
    title = 'mmnanhook: {} at iter {}'.format(kind, manifest.get('iter'))
    parts = [
        '<p><span class="kind">{}</span> trigger <code>{}</code>, rank {} '
        'of {}, epoch {}</p>'.format(
            _e(kind), _e(manifest.get('trigger')), _e(manifest.get('rank')),
            _e(manifest.get('world_size')), _e(manifest.get('epoch'))),
        '<p class="summary" id="summary">{}</p>'.format(_e(report.summary)),
    ]
    parts.append(_hints(report))
    parts.append(_fixes(report))
    if report.location or report.module is not None:
        parts.append('<h2>Where</h2>' + _where(report))
    parts.append(_divergence(report))
    parts.append(_losses(report, manifest))
    if history_png:
        parts.append('<h2>History</h2>' + _image(history_png, 'history'))
    parts.append(_samples(report, pictures))
    if report.notes:
        parts.append('<h2>Notes</h2><ul>{}</ul>'.format(''.join(
            '<li>{}</li>'.format(_e(n)) for n in report.notes)))
    parts.append(config_section(report.config_findings))
    if manifest.get('message'):
        parts.append('<h2>Message</h2><pre>{}</pre>'.format(
            _e(manifest['message'])))
    if report.traceback:
        parts.append('<h2>Traceback</h2><pre>{}</pre>'.format(
            _e(report.traceback)))
    versions = manifest.get('versions') or {}
    if versions:
        parts.append('<h2>Versions</h2><table>{}</table>'.format(''.join(
            '<tr><th>{}</th><td>{}</td></tr>'.format(_e(k), _e(v))
            for k, v in sorted(versions.items()))))
    return page(title, parts)
