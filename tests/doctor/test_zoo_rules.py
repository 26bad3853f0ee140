"""No false alarms on the zoo: the config rules over every config file the
installed mmdet, mmrotate and mmseg ship, unmodified. Each finding there is a
hazard docs/doctor.md justifies; the counts per rule are the README's
(this test reads them from its table, for the versions of this leg)."""
import importlib
import os.path as osp
import re

import pytest

from mmnan_testing.doctor_zoo import PACKAGES, sweep

README = osp.join(osp.dirname(osp.dirname(osp.dirname(
    osp.abspath(__file__)))), 'README.md')


def _readme_counts():
    """``{(package, version): {rule: count}}`` of the README's table, and
    ``{(package, version): configs}``."""
    with open(README) as f:
        text = f.read()
    found = re.search(r'^\| rule \|(.+)\|\n\|[-|]+\|\n((?:\|.*\|\n)+)', text,
                      re.M)
    header, rows = found.groups()
    columns = [re.match(r'\s*(\w+) ([\w.]+) \((\d+) configs\)\s*$', c)
               .groups() for c in header.split('|')]
    counts = dict(((p, v), {}) for p, v, _ in columns)
    for rule, cells in re.findall(r'^\| `(\w+)` \|(.+)\|$', rows, re.M):
        for (package, version, _), cell in zip(columns, cells.split('|')):
            counts[(package, version)][rule] = int(cell.strip() or 0)
    return counts, dict(((p, v), int(n)) for p, v, n in columns)


@pytest.mark.zoo_full
def test_the_readme_counts_what_the_rules_find_on_the_zoo():
    counts, configs = _readme_counts()
    found = sweep()
    checked = 0
    for package in PACKAGES:
        if package not in found:
            continue
        version = importlib.import_module(package).__version__
        if (package, version) not in counts:
            continue
        checked += 1
        result = found[package]
        assert result['configs'] == configs[(package, version)]
        expected = dict((r, n) for r, n in counts[(package, version)].items()
                        if n)
        assert dict(result['counts']) == expected, sorted(
            (p, [f.rule for f in fs]) for p, fs in result['findings'].items())
    assert checked >= 2  # modern: mmdet, mmseg; DOTA: mmdet, mmrotate
