//! The user-facing references, generated from schemas so they cannot drift from what is
//! enforced: the `SessionPipeline` resource from the CRD's own schema (descriptions, types,
//! defaults, bounds, CEL rules), and the worker's stage config file from the JSON schema of
//! the worker's own config type. `sessionflow-operator reference [--worker]` prints them;
//! `docs/crd-reference.md` and `docs/worker-config.md` are that output, checked by tests.

use std::fmt::Write;

use kube::CustomResourceExt;
use serde_json::Value;

use crate::crd::SessionPipeline;

/// Kubernetes types documented elsewhere: not expanded.
const OPAQUE: &[(&str, &str)] = &[
    ("spec.stages[].resources", "core/v1 ResourceRequirements"),
    ("status.conditions[]", "meta/v1 Condition"),
];

/// The reference as Markdown.
pub fn markdown() -> String {
    let crd = serde_json::to_value(SessionPipeline::crd()).expect("the CRD serializes");
    let schema = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
    let mut out = String::new();
    out.push_str(
        "# SessionPipeline reference\n\n\
         `sessionpipelines.sessionflow.io/v1alpha1`, namespaced, short name `sp`. Generated from \
         the CRD schema by `sessionflow-operator reference`; do not edit by hand.\n\n",
    );
    for (section, title) in [
        ("spec", "Spec"),
        ("status", "Status (written by the operator)"),
    ] {
        let _ = writeln!(out, "## {title}\n");
        out.push_str("| field | type | default | rules |\n|---|---|---|---|\n");
        let mut rows = Vec::new();
        walk(&schema["properties"][section], section, &mut rows);
        for row in rows {
            out.push_str(&row);
        }
        out.push('\n');
    }
    out.push_str("## Rules on the whole resource\n\n");
    for rule in rules(schema) {
        let _ = writeln!(out, "- {rule}");
    }
    out
}

/// The worker's stage config file (`sessionflow-worker run --config`) as Markdown.
pub fn worker_markdown() -> String {
    let generator = schemars::generate::SchemaSettings::draft07()
        .with(|s| s.inline_subschemas = true)
        .into_generator();
    let schema = generator.into_root_schema_for::<sessionflow_worker::StageConfig>();
    let schema = serde_json::to_value(schema).expect("the schema serializes");
    let mut out = String::from(
        "# Worker stage config reference\n\n\
         The YAML file of `sessionflow-worker run --config FILE` (camelCase keys; unknown keys are \
         refused). On Kubernetes the operator renders it from a SessionPipeline stage. Generated \
         from the worker's config type by `sessionflow-operator reference --worker`; do not edit \
         by hand. Values are also checked when the worker starts (exit code 2 naming the key).\n\n\
         | key | type | default | meaning |\n|---|---|---|---|\n",
    );
    let mut rows = Vec::new();
    walk(&schema, "", &mut rows);
    for row in rows {
        out.push_str(&row.replacen("| `.", "| `", 1));
    }
    out.push_str(
        "\nSASL credentials may also come from the environment: `SESSIONFLOW_SASL_USERNAME`, \
         `SESSIONFLOW_SASL_PASSWORD` (`kafka.sasl.username` / `kafka.sasl.password`).\n",
    );
    out
}

fn walk(schema: &Value, path: &str, rows: &mut Vec<String>) {
    // A tagged enum (the handler: `http` or `builtin`) lists its variants under oneOf.
    if let Some(variants) = schema["oneOf"].as_array() {
        for v in variants {
            walk(v, path, rows);
        }
    }
    let Some(props) = schema["properties"].as_object() else {
        return;
    };
    let required: Vec<&str> = schema["required"]
        .as_array()
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    for (name, prop) in props {
        let field = format!("{path}.{name}");
        let opaque = OPAQUE.iter().find(|(p, _)| *p == field);
        let mut ty = type_of(prop);
        let prop = &nullable_inner(prop);
        if let Some((_, kind)) = opaque {
            ty = kind.to_string();
        }
        let mut notes = Vec::new();
        if required.contains(&name.as_str()) {
            notes.push("required".to_string());
        }
        notes.extend(bounds(prop));
        notes.extend(rules(prop));
        if prop["type"] == "array" {
            notes.extend(
                bounds(&prop["items"])
                    .into_iter()
                    .map(|b| format!("each: {b}")),
            );
        }
        let default = match &prop["default"] {
            Value::Null => String::new(),
            v => format!("`{v}`"),
        };
        let description = prop["description"]
            .as_str()
            .unwrap_or("")
            .replace('\n', " ")
            .replace('|', "\\|");
        let mut cell = notes.join("; ");
        if !description.is_empty() {
            cell = if cell.is_empty() {
                description
            } else {
                format!("{description} ({cell})")
            };
        }
        rows.push(format!("| `{field}` | {ty} | {default} | {cell} |\n"));
        if opaque.is_some() {
            continue;
        }
        match prop["type"].as_str() {
            Some("object") => walk(prop, &field, rows),
            Some("array") => walk(&prop["items"], &format!("{field}[]"), rows),
            None if prop["oneOf"].is_array() => walk(prop, &field, rows),
            _ => {}
        }
    }
}

