"""The report's JSON schema (JSON Schema draft 2020-12; tests validate every report against it) and a
validator for the subset it uses, for where the jsonschema package is not installed."""
from __future__ import annotations

SCHEMA_VERSION = 4   # 2: torch.compile columns; every side timed by latency.side_ms; 3: ORT optimizer row;
#                      4: eager_spread / accelc_spread, each timing's spread

_NUM = {"type": ["number", "null"]}
_ROW = {
    "type": "object",
    "required": ["layer", "kind", "status", "kernel", "reason", "input_shape", "eager_ms", "ort_ms", "accelc_ms",
                 "speedup_vs_ort", "speedup_vs_eager", "accelc_rel_error", "ort_rel_error", "accelc_pass",
                 "compile_ms", "speedup_vs_compile"],
    "properties": {
        **{k: {"type": "string"} for k in ("layer", "kind", "status", "kernel", "reason", "input_shape",
                                           "dtype", "ort_export", "ort_error", "timer", "compile_error")},
        **{k: _NUM for k in ("eager_ms", "ort_ms", "accelc_ms", "speedup_vs_ort", "speedup_vs_eager",
                             "compile_ms", "compile_ro_ms", "speedup_vs_compile",
                             "accelc_rel_error", "accelc_max_abs_error", "accelc_sqnr_db", "ort_rel_error",
                             "ort_max_abs_error", "ort_sqnr_db", "eager_rel_error", "tolerance", "eager_spread",
                             "accelc_spread")},
        "accelc_pass": {"type": ["boolean", "null"]}, "ort_pass": {"type": ["boolean", "null"]},
    },
}
REPORT_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "accelc per-layer report",
    "type": "object",
    "required": ["schema_version", "header", "layers", "totals", "end_to_end"],
    "properties": {
        "schema_version": {"const": SCHEMA_VERSION},
        "header": {"type": "object", "required": ["model", "date", "device", "versions", "ort", "dtype", "timer",
                                                  "interpreted", "note"],
                   "properties": {"interpreted": {"type": "boolean"}, "versions": {"type": "object"}}},
        "layers": {"type": "array", "items": {**_ROW, "properties": {
            **_ROW["properties"], "status": {"enum": ["rewritten", "reverted", "kept"]}}}},
        "totals": {"type": "object", "required": ["eager_ms", "accelc_ms", "ort_ms", "speedup_vs_eager",
                                                  "speedup_vs_ort"]},
        "end_to_end": _ROW,
    },
}


_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def validate(data, schema: dict = REPORT_SCHEMA, where: str = "report") -> None:
    """Check `data` against `schema` (the subset of JSON Schema REPORT_SCHEMA uses: type, required,
    properties, items, enum, const), so that a report can be checked where the jsonschema
    package is not installed. Raises ValueError naming the first offending field."""
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        ok = any((isinstance(data, (int, float)) and not isinstance(data, bool)) if t == "number"
                 else isinstance(data, _TYPES[t]) for t in types)
        if not ok:
            raise ValueError(f"{where}: {data!r:.60} is not of type {types}")
    if "const" in schema and data != schema["const"]:
        raise ValueError(f"{where}: {data!r} is not {schema['const']!r}")
    if "enum" in schema and data not in schema["enum"]:
        raise ValueError(f"{where}: {data!r} is not one of {schema['enum']}")
    if isinstance(data, dict):
        for key in schema.get("required", []):
            if key not in data:
                raise ValueError(f"{where}: missing {key!r}")
        for key, sub in schema.get("properties", {}).items():
            if key in data:
                validate(data[key], sub, f"{where}.{key}")
    if isinstance(data, list) and "items" in schema:
        for i, item in enumerate(data):
            validate(item, schema["items"], f"{where}[{i}]")
