//! The worker container `scripts/image-test.sh` runs is the one the operator renders.
//!
//! Why this exists: the image test runs the worker image under podman "as the operator's
//! Deployment does" — that claim is only as good as the copy of the Deployment in the script.
//! Here a pipeline is rendered by the operator's own code and the script's `RENDERED_*` lines and
//! its podman flags are checked against the container args, the config mount, the user, the
//! security context and the grace period; a change on either side fails this test.

use std::path::Path;

use k8s_openapi::api::core::v1::{Container, PodSpec};
use sessionflow_operator::crd::SessionPipeline;
use sessionflow_operator::render::{plan, Defaults};

fn repo_file(path: &str) -> String {
    let full = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{}: {e}", full.display()))
}

/// The value of `NAME=...` in the image test script (a bash word or a `( … )` array).
fn script_value(script: &str, name: &str) -> String {
    let prefix = format!("{name}=");
    let line = script
        .lines()
        .find(|l| l.starts_with(&prefix))
        .unwrap_or_else(|| panic!("scripts/image-test.sh sets no {name}"));
    line[prefix.len()..]
        .trim_start_matches('(')
        .trim_end_matches(')')
        .to_string()
}

fn rendered() -> (PodSpec, Container) {
    let mut sp: SessionPipeline =
        serde_saphyr::from_str(&repo_file("examples/k8s/one-stage.yaml")).expect("the example");
    sp.metadata.namespace = Some("default".into());
    let defaults = Defaults {
        worker_image: "worker:test".into(),
        // The operator's --worker-log-format default (operator/src/main.rs).
        log_format: "json".into(),
        allowed_images: Vec::new(),
    };
    let plans = plan(&sp, &defaults).expect("the example renders");
    let pod = plans[0]
        .deployment
        .spec
        .clone()
        .unwrap()
        .template
        .spec
        .unwrap();
    let container = pod.containers[0].clone();
    (pod, container)
}

#[test]
fn the_image_test_runs_the_worker_container_the_operator_renders() {
    let script = repo_file("scripts/image-test.sh");
    let (pod, container) = rendered();

    let args = script_value(&script, "RENDERED_ARGS");
    assert_eq!(
        container.args.clone().unwrap().join(" "),
        args,
        "RENDERED_ARGS in scripts/image-test.sh"
    );
    assert!(container.command.is_none(), "the image's ENTRYPOINT runs");

    let config_dir = script_value(&script, "RENDERED_CONFIG_DIR");
    let mount = container
        .volume_mounts
        .as_ref()
        .unwrap()
        .iter()
        .find(|m| m.name == "config")
        .expect("the config mount");
    assert_eq!(mount.mount_path, config_dir, "RENDERED_CONFIG_DIR");
    assert_eq!(mount.read_only, Some(true));
    assert!(
        args.contains(&format!("{config_dir}/")),
        "the config file is under the mount"
    );

    let pod_security = pod.security_context.clone().unwrap();
    assert_eq!(
        format!(
            "{}:{}",
            pod_security.run_as_user.unwrap(),
            pod_security.run_as_group.unwrap()
        ),
        script_value(&script, "RENDERED_USER"),
        "RENDERED_USER"
    );
    let security = container.security_context.clone().unwrap();
    assert_eq!(security.read_only_root_filesystem, Some(true));
    assert_eq!(security.allow_privilege_escalation, Some(false));
    assert_eq!(
        security.capabilities.unwrap().drop,
        Some(vec!["ALL".to_string()])
    );
    // …and the script's podman flags say the same (no tmpfs: Kubernetes adds none either).
    for flag in [
        "--read-only ",
        "--read-only-tmpfs=false",
        "--cap-drop ALL",
        "no-new-privileges",
        "--user \"$RENDERED_USER\"",
    ] {
        assert!(
            script.contains(flag),
            "scripts/image-test.sh runs the worker without {flag}"
        );
    }

    assert_eq!(
        pod.termination_grace_period_seconds.unwrap().to_string(),
        script_value(&script, "RENDERED_GRACE_SECONDS"),
        "RENDERED_GRACE_SECONDS (the example sets no timeouts, nor does the script's config)"
    );
    let probes = [
        container.liveness_probe.as_ref().unwrap(),
        container.readiness_probe.as_ref().unwrap(),
    ];
    let paths: Vec<_> = probes
        .iter()
        .map(|p| p.http_get.as_ref().unwrap().path.clone().unwrap())
        .collect();
    assert_eq!(paths, ["/healthz", "/readyz"]);
    for path in paths {
        assert!(script.contains(&path), "the image test never asks {path}");
    }
}
