//! From the consumer loop to the session tasks, without ever blocking the loop.
//!
//! A session is hashed onto one of a few dispatchers ([`routing`]); the loop hands each one the
//! turn's records as a batch bounded in records ([`handoff`]); a dispatcher owns its sessions'
//! map and starts, wakes and reaps their tasks ([`dispatcher`]); when a dispatcher is full, the
//! records are parked and their partition held ([`backpressure`]).

pub mod backpressure;
pub mod dispatcher;
pub mod handoff;
pub mod routing;
