//! Leader election: the chart runs two operator replicas so that a lost node or an upgrade
//! does not stop reconciles and autoscaling, and exactly one of them works.
//!
//! The replicas hold a `coordination.k8s.io` Lease ([`LEASE_NAME`] in the operator's
//! namespace) through kube-lease-manager (server-side apply makes two holders impossible: the
//! second apply of `holderIdentity` conflicts). Both replicas watch and cache (a standby is
//! warm), but only the holder reconciles and scales: [`Leadership::is_leader`] gates
//! [`crate::reconciler::reconcile`] and every [`crate::scaler::Scaler`] pass. A replica that
//! gains the lease reconciles every pipeline at once; one that loses it after holding it
//! exits (its in-flight work then ends with the process), and comes back as a standby.

use std::time::Duration;

use futures::Stream;
use kube::Client;
use kube_lease_manager::{LeaseManager, LeaseManagerBuilder, LeaseManagerError};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Name of the Lease the operator replicas hold.
pub const LEASE_NAME: &str = "sessionflow-operator";
/// A holder that has not renewed for this long loses the lease.
pub const LEASE_SECONDS: u64 = 15;
/// The holder renews this long before its lease would expire (also the clock skew tolerated).
pub const RENEW_BEFORE_SECONDS: u64 = 5;

/// Whether this replica is the one that works.
#[derive(Clone, Debug)]
pub struct Leadership {
    state: watch::Receiver<Term>,
}

/// The lease as this replica sees it: held now, and how many times it was gained so far
/// (so a gain or a loss is not missed when the state changed twice between two looks).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Term {
    held: bool,
    gained: u64,
}

/// Sets what a [`Leadership`] reports (the election's side of it).
#[derive(Debug)]
pub struct LeaderSwitch(watch::Sender<Term>);

impl LeaderSwitch {
    pub fn set(&self, held: bool) {
        self.0.send_modify(|term| {
            if held && !term.held {
                term.gained += 1;
            }
            term.held = held;
        });
    }
}

impl Leadership {
    /// A leadership that `switch` sets, starting as `held`.
    pub fn channel(held: bool) -> (LeaderSwitch, Self) {
        let (sender, state) = watch::channel(Term::default());
        let switch = LeaderSwitch(sender);
        switch.set(held);
        (switch, Self { state })
    }

    /// Always the leader: one replica without election (local runs, tests).
    pub fn always() -> Self {
        // The receiver keeps reporting the last value after the switch is gone.
        Self::channel(true).1
    }

    pub fn is_leader(&self) -> bool {
        self.state.borrow().held
    }

    /// Yields once each time this replica becomes the leader (and at once if it is).
    pub fn gained(&self) -> impl Stream<Item = ()> + Send + 'static {
        let state = self.state.clone();
        futures::stream::unfold((state, 0u64), |(mut state, seen)| async move {
            loop {
                let term = *state.borrow_and_update();
                if term.held && term.gained > seen {
                    return Some(((), (state, term.gained)));
                }
                if state.changed().await.is_err() {
                    // No election any more: the state is final.
                    std::future::pending::<()>().await;
                }
            }
        })
    }

    /// Resolves once this replica, having been the leader, is not any more.
    pub async fn lost(&self) {
        let mut state = self.state.clone();
        loop {
            let term = *state.borrow_and_update();
            if !term.held && term.gained > 0 {
                return;
            }
            if state.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }
}

/// A running election: the lease manager's task and the one that forwards its state.
pub struct Election {
    manager: JoinHandle<Result<LeaseManager, LeaseManagerError>>,
    forwarder: JoinHandle<()>,
}

impl Election {
    /// Stops the lease manager as a crash would: without releasing the lease.
    pub fn abort_without_release(&self) {
        self.manager.abort();
    }

    /// Gives the lease up (if held), so a standby takes over at once instead of after the
    /// lease expired: for a clean shutdown.
    pub async fn release(self) {
        // The manager releases and ends once nobody follows its state.
        self.forwarder.abort();
        let _ = self.forwarder.await;
        match tokio::time::timeout(Duration::from_secs(5), self.manager).await {
            Ok(Ok(Ok(_))) => tracing::info!("operator lease released"),
            Ok(Ok(Err(error))) => tracing::warn!(%error, "could not release the operator lease"),
            Ok(Err(_)) | Err(_) => tracing::warn!("the operator lease was not released in time"),
        }
    }
}

