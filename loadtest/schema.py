"""The schema of results.json (a JSON Schema document), validated by the `jsonschema` package.

Bump SCHEMA_VERSION when a field changes meaning or goes away; adding a field keeps the version.
`python -m loadtest schema` prints the schema. Imports nothing from `gateway`.
"""

from __future__ import annotations

from typing import Any

from jsonschema import Draft202012Validator  # type: ignore[import-untyped]  # no stubs shipped

SCHEMA_VERSION = 2

_NUM = {"type": ["number", "null"]}
_INT = {"type": ["integer", "null"]}
_STR = {"type": ["string", "null"]}


def _object(properties: dict[str, Any], *, extra: bool = True) -> dict[str, Any]:
    return {"type": "object", "required": list(properties), "properties": properties, "additionalProperties": extra}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


# vLLM's figures of one metric (ms): its mean and the percentiles asked for; null when no request succeeded.
_FIGURES = _nullable(_object({"mean": {"type": "number"}, "p50": {"type": "number"}, "p90": {"type": "number"},
                              "p99": {"type": "number"}}))  # fmt: skip
_COUNTS = {"type": "object", "additionalProperties": {"type": "integer"}}
_SERIES = {"type": ["object", "null"], "additionalProperties": {"type": "number"}}
_GPU = _object(
    {"index": {"type": "integer"}, "name": {"type": "string"}, "used_mib": {"type": "number"}, "total_mib": _NUM}
)
_SNAPSHOT = _object({"at": {"type": "number"}, "metrics": _SERIES, "gpus": {"type": ["array", "null"], "items": _GPU}})

SUMMARY = _object(
    {
        "completed": {"type": "integer"},
        "failed": {"type": "integer"},
        "duration_s": {"type": "number"},
        "requests_per_s": {"type": "number"},
        "input_tokens": {"type": "integer"},
        "output_tokens": {"type": "integer"},
        "output_tokens_per_s": {"type": "number"},
        "goodput": _object(
            {
                "slo_ttft_ms": _NUM,
                "slo_e2el_ms": _NUM,
                "requests": _INT,
                "fraction": _NUM,
                "per_s": _NUM,
            }
        ),
        "ttft_ms": _FIGURES,
        "tpot_ms": _FIGURES,
        "itl_ms": _FIGURES,
        "e2el_ms": _FIGURES,
        "client_queue_time_ms": _FIGURES,
        "errors": _COUNTS,
    }
)

REQUEST = _object(
    {
        "start_s": {"type": "number"},
        "ttft_ms": _NUM,
        "latency_ms": _NUM,
        "input_tokens": {"type": "integer"},
        "output_tokens": {"type": "integer"},
        "error": _STR,
    }
)

CLIENT = _object(
    {
        "cpu_s": {"type": "number"},
        "wall_s": {"type": "number"},
        "run_cpu_share": _NUM,
        "returncode": {"type": "integer"},
        "timed_out": {"type": "boolean"},
        "bound": {"type": "boolean"},
    }
)

POINT = _object(
    {
        "label": {"type": "string"},
        "concurrency": _INT,
        "rate": _NUM,
        "max_concurrency": _INT,
        "profile": _STR,
        "base_url": {"type": "string"},
        "seed": {"type": "integer"},
        "num_prompts": {"type": "integer"},
        "summary": SUMMARY,
        "client": CLIENT,
        "telemetry": _object(
            {
                "before": _SNAPSHOT,
                "after": _SNAPSHOT,
                "metrics_delta": _SERIES,
                "server_side": {"type": "object"},
                "gpu_used_mib_after": _NUM,
            }
        ),
        "requests": {"type": "array", "items": REQUEST},
    }
)

_PROMPTS = {
    "oneOf": [
        _object(
            {
                "source": {"const": "random"},
                "input_len": {"type": "integer"},
                "range_ratio": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
            }
        ),
        _object({"source": {"const": "file"}, "path": {"type": "string"}}),
    ]
}

RESULTS_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "nemotron-loadtest results.json",
    **_object(
        {
            "schema_version": {"type": "integer", "enum": [SCHEMA_VERSION]},
            "kind": {"type": "string", "enum": ["run", "sweep", "profiles"]},
            "created": {"type": "string"},
            "revision": {"type": "string"},
            "client": _object({"program": {"type": "string"}, "version": _STR}),
            "target": _object({"base_url": {"type": "string"}, "model": {"type": "string"}, "via": _STR}),
            "workload": _object(
                {
                    "endpoint": {"type": "string", "enum": ["chat", "completions"]},
                    "prompts": _PROMPTS,
                    "output_len": _INT,
                    "temperature": {"type": "number"},
                    "ignore_eos": {"type": "boolean"},
                    "seed": {"type": "integer"},
                    "requests": _INT,
                    "duration_s": {"type": "number"},
                    "time_box_s": {"type": "number"},
                    "warmup": {"type": "integer"},
                    "burstiness": {"type": "number"},
                    "slo_ttft_ms": _NUM,
                    "slo_e2el_ms": _NUM,
                    "tokenizer": {"type": "string"},
                }
            ),
            "points": {"type": "array", "items": POINT},
            "failures": {"type": "object", "additionalProperties": {"type": "string"}},
        }
    ),
}


def validate(document: Any, schema: dict[str, Any] = RESULTS_SCHEMA) -> list[str]:
    """Every place `document` breaks `schema`, as `$.path: what is wrong` (jsonschema's own messages)."""
    validator = Draft202012Validator(schema)
    return [f"{error.json_path}: {error.message}" for error in validator.iter_errors(document)]
