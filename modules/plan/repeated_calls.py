"""A module called again on inputs of the same metadata, in the same state, holds the same bytes:
a phase pass (without grad, counting no FLOPs) runs such a call once and replays the rest.

A tiled VAE decode calls its decoder once per tile and latent frame (Wan's 480x832 sample of 33
frames: 15 tiles x 9 frames, 135 calls of four tile shapes), a tiled encode its encoder the same
way; each call on meta costs the same Python as a real one. The first call of each key runs and is
noted: the most bytes the pass held during it over what it held before (`rise`), what it holds
after it (`net`), its outputs' metadata, and what it left in the list arguments it mutates (a
causal VAE's `feat_cache` of each conv's last frames, its `feat_idx` counter). A later call of the
same key makes fresh empty outputs and list entries of that metadata, lets the replaced entries go
as the call would have, and raises the pass's peak by the noted rise: the same peak to the byte
(tests/test_plan_repeated_calls.py compares passes with and without).

The key: the module, its train flag, the grad mode, and every argument by metadata (a tensor's
shape, strides, dtype, device: not its storage offset, which differs from tile to tile and which no
kernel's output metadata reads), lists and tuples item by item (a cache entry, None, "Rep", an int).
A call is replayed only where all of it was seen: its outputs and new list entries are new
storages of their own, each what an empty tensor of its metadata is, no attribute of the module or
its submodules changed, and nothing else (a dict, an object) went in. Anything else runs every time.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

_PLAIN = frozenset((int, float, bool, str, type(None), torch.dtype, torch.device))
_UNSEEN = object()  # the note of a key whose call cannot be replayed


class _Unkeyable(Exception):
    pass


class RepeatedCalls:
    """Each of `modules` (by forward), and each `(owner, name)` of `methods` (a VAE's `blend_v`, which
    blends one tile's edge into the next row by row, in place: ~90 ops a row), replays its repeated
    calls inside `with calls.counting(live):`, against `live` (a LiveBytes counting no FLOPs). The
    notes hold from pass to pass (a call's bytes are its own: what it makes, and the cache entries
    earlier calls made), so one object serves the passes of one architecture that route attention
    alike (phase_pass.PhasePasses)."""

    def __init__(self, modules, methods=()):
        self.calls = [(module, "forward") for module in modules] + list(methods)
        self.live = None
        self._notes: dict[tuple, object] = {}
        self.replayed = 0

    @contextlib.contextmanager
    def counting(self, live):
        assert not live._formulas, "a replayed call would count no FLOPs"
        own = [vars(owner).get(name) for owner, name in self.calls]  # an owner's own attribute of the name
        self.live = live
        for owner, name in self.calls:
            setattr(owner, name, self._wrapped(owner, name, getattr(owner, name)))
        try:
            yield self
        finally:
            self.live = None
            for (owner, name), attribute in zip(self.calls, own):
                if attribute is None:
                    delattr(owner, name)  # (the class's method again)
                else:
                    setattr(owner, name, attribute)

    def _wrapped(self, owner, name, method):
        def call(*args, **kwargs):
            try:
                arguments = (_key(args), tuple(kwargs), _key(kwargs.values()))
            except _Unkeyable:
                return method(*args, **kwargs)
            key = (id(owner), name, getattr(owner, "training", None), torch.is_grad_enabled(), arguments)
            note = self._notes.get(key)
            if note is None:
                out, self._notes[key] = self._noted(owner, method, args, kwargs)
                return out
            if note is _UNSEEN:
                return method(*args, **kwargs)
            self.replayed += 1
            return self._replay(note, args, kwargs)
        return call

    def _noted(self, owner, method, args, kwargs):
        live = self.live
        lists = _lists((args, kwargs))
        before = [[_held(item) for item in items] for items in lists]  # (no reference: a replaced entry goes)
        attributes = _attributes(owner)
        metadata = _metadata((args, kwargs))
        held, peak = live.live, live.peak
        live.peak = held
        try:
            out = method(*args, **kwargs)
        finally:
            rise, live.peak = live.peak - held, max(peak, live.peak)
        note = _note(out, lists, before, (args, kwargs))
        if note is _UNSEEN or attributes != _attributes(owner):
            return out, _UNSEEN
        if _metadata((args, kwargs)) != metadata:  # (an in-place call leaves its arguments' metadata as it was)
            return out, _UNSEEN
        return out, (rise, live.live - held, *note)

    def _replay(self, note, args, kwargs):
        rise, net, out_spec, list_specs = note
        live = self.live
        held, peak = live.live, live.peak
        out = (*args, *kwargs.values())[out_spec[1]] if out_spec[0] == "argument" else _made(out_spec)
        for items, spec in zip(_lists((args, kwargs)), list_specs):
            length, changes = spec
            new = [_made(entry) for _index, entry in changes]
            del items[length:]
            items.extend([None] * (length - len(items)))
            for (index, _entry), value in zip(changes, new):
                items[index] = value
            del new
        # (the replay makes its tensors before the replaced entries go: not the call's order, so the
        # peak is the noted one, not the one the replay passed through)
        live.peak = max(peak, held + rise)
        if live.live - held != net:
            raise AssertionError(f"a replayed call holds {live.live - held} bytes where the call it replays held "
                                 f"{net}: modules/plan/repeated_calls.py missed a state it reads")
        return out


def _key(values) -> tuple:
    key = []
    for value in values:
        kind = type(value)
        if kind is torch.Tensor or kind is torch.nn.Parameter:
            if value.layout is not torch.strided:
                raise _Unkeyable
            key.append((value.shape, value.stride(), value.dtype, value.device, value.requires_grad))
        elif kind in _PLAIN:
            key.append((kind, value))
        elif kind is tuple or kind is list:
            key.append((kind, _key(value)))
        else:
            raise _Unkeyable
    return tuple(key)


def _metadata(value) -> list:
    """The metadata of the tensors among the arguments, lists left out (a call may replace their entries)."""
    if isinstance(value, torch.Tensor):
        return [(value.shape, value.stride(), value.dtype, value.storage_offset())]
    items = value.values() if isinstance(value, dict) else value if type(value) is tuple else ()
    return [m for item in items for m in _metadata(item)]


def _lists(value) -> list[list]:
    """The lists among the arguments (what a call may mutate), outermost first."""
    found = [value] if type(value) is list else []
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    for item in items:
        if isinstance(item, (tuple, list, dict)):
            found += _lists(item)
    return found


def _held(item):
    """What tells, after the call, whether a list entry is still `item`: a weak reference to a tensor."""
    return weakref.ref(item) if isinstance(item, torch.Tensor) else (item,)


def _unchanged(value, held) -> bool:
    return held() is value if isinstance(held, weakref.ref) else held[0] is value


def _storages(value) -> set[int]:
    """The storages of the tensors among the arguments, lists left out (their entries are noted apart)."""
    if isinstance(value, torch.Tensor):
        return {value.untyped_storage()._cdata}
    if isinstance(value, dict):
        value = list(value.values())
    if type(value) is tuple:
        return set().union(*(_storages(item) for item in value)) if value else set()
    return set()


def _attributes(module) -> dict:
    """Each submodule's attributes by identity (a call that sets one is not replayed)."""
    return {(name, key): id(value) for name, sub in module.named_modules() for key, value in vars(sub).items()}


def _note(out, lists, before, arguments):
    """(the outputs' spec, per list (its length, [(index, new entry's spec)])), or _UNSEEN."""
    given = (*arguments[0], *arguments[1].values())
    for index, value in enumerate(given):  # a call that returns an argument (a blend into it, in place)
        if isinstance(value, torch.Tensor) and out is value:
            if not _lists_unchanged(lists, before):
                return _UNSEEN
            return ("argument", index), [(len(items), []) for items in lists]
    taken = _storages(arguments)  # what is not new: the arguments' tensors, the entries the call kept
    for items, old in zip(lists, before):
        for index, value in enumerate(items):
            if index < len(old) and _unchanged(value, old[index]) and isinstance(value, torch.Tensor):
                taken.add(value.untyped_storage()._cdata)
    out_spec = _spec(out, taken)
    if out_spec is _UNSEEN:
        return _UNSEEN
    list_specs = []
    for items, old in zip(lists, before):
        changes = []
        for index, value in enumerate(items):
            if index < len(old) and _unchanged(value, old[index]):
                continue
            if isinstance(value, (tuple, list, dict)):
                return _UNSEEN
            spec = _spec(value, taken)
            if spec is _UNSEEN:
                return _UNSEEN
            changes.append((index, spec))
        list_specs.append((len(items), changes))
    return out_spec, list_specs


def _lists_unchanged(lists, before) -> bool:
    return all(len(items) == len(old) and all(_unchanged(v, h) for v, h in zip(items, old))
               for items, old in zip(lists, before))


def _spec(value, taken: set[int]):
    """What remakes `value`: ("tensor", shape, stride, dtype, device) for a new storage of its own
    (its storage added to `taken`), ("plain", value), ("tuple"/"list", [specs]); else _UNSEEN."""
    kind = type(value)
    if kind is torch.Tensor:
        storage = value.untyped_storage()
        if storage._cdata in taken or value.storage_offset() != 0 or value.requires_grad:
            return _UNSEEN
        taken.add(storage._cdata)
        spec = ("tensor", tuple(value.shape), value.stride(), value.dtype, value.device)
        with _no_modes():
            same = torch.empty_strided(spec[1], spec[2], dtype=spec[3], device="meta").untyped_storage().nbytes()
        return spec if same == storage.nbytes() else _UNSEEN
    if kind in _PLAIN:
        return ("plain", value)
    if kind is tuple or kind is list:
        specs = [_spec(item, taken) for item in value]
        return _UNSEEN if any(s is _UNSEEN for s in specs) else (kind.__name__, specs)
    return _UNSEEN


def _made(spec):
    kind = spec[0]
    if kind == "tensor":
        return torch.empty_strided(spec[1], spec[2], dtype=spec[3], device=spec[4])
    if kind == "plain":
        return spec[1]
    items = [_made(s) for s in spec[1]]
    return tuple(items) if kind == "tuple" else items


@contextlib.contextmanager
def _no_modes():
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield
