"""Input checks shared by the losses, the ranking functions and the sampler: tensors, and
the constructors' arguments (`checked_constructor`). A leaf module: it imports nothing
from pml-rank."""

import collections.abc
import difflib
import functools
import inspect
import math
import numbers
import re
import types
import typing

import numpy as np
import torch


def check_embeddings(component, **tensors):
    """Raise TypeError for non-float and ValueError for non-finite tensors, naming
    `component` (an instance or a name) and the tensor; return the largest magnitude in
    each, ``{name: float}``. `None` values are skipped."""
    owner = component if isinstance(component, str) else type(component).__name__
    given, tensors = tensors, {}
    for name, tensor in given.items():  # None skipped, and a tensor given twice checked once
        if tensor is not None and not any(tensor is t for t in tensors.values()):
            tensors[name] = tensor
    for name, tensor in tensors.items():
        if not torch.is_tensor(tensor) or not torch.is_floating_point(tensor):
            kind = tensor.dtype if torch.is_tensor(tensor) else type(tensor).__name__
            raise TypeError(f"{owner}: {name} must be a floating-point tensor, got {kind}")
    # One cheap pass each (isfinite is 10 times slower) and their results read back at once:
    # on a GPU, a kernel a tensor and one wait. The extremes are NaN or inf exactly where a value
    # is, and never overflow (a sum of finite values can). aminmax, not the inf-norm: on the CPU
    # the norm took 1.3 ms for a 2048 x 512 batch, aminmax 0.11 (sum 0.05).
    with torch.no_grad():  # no autograd node for a check
        extremes = [torch.stack(torch.aminmax(t)) if t.numel() else t.new_zeros(2) for t in tensors.values()]
    if len(extremes) > 1 and len({e.device for e in extremes}) == 1:
        # float32 (MPS has no float64): a float64 extreme beyond its range is read again alone.
        read = torch.stack([e.to(torch.float32) for e in extremes]).tolist()
    else:
        read = [e.tolist() for e in extremes]
    read = [pair if all(map(math.isfinite, pair)) else exact.tolist() for pair, exact in zip(read, extremes)]
    for (name, tensor), pair in zip(tensors.items(), read):
        if not all(map(math.isfinite, pair)):
            finite = torch.isfinite(tensor)
            bad = (~finite).nonzero()[0].tolist()
            raise ValueError(
                f"{owner}: {name} contains {int((~finite).sum())} NaN/Inf value(s), "
                f"first at index {tuple(bad)}: {tensor[tuple(bad)].item()}"
            )
    return {name: max(-low, high) for name, (low, high) in zip(tensors, read)}


def check_numbers(component, bound, **values):
    """Raise ValueError, naming `component` (an instance or a name) and the parameter, unless
    each of `values` is a finite real number within `bound`: "> 0", ">= 0" or "" (any)."""
    owner = component if isinstance(component, str) else type(component).__name__
    low, inclusive = {"> 0": (0.0, False), ">= 0": (0.0, True), "": (-math.inf, False)}[bound]
    for name, value in values.items():
        real = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not real or not math.isfinite(value) or value < low or (value == low and not inclusive):
            raise ValueError(f"{owner}: {name} must be a finite number{' ' + bound if bound else ''}, got {value!r}")


def check_references(component, labels, ref_emb, ref_labels):
    """Raise ValueError when labelled embeddings come with `ref_emb` but without `ref_labels`."""
    if ref_emb is not None and ref_labels is None and labels is not None:
        owner = component if isinstance(component, str) else type(component).__name__
        raise ValueError(f"{owner}: ref_emb was given without ref_labels; pass the labels of ref_emb as ref_labels")


# --- constructor arguments ---------------------------------------------------------------


def checked_constructor(cls):
    """Class decorator: ``cls(...)`` first checks every argument against the annotations of
    the constructor's signature (``step: float = 0.005``) and raises, naming the class, the
    parameter and the value: TypeError for a value of the wrong type (a number given as
    text included) or an unknown keyword. Range checks stay in the constructor.

    Every parameter must be annotated, or the class cannot be defined: a new parameter
    cannot skip the check. Keywords a constructor passes on with ``**kwargs`` are checked
    against the next constructor in the MRO, which must then be checked as well. Understood
    annotations: ``float`` (any real number, not a bool), ``int`` (not a bool), ``bool``,
    ``str``, ``None``, ``Callable``, any class (isinstance), and unions of them (``X | None``)."""
    init = cls.__dict__["__init__"]
    for parameter in _own_parameters(init):
        if parameter.annotation is inspect.Parameter.empty:
            raise TypeError(
                f"{cls.__name__}: constructor parameter {parameter.name!r} has no type annotation; "
                "annotate it (e.g. 'step: float = 0.005') so that its argument is checked"
            )

    @functools.wraps(init)
    def checked_init(self, *args, **kwargs):
        # Only the constructor called first checks: those it reaches through super() see
        # what it has already checked.
        if type(self).__init__ is checked_init:
            check_constructor_arguments(type(self), args, kwargs)
        init(self, *args, **kwargs)

    checked_init.checks_arguments = True
    cls.__init__ = checked_init
    constructor_parameters(cls)  # raises now if its **kwargs reach an unchecked constructor
    return cls


