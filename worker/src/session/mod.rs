//! Per-session order: one task per live session, one record at a time.
//!
//! A session's records wait in its [`mailbox`]; its [`task`] runs the handler on them one at a
//! time, retrying the same record in place ([`retry`]), giving up on a handler call that never
//! returns ([`stuck`]), and [`settle`]s each result (output or dead letter written under the
//! record's lease, the broker's answer awaited) before it takes the next record.

pub mod mailbox;
pub mod retry;
pub mod settle;
pub mod stuck;
pub mod task;
