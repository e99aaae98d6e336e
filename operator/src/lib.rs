//! The sessionflow operator: turns `SessionPipeline` resources into per-stage worker
//! Deployments and scales each stage from the consumer lag it reads from Kafka itself.
//!
//! Data flow: [`crd`] declares the resource; [`render`] turns a resource into the objects of
//! each stage (pure), building their pods with [`pod`] (pure), refusing timeouts that cannot
//! work and deriving the pods' grace period with [`timeouts`] (pure), and naming any refusal
//! with a [`spec_error::SpecError`]; [`reconciler`] applies them with server-side apply
//! (repairing what [`drift`] finds edited, never taking over what is not its own) and reports
//! conditions, judging each stage with [`health`] (pure); [`autoscale`] decides replica
//! counts from lag (pure); [`scaler`] is the loop that reads lag through [`kafka`], applies the
//! decisions and reports them; [`metrics`] and [`server`] expose what it sees, [`liveness`]
//! whether the autoscaler loop still completes passes; [`leader`] makes one replica of several
//! the one that works.

pub mod autoscale;
pub mod crd;
pub mod drift;
pub mod health;
pub mod kafka;
pub mod leader;
pub mod liveness;
pub mod metrics;
pub mod pod;
pub mod reconciler;
pub mod reference;
pub mod render;
pub mod scaler;
pub mod server;
pub mod spec_error;
pub mod timeouts;

#[cfg(test)]
mod fixtures;
#[cfg(test)]
mod rbac_tests;
