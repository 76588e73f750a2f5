"""The schema of results.json (a JSON Schema document), validated by the `jsonschema` package.

Bump SCHEMA_VERSION when a field changes meaning or goes away; adding a field keeps the version.
`python -m loadtest schema` prints the schema. Imports nothing from `gateway`.
"""

from __future__ import annotations

from typing import Any

from jsonschema import Draft202012Validator  # type: ignore[import-untyped]  # no stubs shipped

SCHEMA_VERSION = 1

_NUM = {"type": ["number", "null"]}
_INT = {"type": ["integer", "null"]}
_STR = {"type": ["string", "null"]}


def _object(properties: dict[str, Any], *, extra: bool = True) -> dict[str, Any]:
    return {"type": "object", "required": list(properties), "properties": properties, "additionalProperties": extra}


_DISTRIBUTION = _object(
    {"count": {"type": "integer"}, "mean": _NUM, "p50": _NUM, "p90": _NUM, "p99": _NUM, "max": _NUM}
)
_COUNTS = {"type": "object", "additionalProperties": {"type": "integer"}}
_SERIES = {"type": ["object", "null"], "additionalProperties": {"type": "number"}}
_GPU = _object(
    {"index": {"type": "integer"}, "name": {"type": "string"}, "used_mib": {"type": "number"}, "total_mib": _NUM}
)
_SNAPSHOT = _object({"at": {"type": "number"}, "metrics": _SERIES, "gpus": {"type": ["array", "null"], "items": _GPU}})

SUMMARY = _object(
    {
        "requests": {"type": "integer"},
        "ok": {"type": "integer"},
        "errors": _COUNTS,
        "first_errors": {"type": "object", "additionalProperties": {"type": "string"}},
        "wall_s": {"type": "number"},
        "requests_per_s": {"type": "number"},
        "output_tokens": {"type": "integer"},
        "output_tokens_per_s": {"type": "number"},
        "prompt_tokens": _INT,
        "usage_reported": {"type": "integer"},
        "latency_ms": _DISTRIBUTION,
        "ttft_ms": _DISTRIBUTION,
        "itl_mean_ms": _DISTRIBUTION,
        "itl_p99_ms": _DISTRIBUTION,
        "tpot_ms": _DISTRIBUTION,
        "stream_tokens_per_s": _DISTRIBUTION,
        "dispatch_lag_ms": _DISTRIBUTION,
        "goodput": _object(
            {
                "slo_ttft_ms": _NUM,
                "slo_latency_ms": _NUM,
                "requests": {"type": "integer"},
                "fraction": _NUM,
                "per_s": {"type": "number"},
            }
        ),
    }
)

REQUEST = _object(
    {
        "index": {"type": "integer"},
        "sent_at_s": {"type": "number"},
        "lag_ms": _NUM,
        "outcome": {"type": "string"},
        "status": {"type": "integer"},
        "latency_ms": _NUM,
        "ttft_ms": _NUM,
        "itl_mean_ms": _NUM,
        "itl_p99_ms": _NUM,
        "output_tokens": {"type": "integer"},
        "prompt_tokens": _INT,
        "token_events": {"type": "integer"},
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
        "summary": SUMMARY,
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

RESULTS_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "nemotron-loadtest results.json",
    **_object(
        {
            "schema_version": {"type": "integer", "enum": [SCHEMA_VERSION]},
            "kind": {"type": "string", "enum": ["run", "sweep", "profiles"]},
            "created": {"type": "string"},
            "revision": {"type": "string"},
            "target": _object({"base_url": {"type": "string"}, "model": {"type": "string"}, "via": _STR}),
            "workload": _object(
                {
                    "endpoint": {"type": "string", "enum": ["chat", "completions"]},
                    "stream": {"type": "boolean"},
                    "prompts": {"type": "object"},
                    "max_tokens": {"type": "array", "items": {"type": "integer"}},
                    "temperature": {"type": "number"},
                    "ignore_eos": {"type": "boolean"},
                    "seed": {"type": "integer"},
                    "requests": {"type": "integer"},
                    "duration_s": {"type": "number"},
                    "warmup": {"type": "integer"},
                    "timeout_s": {"type": "number"},
                }
            ),
            "points": {"type": "array", "items": POINT},
        }
    ),
}


def validate(document: Any, schema: dict[str, Any] = RESULTS_SCHEMA) -> list[str]:
    """Every place `document` breaks `schema`, as `$.path: what is wrong` (jsonschema's own messages)."""
    validator = Draft202012Validator(schema)
    return [f"{error.json_path}: {error.message}" for error in validator.iter_errors(document)]
