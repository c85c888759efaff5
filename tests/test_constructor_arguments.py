"""Every constructor argument of every pml-rank component is checked at construction, by
the one helper `pml_rank._checks.checked_constructor`: a number given as text, a value of
another type and an unknown keyword raise an error naming the component, the parameter
and the value. Parametrised over the registered components and their constructors'
signatures, so a new component or a new parameter is covered without a new test."""

import inspect
import re

import pytest
import torch

import pml_rank
from pml_rank._checks import checked_constructor, constructor_parameters
from pml_rank.large_batch import LargeBatchMetricLossOnly
from pml_rank.losses import AUCLoss, NPairsMCLoss
from pml_rank.samplers import HardNegativeClassSampler

# The arguments a component cannot be built without: every other parameter has a default.
REQUIRED = {"HardNegativeClassSampler": {"labels": [0, 0, 1, 1, 2, 2, 3, 3], "classes_per_batch": 2}}


def _components():
    """pml-rank's own components, by name (third-party plugins make their own promises)."""
    return {c.name: c.cls for c in pml_rank.registry.components() if c.distribution == "pml-rank"}


def _parameters():
    return [
        pytest.param(name, parameter, id=f"{name}.{parameter.name}")
        for name, cls in _components().items()
        for parameter in constructor_parameters(cls).values()
    ]


def _numeric_parameters():
    return [case for case in _parameters() if {int, float} & set(_annotation_options(case.values[1].annotation))]


def _annotation_options(annotation):
    return getattr(annotation, "__args__", (annotation,))


def _build(name, **arguments):
    return _components()[name](**{**REQUIRED.get(name, {}), **arguments})


def _raises_naming(name, parameter, value, **arguments):
    with pytest.raises((TypeError, ValueError)) as error:
        _build(name, **{parameter: value}, **arguments)
    message = str(error.value)
    assert message.startswith(f"{name}: ") and parameter in message and repr(value) in message, message
    return error


class _Unfit:
    def __repr__(self):
        return "<unfit value>"


def test_every_component_is_covered_and_builds_with_its_defaults():
    assert {"AUCLoss", "FastAPLoss", "RaMBORecallLoss", "HardNegativeClassSampler"} <= set(_components())
    for name in _components():
        _build(name)


@pytest.mark.parametrize("name, parameter", _parameters())
def test_a_number_given_as_text_is_refused(name, parameter):
    _raises_naming(name, parameter.name, "1e-2")


@pytest.mark.parametrize("name, parameter", _parameters())
def test_a_value_of_another_type_is_a_type_error(name, parameter):
    error = _raises_naming(name, parameter.name, _Unfit())
    assert error.type is TypeError


@pytest.mark.parametrize("name, parameter", _numeric_parameters())
def test_a_bool_is_not_a_number(name, parameter):
    error = _raises_naming(name, parameter.name, True)
    assert error.type is TypeError and "got the bool True" in str(error.value)


@pytest.mark.parametrize("name, parameter", _parameters())
def test_a_misspelt_keyword_names_the_component_and_the_close_match(name, parameter):
    misspelt = parameter.name + "_"
    with pytest.raises(TypeError) as error:
        _build(name, **{misspelt: 1})
    assert str(error.value) == f"{name}: unexpected keyword argument {misspelt!r} (did you mean {parameter.name!r}?)"


def test_the_issue_cases_say_what_to_write():
    with pytest.raises(TypeError, match=re.escape("AUCLoss: step must be a number, got the string '1e-2'")) as error:
        AUCLoss(step="1e-2")
    assert "write 1.0e-2" in str(error.value)
    with pytest.raises(TypeError, match="AUCLoss: slope must be a number or None, got the string '50'"):
        AUCLoss(slope="50")
    with pytest.raises(TypeError, match="NPairsMCLoss: l2_reg_weight must be a number, got the string '2e-3'"):
        NPairsMCLoss(l2_reg_weight="2e-3")
    with pytest.raises(TypeError, match="HardNegativeClassSampler: classes_per_batch must be an integer, got the str"):
        HardNegativeClassSampler([0, 0, 1, 1], classes_per_batch="8")
    with pytest.raises(
        TypeError, match=re.escape("AUCLoss: unexpected keyword argument 'stepp' (did you mean 'step'?)")
    ):
        AUCLoss(stepp=0.01)
    with pytest.raises(TypeError, match="AUCLoss: too many positional arguments"):
        AUCLoss(0.01, None, -1.0, 1.0, None)


def test_numbers_of_every_kind_are_accepted():
    import numpy as np

    loss = pml_rank.losses.RaMBORecallLoss(lambda_val=4, margin=np.float32(0.05), memory_size=np.int64(2))
    assert loss.lambda_val == 4.0 and loss.memory.size == 2
    assert AUCLoss(step=np.float64(0.01), slope=50).slope == 50.0


def test_a_constructor_parameter_without_annotation_cannot_be_defined():
    with pytest.raises(TypeError, match="_Untyped: constructor parameter 'width' has no type annotation"):

        class _Untyped(pml_rank.losses.base.RankLossBase):
            def __init__(self, width=1.0, **kwargs):
                super().__init__(**kwargs)


def test_a_subclass_gets_the_check_and_passes_on_its_keywords():
    class _Wider(AUCLoss):
        def __init__(self, width: float = 1.0, **kwargs):
            super().__init__(**kwargs)
            self.width = width

    assert _Wider(width=2, step=0.01).width == 2
    assert list(inspect.signature(_Wider).parameters) == ["width", "kwargs"]
    with pytest.raises(TypeError, match="_Wider: step must be a number, got the string '0.01'"):
        _Wider(step="0.01")
    with pytest.raises(TypeError, match="_Wider: unexpected keyword argument 'widht' .did you mean 'width'"):
        _Wider(widht=2)


def test_a_constructor_passing_keywords_to_an_unchecked_one_cannot_be_defined():
    with pytest.raises(
        TypeError, match=r"_Forwards: keyword arguments reach \w+\.__init__, whose arguments are not checked"
    ):

        @checked_constructor
        class _Forwards(torch.utils.data.Sampler):
            def __init__(self, size: int, **kwargs):
                super().__init__(**kwargs)


@pytest.mark.parametrize("chunk_size, error", [("64", TypeError), (2.0, TypeError), (0, ValueError)])
def test_the_large_batch_trainer_checks_its_chunk_size_at_construction(chunk_size, error):
    with pytest.raises(error, match=f"LargeBatchMetricLossOnly: chunk_size must be .*, got .*{chunk_size!r}"):
        LargeBatchMetricLossOnly(chunk_size=chunk_size)