/// `anyOf: [T, null]` / `type: [T, "null"]` (an optional field in a JSON schema) as T.
fn nullable_inner(prop: &Value) -> Value {
    if let Some(any) = prop["anyOf"].as_array() {
        if let Some(inner) = any.iter().find(|s| s["type"] != "null") {
            let mut inner = inner.clone();
            for key in ["description", "default"] {
                if !prop[key].is_null() {
                    inner[key] = prop[key].clone();
                }
            }
            return inner;
        }
    }
    if let Some(types) = prop["type"].as_array() {
        let mut inner = prop.clone();
        if let Some(t) = types.iter().find(|t| *t != "null") {
            inner["type"] = t.clone();
        }
        return inner;
    }
    prop.clone()
}

/// The values of an enum whose variants are documented (`oneOf` of `const`s), if it is one.
fn documented_enum(prop: &Value) -> Option<Vec<String>> {
    let variants = prop["oneOf"].as_array()?;
    variants
        .iter()
        .map(|v| {
            let value = v["const"].as_str()?;
            Some(match v["description"].as_str() {
                // One table cell: a variant's doc may span lines.
                Some(d) => format!("`{value}`: {}", d.trim_end_matches('.').replace('\n', " ")),
                None => format!("`{value}`"),
            })
        })
        .collect()
}

fn type_of(prop: &Value) -> String {
    let prop = &nullable_inner(prop);
    if documented_enum(prop).is_some() {
        return "string".into();
    }
    if prop["oneOf"].is_array() && prop["type"].is_null() {
        return "object: exactly one of the keys below".into();
    }
    match prop["type"].as_str() {
        Some("array") => format!("[]{}", type_of(&prop["items"])),
        Some("object") if prop["additionalProperties"].is_object() => {
            format!("map[string]{}", type_of(&prop["additionalProperties"]))
        }
        Some(t) => match prop["format"].as_str() {
            Some(f) => format!("{t} ({f})"),
            None => t.to_string(),
        },
        None => "any".into(),
    }
}

fn bounds(prop: &Value) -> Vec<String> {
    let mut out = Vec::new();
    let keys = [
        ("minimum", "≥"),
        ("maximum", "≤"),
        ("minLength", "length ≥"),
        ("maxLength", "length ≤"),
        ("minItems", "items ≥"),
        ("maxItems", "items ≤"),
    ];
    let unsigned = prop["format"]
        .as_str()
        .is_some_and(|f| f.starts_with("uint"));
    for (key, label) in keys {
        if let Some(v) = prop.get(key).filter(|v| !v.is_null()) {
            if unsigned && key == "minimum" && v.as_f64() == Some(0.0) {
                continue; // implied by the type
            }
            out.push(format!("{label} {v}"));
        }
    }
    if let Some(values) = documented_enum(prop) {
        out.push(format!("one of {}", values.join("; ")));
    }
    if let Some(p) = prop["pattern"].as_str() {
        out.push(format!("matches `{p}`"));
    }
    if let Some(values) = prop["enum"].as_array() {
        let list: Vec<String> = values
            .iter()
            .map(|v| format!("`{}`", v.as_str().unwrap_or("")))
            .collect();
        out.push(format!("one of {}", list.join(", ")));
    }
    out
}

fn rules(prop: &Value) -> Vec<String> {
    prop["x-kubernetes-validations"]
        .as_array()
        .map(|rules| {
            rules
                .iter()
                .map(|r| {
                    format!(
                        "{} (`{}`)",
                        r["message"].as_str().unwrap_or("rule"),
                        r["rule"].as_str().unwrap_or("").replace('|', "\\|")
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_checked_in_reference_is_what_the_binary_prints() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/crd-reference.md");
        let checked_in = std::fs::read_to_string(path).expect("docs/crd-reference.md exists");
        assert!(
            checked_in == markdown(),
            "docs/crd-reference.md is stale: regenerate it with `make crd`"
        );
    }

    #[test]
    fn the_checked_in_worker_reference_is_what_the_binary_prints() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/worker-config.md");
        let checked_in = std::fs::read_to_string(path).expect("docs/worker-config.md exists");
        assert!(
            checked_in == worker_markdown(),
            "docs/worker-config.md is stale: regenerate it with `make crd`"
        );
        for key in [
            "`retry.maxAttempts`",
            "`handler.http.url`",
            "`stuck.action`",
            "`maxInFlightPerPartition`",
        ] {
            assert!(checked_in.contains(key), "{key} missing");
        }
    }

    #[test]
    fn the_reference_covers_the_fields_users_set() {
        let md = markdown();
        for field in [
            "`spec.kafka.bootstrapServers`",
            "`spec.stages[].replicas.min`",
            "`spec.stages[].autoscaling.lagPerReplica`",
            "`spec.stages[].handler.http.url`",
            "`spec.retry.maxAttempts`",
            "`status.stages[].effectiveLag`",
        ] {
            assert!(md.contains(field), "{field} missing");
        }
        assert!(md.contains("replicas.min must not exceed replicas.max"));
    }
}
