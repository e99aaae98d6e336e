//! What operators see and the process around the engine: metrics, health, logs, memory.
//!
//! [`metrics`] and [`health`] are what Prometheus and the kubelet ask ([`batched`]: a session
//! task's observations of a histogram, handed over together); [`telemetry`] the logs and
//! trace context, [`sampling`] which records get spans; [`memory`] the heap and giving it back
//! after a burst; [`signal`] the signals between the engine's threads; [`watchdog`] the live
//! check that each session's records arrive in order.

pub mod batched;
pub mod health;
pub mod memory;
pub mod metrics;
pub mod sampling;
pub mod signal;
pub mod telemetry;
pub mod watchdog;