/// Starts competing for the Lease `lease` in `namespace` as `identity` (the pod name): the
/// lease is renewed while held and tried for while not, until the process ends. If the
/// election itself ends (its task failed), the replica is no longer the leader.
pub async fn elect(
    client: Client,
    namespace: &str,
    lease: &str,
    identity: &str,
    lease_seconds: u64,
    renew_before_seconds: u64,
) -> Result<(Leadership, Election), LeaseManagerError> {
    let manager = LeaseManagerBuilder::new(client, lease)
        .with_namespace(namespace)
        .with_identity(identity)
        .with_field_manager(format!("sessionflow-operator-lease/{identity}"))
        .with_duration(lease_seconds)
        .with_grace(renew_before_seconds)
        .build()
        .await?;
    let (mut from, manager) = manager.watch().await;
    let (to, leadership) = Leadership::channel(*from.borrow_and_update());
    let forwarder = tokio::spawn(async move {
        // `from` errs once the manager's task has ended, however it ended (it logs why).
        while from.changed().await.is_ok() {
            let held = *from.borrow_and_update();
            tracing::info!(held, "operator lease");
            to.set(held);
        }
        tracing::error!("leader election ended; not the leader any more");
        to.set(false);
    });
    Ok((leadership, Election { manager, forwarder }))
}

#[cfg(test)]
pub(crate) mod fake {
    //! An in-memory Lease API that keeps server-side apply's one rule that matters to an
    //! election: applying `spec.holderIdentity` with another value than the one a different
    //! field manager set is a 409 Conflict; an ordinary patch (strategic merge) takes the field
    //! over, and setting it to null frees it.

    use std::sync::{Arc, Mutex};

    use http::{Method, Request, Response};
    use kube::client::Body;
    use kube::Client;
    use serde_json::{json, Value};

    #[derive(Default, Debug)]
    pub struct LeaseStore {
        pub lease: Option<Value>,
        holder_manager: Option<String>,
        /// Every change of `spec.holderIdentity`, in order.
        pub holders: Vec<Option<String>>,
        version: u64,
        /// Every request, as (method, path and query).
        pub calls: Vec<(Method, String)>,
    }

    impl LeaseStore {
        pub fn holder(&self) -> Option<String> {
            self.lease
                .as_ref()
                .and_then(|l| l["spec"]["holderIdentity"].as_str().map(String::from))
        }
    }

    /// A client whose requests the shared `store` answers.
    pub fn client(store: Arc<Mutex<LeaseStore>>) -> Client {
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        tokio::spawn(async move {
            while let Some((request, respond)) = handle.next_request().await {
                let method = request.method().clone();
                let uri = request.uri().to_string();
                let content_type = request
                    .headers()
                    .get("content-type")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_string();
                let bytes = request.into_body().collect_bytes().await.unwrap();
                let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
                let (code, reply) =
                    store
                        .lock()
                        .unwrap()
                        .answer(&method, &uri, &content_type, body);
                respond.send_response(
                    Response::builder()
                        .status(code)
                        .body(Body::from(serde_json::to_vec(&reply).unwrap()))
                        .unwrap(),
                );
            }
        });
        Client::new(service, "default")
    }

    fn status(code: u16, reason: &str) -> (u16, Value) {
        (
            code,
            json!({"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
                   "message": reason, "reason": reason, "code": code}),
        )
    }

    fn field_manager(uri: &str) -> String {
        uri.split(['?', '&'])
            .find_map(|p| p.strip_prefix("fieldManager="))
            .unwrap_or_default()
            .to_string()
    }

