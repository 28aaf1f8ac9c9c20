"""The agent contract: the committed schema is what the models generate, and what the agent answers fits it."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import ValidationError

from crossover.gateway.engines.agent_contract import SCHEMA_FILE, SERVER_STATES, ServerStatus, render_schema, schema


def test_the_committed_schema_is_what_the_models_generate():
    # On failure: python -m crossover.gateway.engines.agent_contract (rewrites
    # gateway/engines/agent_contract.schema.json).
    assert SCHEMA_FILE.read_text() == render_schema()
    jsonschema.Draft202012Validator.check_schema(json.loads(SCHEMA_FILE.read_text()))


def test_a_status_validates_against_the_schema_and_unknown_states_are_refused():
    status = ServerStatus(name="plain", role="plain", state="ready", pid=1, url="http://127.0.0.1:1", last_start_s=2.0)
    definitions = schema()
    validator = jsonschema.Draft202012Validator({**definitions, "$ref": "#/$defs/ServerStatus"})
    validator.validate(status.model_dump())
    assert set(SERVER_STATES) == set(definitions["$defs"]["ServerStatus"]["properties"]["state"]["enum"])
    with pytest.raises(ValidationError):
        ServerStatus(name="plain", role="plain", state="asleep", url="http://127.0.0.1:1")
    # A newer agent's extra field is ignored by an older gateway, not an error.
    assert ServerStatus.model_validate({**status.model_dump(), "gpu_memory_gb": 80}).state == "ready"
