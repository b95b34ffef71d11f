"""The one reader of ``NAME=VALUE`` option items, and its one-line error naming the option
and the item."""

from __future__ import annotations

import pytest

from agentbolt.cli.assignments import assignments, env_templates
from agentbolt.cli.ray import parse_resources
from agentbolt.errors import ConfigError


def test_items_split_at_the_first_equals_sign_and_a_later_name_wins():
    items = ["Q={question}", " N = 1", "URL=http://x/?a=b", "Q={other}", "EMPTY="]
    assert env_templates(items, "--env") == {
        "Q": "{other}",
        "N": " 1",
        "URL": "http://x/?a=b",
        "EMPTY": "",
    }


@pytest.mark.parametrize("item", ["NOEQUALS", "=value", "  =value"])
def test_an_item_without_a_name_names_the_option_and_the_item(item):
    with pytest.raises(ConfigError) as err:
        assignments([item], "--program.env", "NAME=TEMPLATE", "QUESTION={question}")
    assert (
        str(err.value) == f"--program.env {item!r} must look like NAME=TEMPLATE, e.g. QUESTION={{question}}"
    )


def test_ray_resources_are_amounts_each_named_once():
    assert parse_resources(["sandbox=1", " gpu_slot =0.5"]) == {"sandbox": 1.0, "gpu_slot": 0.5}
    for bad in ("sandbox", "sandbox=-1", "sandbox=lots", "=1"):
        with pytest.raises(ConfigError, match=rf"--ray-resource '{bad}' must look like NAME=AMOUNT"):
            parse_resources([bad])
    with pytest.raises(ConfigError, match="--ray-resource 'sandbox' is given twice"):
        parse_resources(["sandbox=1", "sandbox=2"])