def constructor_parameters(cls):
    """``{name: inspect.Parameter}`` of every keyword ``cls(...)`` accepts: its constructor's
    own parameters, then those of each constructor that its ``**kwargs`` reach in the MRO."""
    parameters = {}
    for owner in cls.__mro__:
        init = owner.__dict__.get("__init__")
        if init is None:
            continue
        if not getattr(init, "checks_arguments", False):
            raise TypeError(
                f"{cls.__name__}: keyword arguments reach {owner.__name__}.__init__, whose arguments are not "
                "checked; decorate that class with pml_rank._checks.checked_constructor"
            )
        for parameter in _own_parameters(init):
            parameters.setdefault(parameter.name, parameter)
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(init).parameters.values()):
            return parameters
    return parameters


def check_constructor_arguments(cls, args, kwargs):
    """Raise TypeError, naming `cls`, for an unknown keyword or a value of the wrong type."""
    name = cls.__name__
    parameters = constructor_parameters(cls)
    for keyword in kwargs:
        if keyword not in parameters:
            close = difflib.get_close_matches(keyword, parameters, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; it takes {', '.join(parameters)}"
            raise TypeError(f"{name}: unexpected keyword argument {keyword!r}{hint}")
    signature = inspect.signature(cls.__init__)
    try:
        values = signature.bind(None, *args, **kwargs).arguments
    except TypeError as error:  # too many positional arguments, a missing required one
        raise TypeError(f"{name}: {error}") from None
    for parameter in list(signature.parameters.values())[1:]:
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            for keyword, value in values.get(parameter.name, {}).items():
                check_type(name, keyword, value, parameters[keyword].annotation)
        elif parameter.name in values:
            check_type(name, parameter.name, values[parameter.name], parameter.annotation)


def check_type(owner, parameter, value, annotation):
    """Raise TypeError naming `owner`, `parameter` and `value` when `value` does not match
    `annotation` (see `checked_constructor` for the annotations understood)."""
    if _matches(value, annotation):
        return
    expected = " or ".join(_describe(option) for option in _options(annotation))
    message = f"{owner}: {parameter} must be {expected}, got {_shown(value)}"
    if isinstance(value, str) and _is_number(value) and ({int, float} & set(_options(annotation))):
        message += _number_as_text_hint(value)
    raise TypeError(message)


def _own_parameters(init):
    """The named parameters of a constructor, without self, *args and **kwargs."""
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    parameters = list(inspect.signature(init, eval_str=True).parameters.values())[1:]
    return [p for p in parameters if p.kind in named]


def _options(annotation):
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return typing.get_args(annotation)
    return (annotation,)


def _matches(value, annotation):
    for option in _options(annotation):
        if option is None or option is type(None):
            matched = value is None
        elif option is float:
            matched = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
        elif option is int:
            matched = isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))
        elif option is collections.abc.Callable:
            matched = callable(value)
        elif isinstance(option, type):
            matched = isinstance(value, option)
        else:
            raise TypeError(f"check_type: unsupported annotation {option!r}")
        if matched:
            return True
    return False


_DESCRIPTIONS = {float: "a number", int: "an integer", bool: "True or False", str: "a string", type(None): "None"}


def _describe(option):
    if option is None or option in _DESCRIPTIONS:
        return _DESCRIPTIONS[type(None) if option is None else option]
    if option is collections.abc.Callable:
        return "callable"
    return f"a {option.__name__}"


def _shown(value):
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, (bool, np.bool_)):
        return f"the bool {value!r}"
    return f"{type(value).__name__} {value!r}"


def _is_number(text):
    try:
        float(text)
    except ValueError:
        return False
    return True


def _number_as_text_hint(text):
    """Why a number may have arrived as text: YAML 1.1 (PyYAML) reads a float only with a
    dot in the mantissa and a sign in the exponent, so 1e-2 stays the string '1e-2'."""
    parts = re.fullmatch(r"\s*([-+]?\d+)(\.\d*)?[eE]([-+]?)(\d+)\s*", text)
    if parts:
        mantissa, fraction, sign, exponent = parts.groups()
        spelled = f"{mantissa}{fraction if fraction and fraction != '.' else '.0'}e{sign or '+'}{exponent}"
        if spelled != text.strip():
            return f" (YAML reads {text.strip()} as text: write {spelled})"
    return f" (pass the number {text.strip()}, not text)"
