//! The chart's default images are the ones `make images` builds.
//!
//! Why this exists: `helm install` with the chart's defaults pulls
//! `<image.repository>:<tag or appVersion>` for the operator and gives the operator
//! `<workerImage.repository>:<tag or appVersion>` for the workers; `make images`
//! (scripts/images.sh, names from scripts/image-lib.sh) tags
//! `$IMAGE_REGISTRY/sessionflow-{operator,worker}:<workspace version>`, and the operator binary
//! defaults to `ghcr.io/sessionflow/sessionflow-worker:<its version>`. If any of these drift, a
//! default install pulls an image nobody built.

use serde_json::Value;

use super::repo_file;

fn yaml(path: &str) -> Value {
    serde_saphyr::from_str(&repo_file(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// `NAME=${NAME:-default}` in scripts/image-lib.sh, expanded once (`$OTHER` references).
fn image_lib_default(name: &str) -> String {
    let lib = repo_file("scripts/image-lib.sh");
    let prefix = format!("{name}=${{{name}:-");
    let line = lib
        .lines()
        .find(|l| l.starts_with(&prefix))
        .unwrap_or_else(|| panic!("scripts/image-lib.sh has no default for {name}"));
    line[prefix.len()..].trim_end_matches('}').to_string()
}

fn workspace_version() -> String {
    let manifest = repo_file("Cargo.toml");
    manifest
        .lines()
        .find_map(|l| l.strip_prefix("version = \""))
        .and_then(|v| v.strip_suffix('"'))
        .expect("the workspace version")
        .to_string()
}

#[test]
fn chart_image_references_are_the_images_make_images_builds() {
    let chart = yaml("charts/sessionflow/Chart.yaml");
    let values = yaml("charts/sessionflow/values.yaml");
    let version = workspace_version();
    let app_version = chart["appVersion"].as_str().expect("appVersion");
    assert_eq!(
        app_version, version,
        "Chart.yaml appVersion vs the workspace version (the images' tag)"
    );

    let registry = image_lib_default("IMAGE_REGISTRY");
    assert_eq!(
        image_lib_default("WORKER_IMAGE"),
        "$IMAGE_REGISTRY/sessionflow-worker:$IMAGE_TAG"
    );
    assert_eq!(
        image_lib_default("OPERATOR_IMAGE"),
        "$IMAGE_REGISTRY/sessionflow-operator:$IMAGE_TAG"
    );
    let tag_default = image_lib_default("IMAGE_TAG");
    assert!(
        tag_default.contains("Cargo.toml"),
        "IMAGE_TAG defaults to the workspace version, not {tag_default:?}"
    );

    for (key, name) in [
        ("image", "sessionflow-operator"),
        ("workerImage", "sessionflow-worker"),
    ] {
        assert_eq!(
            values[key]["repository"].as_str(),
            Some(format!("{registry}/{name}").as_str()),
            "values.yaml {key}.repository"
        );
        let tag = values[key]["tag"].as_str().unwrap_or_default();
        assert!(
            tag.is_empty() || tag == version,
            "values.yaml {key}.tag {tag:?}: empty (appVersion) or {version}"
        );
    }
    // Empty tags mean appVersion: both helpers fall back to it.
    let helpers = repo_file("charts/sessionflow/templates/_helpers.tpl");
    for values_key in ["image", "workerImage"] {
        let expr = format!("(default .Chart.AppVersion .Values.{values_key}.tag)");
        assert!(
            helpers.contains(&expr),
            "_helpers.tpl does not fall back to appVersion for {values_key}"
        );
    }
    // The operator's own default worker image, for installs without the chart.
    // Compared without whitespace: rustfmt decides where that `concat!` breaks.
    let main: String = repo_file("operator/src/main.rs")
        .split_whitespace()
        .collect();
    assert!(
        main.contains(&format!(
            "concat!(\"{registry}/sessionflow-worker:\",env!(\"CARGO_PKG_VERSION\"))"
        )),
        "the operator's --worker-image default is not {registry}/sessionflow-worker:<version>"
    );
}