    impl LeaseStore {
        fn answer(
            &mut self,
            method: &Method,
            uri: &str,
            content_type: &str,
            body: Value,
        ) -> (u16, Value) {
            self.calls.push((method.clone(), uri.to_string()));
            let path = uri.split('?').next().unwrap();
            assert!(
                path.starts_with("/apis/coordination.k8s.io/v1/namespaces/"),
                "not a Lease call: {method} {uri}"
            );
            match (method, path.contains("/leases/")) {
                (&Method::GET, true) => match &self.lease {
                    Some(l) => (200, l.clone()),
                    None => status(404, "NotFound"),
                },
                (&Method::POST, false) => {
                    if self.lease.is_some() {
                        return status(409, "AlreadyExists");
                    }
                    let mut lease = body;
                    lease["apiVersion"] = json!("coordination.k8s.io/v1");
                    lease["kind"] = json!("Lease");
                    self.version += 1;
                    lease["metadata"]["resourceVersion"] = json!(self.version.to_string());
                    if lease.get("spec").is_none_or(Value::is_null) {
                        lease["spec"] = json!({});
                    }
                    self.lease = Some(lease.clone());
                    (201, lease)
                }
                (&Method::PATCH, true) => {
                    let Some(lease) = self.lease.as_mut() else {
                        return status(404, "NotFound");
                    };
                    let manager = field_manager(uri);
                    let spec = body["spec"].as_object().cloned().unwrap_or_default();
                    if let Some(holder) = spec.get("holderIdentity") {
                        let apply = content_type.starts_with("application/apply-patch");
                        let owned_by_other =
                            self.holder_manager.as_ref().is_some_and(|m| *m != manager);
                        if apply && owned_by_other && lease["spec"]["holderIdentity"] != *holder {
                            return status(409, "Conflict");
                        }
                        self.holder_manager = (!holder.is_null()).then(|| manager.clone());
                    }
                    for (k, v) in spec {
                        if v.is_null() {
                            lease["spec"].as_object_mut().unwrap().remove(&k);
                        } else {
                            lease["spec"][k] = v;
                        }
                    }
                    self.version += 1;
                    lease["metadata"]["resourceVersion"] = json!(self.version.to_string());
                    let holder = lease["spec"]["holderIdentity"].as_str().map(String::from);
                    if self.holders.last() != Some(&holder) {
                        self.holders.push(holder);
                    }
                    (200, lease.clone())
                }
                _ => panic!("unexpected Lease call {method} {uri}"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use super::*;

    async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
        tokio::time::timeout(Duration::from_secs(30), async {
            while !done() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"));
    }

    /// Two replicas compete for one Lease: the first holds it and renews it while the second
    /// stays a standby; the first crashes without releasing (its lease manager is aborted), so
    /// it stops being the leader, and the standby takes over once the lease has expired. The
    /// Lease's holder goes from pod-a to pod-b and never back: never two leaders.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_standby_takes_over_when_the_leader_stops_renewing() {
        let store = Arc::new(Mutex::new(fake::LeaseStore::default()));
        let (a, a_election) = elect(
            fake::client(store.clone()),
            "ops",
            LEASE_NAME,
            "pod-a",
            2,
            1,
        )
        .await
        .unwrap();
        wait_for("pod-a to lead", || a.is_leader()).await;
        let (b, _b_election) = elect(
            fake::client(store.clone()),
            "ops",
            LEASE_NAME,
            "pod-b",
            2,
            1,
        )
        .await
        .unwrap();
        let mut b_gained = Box::pin(b.gained());

        // pod-a renews (patches under its own field manager) while pod-b waits.
        let renewals = || {
            store
                .lock()
                .unwrap()
                .calls
                .iter()
                .filter(|(m, uri)| m == http::Method::PATCH && uri.contains("pod-a"))
                .count()
        };
        let before = renewals();
        wait_for("two renewals by pod-a", || renewals() >= before + 2).await;
        assert!(
            a.is_leader() && !b.is_leader(),
            "one leader while pod-a renews"
        );

        // pod-a crashes: no release, no more renewals; it is no longer the leader.
        a_election.abort_without_release();
        tokio::time::timeout(Duration::from_secs(5), a.lost())
            .await
            .expect("pod-a knows it lost the lease");
        wait_for("pod-b to take over", || b.is_leader()).await;
        assert_eq!(
            tokio::time::timeout(
                Duration::from_secs(1),
                futures::StreamExt::next(&mut b_gained)
            )
            .await
            .unwrap(),
            Some(()),
            "pod-b's gained() fires (what makes it reconcile every pipeline)"
        );
        let holders = store.lock().unwrap().holders.clone();
        assert_eq!(
            holders,
            [Some("pod-a".to_string()), None, Some("pod-b".to_string())],
            "pod-b took the lease only after pod-a's expired (released by force), never both"
        );
    }

    #[tokio::test]
    async fn always_is_a_leader_that_never_loses() {
        let l = Leadership::always();
        assert!(l.is_leader());
        let mut gained = Box::pin(l.gained());
        assert_eq!(futures::StreamExt::next(&mut gained).await, Some(()));
        assert!(
            tokio::time::timeout(Duration::from_millis(50), l.lost())
                .await
                .is_err(),
            "never lost"
        );
    }

    #[tokio::test]
    async fn gained_and_lost_follow_the_lease() {
        let (switch, l) = Leadership::channel(false);
        let mut gained = Box::pin(l.gained());
        let lost = tokio::spawn({
            let l = l.clone();
            async move { l.lost().await }
        });
        switch.set(true);
        assert_eq!(futures::StreamExt::next(&mut gained).await, Some(()));
        assert!(l.is_leader());
        assert!(!lost.is_finished());
        // Lost and gained again before anyone looked: both are still seen.
        switch.set(false);
        switch.set(true);
        assert_eq!(futures::StreamExt::next(&mut gained).await, Some(()));
        switch.set(false);
        tokio::time::timeout(Duration::from_secs(1), lost)
            .await
            .expect("lost() resolves when the lease goes")
            .unwrap();
    }
}
