"""The package's rooms by floor, as docs/how-it-works.md draws them: every
import of the package, at module level or inside a function, goes down."""
import ast
import os
import os.path as osp
import re

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))
PACKAGE = osp.join(REPO, 'mmnanhook')
DOC = osp.join(REPO, 'docs', 'how-it-works.md')


def floors():
    """``{room: floor}`` from the doc's block (top floor first); ``'_*'``
    stands for every underscore module of the package's top level."""
    text = open(DOC).read()
    block = re.search(r'The rooms by floor.*?```text\n(.*?)```', text,
                      re.S).group(1)
    rows = [line for line in block.splitlines() if line.strip()]
    found = {}
    for depth, line in enumerate(reversed(rows)):
        for name in line.split(','):
            name = name.strip()
            found[name[:-3] if name.endswith('.py') else name] = depth
    return found


def room(path):
    parts = osp.relpath(path, PACKAGE).split(os.sep)
    return parts[0][:-3] if len(parts) == 1 else parts[0]


def imported(path):
    """The rooms of the package that ``path`` imports."""
    package = osp.relpath(osp.dirname(path), osp.dirname(PACKAGE))
    package = package.split(os.sep)
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - node.level + 1]
            module = base + (node.module.split('.') if node.module else [])
        elif isinstance(node, ast.ImportFrom):
            module = (node.module or '').split('.')
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith('mmnanhook.'):
                    yield alias.name.split('.')[1]
            continue
        else:
            continue
        if module[0] != 'mmnanhook':
            continue
        if len(module) > 1:
            yield module[1]
        else:
            for alias in node.names:
                yield alias.name


def edges():
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith('.py'):
                path = osp.join(folder, name)
                for target in imported(path):
                    if target != room(path):
                        yield room(path), target, path


def _floor(table, name):
    if name in table:
        return table[name]
    assert name.startswith('_'), (
        'room %r has no floor in docs/how-it-works.md' % name)
    return table['_*']


def test_every_import_goes_down_a_floor():
    table = floors()
    bottom = table['_*']
    upward = []
    for source, target, path in edges():
        low, high = _floor(table, target), _floor(table, source)
        if not (low < high or low == high == bottom):
            upward.append('%s imports %s' % (osp.relpath(path, PACKAGE),
                                             target))
    assert upward == []


def test_tier_two_imports_nothing_of_tier_one():
    assert [path for source, target, path in edges()
            if source == 'diagnosis' and target == 'sentinel'] == []


def test_every_room_has_a_floor():
    table = floors()
    for name in os.listdir(PACKAGE):
        if name.endswith('.py') or osp.isfile(osp.join(PACKAGE, name,
                                                       '__init__.py')):
            _floor(table, name[:-3] if name.endswith('.py') else name)


def _modules(path):
    """The dotted modules of the package that ``path`` imports from."""
    package = osp.relpath(osp.dirname(path), osp.dirname(PACKAGE))
    package = package.split(os.sep)
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] \
                if node.level else []
            yield base + (node.module.split('.') if node.module else [])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.split('.')


def test_a_room_is_used_through_its_package_face():
    # docs/how-it-works.md: no room imports another room's underscore
    # module; what it uses is exported by that room's __init__.py.
    behind = []
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith('.py'):
                continue
            path = osp.join(folder, name)
            for module in _modules(path):
                if (len(module) > 2 and module[0] == 'mmnanhook' and
                        module[1] != room(path) and
                        osp.isdir(osp.join(PACKAGE, module[1])) and
                        module[2].startswith('_')):
                    behind.append('%s imports %s' % (
                        osp.relpath(path, PACKAGE), '.'.join(module)))
    assert behind == []
