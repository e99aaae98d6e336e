//! The user-facing reference of the `SessionPipeline` resource, generated from the CRD's own
//! schema (descriptions, types, defaults, bounds, CEL rules), so the document cannot drift
//! from what the API server enforces. `sessionflow-operator reference` prints it;
//! `docs/crd-reference.md` is that output, checked by a test.

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

fn walk(schema: &Value, path: &str, rows: &mut Vec<String>) {
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
            _ => {}
        }
    }
}

fn type_of(prop: &Value) -> String {
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
    for (key, label) in keys {
        if let Some(v) = prop.get(key).filter(|v| !v.is_null()) {
            out.push(format!("{label} {v}"));
        }
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
            "docs/crd-reference.md is stale: regenerate it with \
             `cargo run -p sessionflow-operator -- reference > docs/crd-reference.md`"
        );
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
