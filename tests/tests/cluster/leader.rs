//! Two operator processes with leader election on a real Lease: only the holder works; when
//! it dies (SIGKILL: no release), the other takes the Lease once it expires and reconciles
//! (puts back a Deployment scaled by hand), and not before.

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;
use sessionflow_operator::leader::LEASE_NAME;
use sessionflow_operator::render::stage_object_name;

use crate::{eventually, Env};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_the_leader_dies_the_standby_takes_over() {
    Env::run("leader", |env| async move {
        let mut a = env.operator(Some("operator-a"));
        let mut b = env.operator(Some("operator-b"));
        let leases: Api<Lease> = Api::namespaced(env.client.clone(), &env.namespace);
        let holder = eventually("a holder of the Lease", || async {
            let lease = leases
                .get_opt(LEASE_NAME)
                .await
                .map_err(|e| e.to_string())?;
            lease
                .and_then(|l| l.spec?.holder_identity)
                .filter(|h| !h.is_empty())
                .ok_or_else(|| "no holder yet".to_string())
        })
        .await;
        let name = stage_object_name("led", "work");
        env.create_pipeline(&env.pipeline("led", 1, 1)).await;
        eventually("the leader creates the Deployment", || async {
            env.deployments()
                .get_opt(&name)
                .await
                .map_err(|e| e.to_string())?
                .map(|_| ())
                .ok_or_else(|| "missing".to_string())
        })
        .await;

        let (dead, survivor) = match holder.as_str() {
            "operator-a" => (&mut a, "operator-b"),
            "operator-b" => (&mut b, "operator-a"),
            other => panic!("unknown holder {other}"),
        };
        dead.kill();
        env.hand_scale(&name, 3).await;
        // Until the Lease changes hands, nobody scales: the Deployment is read first, the
        // Lease after, so a count put back while the dead leader still holds the Lease was
        // put back by a standby that did not lead.
        eventually("the survivor holds the Lease", || async {
            let d = env
                .deployments()
                .get(&name)
                .await
                .map_err(|e| e.to_string())?;
            let lease = leases.get(LEASE_NAME).await.map_err(|e| e.to_string())?;
            let h = lease.spec.and_then(|s| s.holder_identity);
            if h.as_deref() == Some(holder.as_str()) {
                let r = d.spec.and_then(|s| s.replicas);
                assert_eq!(
                    r,
                    Some(3),
                    "scaled back while {holder} (killed) still held the Lease"
                );
            }
            (h.as_deref() == Some(survivor))
                .then_some(())
                .ok_or(format!("holder {h:?}"))
        })
        .await;
        eventually("the hand-scaled Deployment back at 1 replica", || async {
            let d = env
                .deployments()
                .get(&name)
                .await
                .map_err(|e| e.to_string())?;
            let r = d.spec.and_then(|s| s.replicas);
            (r == Some(1))
                .then_some(())
                .ok_or(format!("replicas {r:?}"))
        })
        .await;
        assert!(a.running() || b.running());
    })
    .await;
}
