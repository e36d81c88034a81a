"""The first pydantic problem as text (``uapplace.core.validation``): one extraction, each
edge's wording kept by parameters."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from uapplace.core.validation import first_error, first_error_text


class _Inner(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    size: int


class _Outer(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    items: list[_Inner]
    name: str


def _error(value: object, shape: type[BaseModel] = _Outer) -> ValidationError:
    with pytest.raises(ValidationError) as caught:
        shape.model_validate(value)
    return caught.value


def test_the_first_problem_names_its_path_and_counts_the_rest() -> None:
    first = first_error(_error({"items": [{"size": "x"}], "name": 3}))
    assert first.loc == ("items", 0, "size")
    assert first.msg == "Input should be a valid integer"
    assert first.input == "x"
    assert first.more == 1


def test_the_path_is_dotted_by_default_and_bracketed_or_json_style_on_request() -> None:
    first = first_error(_error({"items": [{"size": "x"}], "name": "n"}))
    assert first.where() == "items.0.size"
    assert first.where(part="[{}]", sep="") == "[items][0][size]"
    assert "$" + first.where(part=".{}", sep="") == "$.items.0.size"


def test_a_problem_with_the_whole_value_has_the_root_as_its_path() -> None:
    with pytest.raises(ValidationError) as caught:
        TypeAdapter(bool).validate_python("maybe", strict=True)
    first = first_error(caught.value)
    assert first.loc == ()
    assert first.where("body") == "body"
    assert first.where() == ""
    assert first_error_text(caught.value, "(value)") == "(value): Input should be a valid boolean"


def test_the_text_is_where_then_message() -> None:
    err = _error({"items": [], "name": "n", "extra": 1})
    assert first_error_text(err, "body") == "extra: Extra inputs are not permitted"
