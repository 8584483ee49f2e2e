"""The YAML a user writes — a run spec, a stage's options file — read so that it means exactly one
thing, or refused in one ``UserError`` line naming the file.

PyYAML's safe loader, with what it lets through refused:

- a key given twice in one mapping: YAML says a mapping's keys are unique, and PyYAML silently
  keeps the last, so ``seed: 1`` further up would be ignored (a merge key's ``<<`` entries may
  still be overridden, as YAML means them to be);
- a string that no file, path or terminal can hold: a lone surrogate (``"\\ud800"``, which UTF-8
  cannot encode), anywhere in a value or a key;
- nesting too deep for the reader (a recursion error, not a traceback).
"""

from __future__ import annotations

import yaml

from llamarl.lib.errors import UserError, one_line

_MERGE = "tag:yaml.org,2002:merge"


class _Loader(yaml.SafeLoader):
    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}  # key: the line it is first on
            for key_node, _ in node.value:
                if key_node.tag == _MERGE:
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    if key in seen:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"{key!r} is given twice (first on line {seen[key]}); keep one",
                            key_node.start_mark)
                    seen[key] = key_node.start_mark.line + 1
                except TypeError:
                    continue  # an unhashable key: the constructor refuses it
        return super().construct_mapping(node, deep)


def problem(e: yaml.YAMLError) -> str:
    """A YAML error in a few words, with its line and column where yaml knows them."""
    if isinstance(e, yaml.MarkedYAMLError) and e.problem_mark is not None:  # nearly every syntax error
        mark = e.problem_mark
        return f"line {mark.line + 1}, column {mark.column + 1}: {e.problem or e.context}"
    return str(e).splitlines()[0]


def load(stream, source: str):
    """The one YAML document of ``stream`` (text, or a text stream) as Python values, or a one-line
    ``UserError`` naming ``source``. Reading the stream may raise what reading raises (OSError,
    UnicodeDecodeError): the caller knows what the file was meant to be."""
    try:
        data = yaml.load(stream, Loader=_Loader)
    except yaml.YAMLError as e:
        raise UserError(f"{source}: not valid YAML ({problem(e)})") from None
    except RecursionError:
        raise UserError(f"{source}: nested too deeply to read; flatten it") from None
    _sound(data, source)
    return data


def _sound(data, source: str) -> None:
    """``data`` as small as its text and every string in it encodable, or a one-line error: YAML's
    aliases let a few lines name a structure of billions of values (each alias is the one object
    it names; "billion laughs"), or one that holds itself, which every reader after this one would
    walk for ever. So each mapping and list is visited once (by its id), and the values it stands
    for are counted with what it holds. Iterative: ``data`` may nest as deep as the reader let it."""
    counted: dict[int, int] = {}  # id of a mapping or list: the values it stands for, once done
    open_: set[int] = set()  # begun, not done: its own descendants
    stack = [((), data, False)]
    while stack:
        at, value, done = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise UserError(f"{source}: {_where(at)}: holds a lone surrogate ({value[e.start]!r}), which no file or "
                                "terminal can hold (UTF-8 cannot encode it); write the character itself") from None
        if not isinstance(value, (dict, list)):
            continue
        children = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        if done:
            open_.discard(id(value))
            counted[id(value)] = 1 + sum(counted.get(id(c), 1) for c in children)
            if counted[id(value)] > MAX_VALUES:
                raise UserError(f"{source}: {_where(at)}: stands for more than {MAX_VALUES} values (YAML aliases "
                                "repeating aliases); write out what is meant") from None
            continue
        if id(value) in counted:
            continue
        if id(value) in open_:
            raise UserError(f"{source}: {_where(at)}: holds itself (a YAML alias inside its own anchor); write out "
                            "what is meant") from None
        open_.add(id(value))
        stack.append((at, value, True))
        keys = list(value) if isinstance(value, dict) else range(len(value))
        stack += [(at + (k,), k, False) for k in keys if isinstance(k, str)]
        stack += [(at + (k,), value[k], False) for k in keys]


MAX_VALUES = 100_000  # a spec holds hundreds


def _where(at: tuple) -> str:
    return one_line(".".join(map(str, at))) or "the document"  # a key may hold the surrogate
