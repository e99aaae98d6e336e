//! What tokio's timer leaves of the ideal for a handler that waits.
//!
//! P2's handler simulates I/O with an async sleep. Tokio's timer counts whole milliseconds and
//! rounds a sleep's deadline up to the next one, and a parked worker's timeout is rounded up
//! again, so a 5 ms sleep lasts longer than 5 ms and the scenario's ideal (sessions ÷ 5 ms) is
//! out of reach of any system on this runtime. This measures the reachable one: as many tasks
//! as the scenario has sessions, each doing nothing but the handler's sleep in a loop, on the
//! bench's own runtime (the same kind every system runs on) while nothing else runs.

use std::time::Duration;

use tokio::time::Instant;

/// Sleeps per second that `tasks` tasks reach sleeping `io` each, `sleeps` times in a row
/// (timed on tokio's clock, which is the system's unless a test pauses it).
pub async fn rate(tasks: u64, sleeps: u64, io: Duration) -> f64 {
    let started = Instant::now();
    let running: Vec<_> = (0..tasks)
        .map(|_| {
            tokio::spawn(async move {
                for _ in 0..sleeps {
                    tokio::time::sleep(io).await;
                }
            })
        })
        .collect();
    for task in running {
        let _ = task.await;
    }
    (tasks * sleeps) as f64 / started.elapsed().as_secs_f64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn on_an_exact_clock_the_rate_is_tasks_over_the_sleep() {
        // A paused clock advances exactly to each deadline: no rounding, no lateness.
        let r = rate(100, 10, Duration::from_millis(5)).await;
        assert!((r - 100.0 / 0.005).abs() / (100.0 / 0.005) < 0.05, "{r}");
    }
}
