"""Request bodies that once made 500s under fuzzing: each is a 400 that names the problem."""

from __future__ import annotations

import pytest

from router.errors import ApiError
from tests.unit.test_router_auth import router

MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body, param, fragment", [
    ({"messages": MSG, "structured_outputs": 5}, None, "wrong type"),  # vLLM's before-validator crashed
    ({"messages": MSG, "tool_choice": "required"}, "tool_choice", "tools"),  # VLLMValidationError
    ({"messages": MSG, "stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ({"messages": [{"content": "no role"}]}, "messages[0].role", "role is required"),
    ({"messages": [MSG[0], {"author": {"role": "system"}, "channel": "x"}]}, "messages[1].role", "role"),
    ({"messages": []}, "messages", "non-empty"),
    ({"messages": "hello"}, "messages", "list"),
])
def test_bad_bodies_are_400_naming_the_problem(body, param, fragment):
    with pytest.raises(ApiError) as e:
        router()._validate("chat", body)
    assert e.value.status == 400 and e.value.param == param and fragment in e.value.message


def test_a_good_body_passes():
    body = router()._validate("chat", {"messages": MSG, "max_tokens": 4})
    assert body.messages[0]["role"] == "user" and body.max_tokens == 4
