//! What the group coordinator thinks of this member.
//!
//! A member the coordinator has given up on must not write: its partitions may already be
//! someone else's. [`membership`] is the fence that closes the writes when the member has not
//! been heard from for too long; [`session_timeout`] is the timeout the coordinator really
//! applies, which the fence is measured against.

pub mod membership;
pub mod session_timeout;
