"""Tag names (``gpupool.tag``) and their ids: a small integer per name, the same in every
pool of the process, which the pool keeps in each tagged block and segment
(``core/tagged.pxd``)."""

import threading

from gpupool.errors import SleepingMemoryError

__all__ = ["TAGS_MAX", "asleep_error", "tag_id", "tag_ids", "tag_name"]

TAGS_MAX = 255          # ids 1..TAGS_MAX; 0 is untagged (core/tagged.pxd has the same bound)

_lock = threading.Lock()
_ids = {}               # name -> id
_names = {}             # id -> name


def tag_id(name, create=True):
    """The id of tag ``name`` (a non-empty str); a new one when ``create``, else None for a
    name never used.

    Raises
    ------
    TypeError, ValueError
        ``name`` not a non-empty str, or more than TAGS_MAX tags in the process.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"a tag is a non-empty str, got {name!r}")
    with _lock:
        if name in _ids or not create:
            return _ids.get(name)
        if len(_ids) >= TAGS_MAX:
            raise ValueError(f"too many tags: a process has at most {TAGS_MAX}")
        _ids[name] = len(_ids) + 1
        _names[_ids[name]] = name
        return _ids[name]


def tag_ids(tags):
    """The ids of ``tags`` (a str or an iterable of str) used so far, in order, each once;
    names never used are left out (no memory carries them).

    Raises
    ------
    TypeError
        ``tags`` neither a str nor an iterable of non-empty str.
    """
    if isinstance(tags, str):
        tags = (tags,)
    try:
        names = list(tags)
    except TypeError:
        raise TypeError(f"tags must be a str or an iterable of str, got {tags!r}") from None
    ids = []
    for name in names:
        i = tag_id(name, create=False)
        if i is not None and i not in ids:
            ids.append(i)
    return ids


def tag_name(tag):
    """The name of tag id ``tag``."""
    return _names.get(tag, f"#{tag}")


def asleep_error(tag):
    """The SleepingMemoryError of a request made with tag id ``tag`` while that tag sleeps."""
    name = tag_name(tag)
    return SleepingMemoryError(f"the memory of tag {name!r} sleeps (Pool.sleep): wake it with "
                               f"pool.wake({name!r}) before allocating with this tag")
