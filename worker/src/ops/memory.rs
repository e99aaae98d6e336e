//! The process's heap: which allocator it runs on, and giving memory back after a burst of
//! sessions.
//!
//! Every record is copied into an owned `InputRecord` on the consumer loop's thread and freed on
//! a tokio worker once its session is done with it, so the record path is a stream of
//! allocations freed on another thread. glibc's malloc pays for that traffic with arena locks,
//! chunk consolidation and per-thread caches that keep running dry, so the worker binary
//! declares jemalloc its global allocator (feature `jemalloc`, on by default; `src/main.rs`).
//! The library does not: a binary linking the engine chooses its own allocator (the bench and
//! the tests choose jemalloc too, the operator and the tools the system's). Measured in
//! BENCHMARKS.md ("The allocator"): P1 drains ~1.7 × faster on it than on glibc, mimalloc sits
//! between the two, and jemalloc can give every arena's free pages back on request.
//!
//! jemalloc is linked unprefixed, so it is the C libraries' `malloc` too: librdkafka allocates
//! every fetched message's op and parsed headers on its own threads and the consumer loop frees
//! them, the same cross-thread traffic, which glibc served at ~1,200 instructions per record
//! (BENCHMARKS.md, "The allocator"). One allocator also means one heap to count and to purge.
//!
//! Since the binary chooses, what this module does with the heap (statistics, purges) asks at
//! run time whether jemalloc is the allocator ([`jemalloc_in_use`]: does an allocation show in
//! jemalloc's count of this thread's bytes?) and takes the system's path when it is not
//! (glibc's `mallinfo2` and `malloc_trim`).
//!
//! A burst of new sessions (a million users arriving at once) grows the heap by a few KB per
//! live session. When the burst is over and the idle sessions are reaped, the memory is free
//! again, but the allocator keeps freed pages mapped, so the process's RSS stays at its peak
//! until something asks for them back — and on Kubernetes the RSS is what the memory limit
//! and the scheduler see. This watcher asks (jemalloc: purge every arena; glibc:
//! `malloc_trim`) once the number of live sessions has fallen to half of what it was at the
//! last trim, and once more when the last session of a burst is gone, so a steady load never
//! trims and a large reap trims a few times, not once per reaped session.
//!
//! A purge returns only pages with nothing on them, and every thread's jemalloc cache (tcache)
//! holds freed blocks of its own, each keeping its page in use: after a reap the tokio workers,
//! which freed the sessions and the records, hold several MiB of them, scattered over pages
//! that are otherwise empty. jemalloc flushes a thread's cache only from that thread, so a trim
//! counts itself ([`TRIMS`]) and each thread that can hand its cache back once per trim calls
//! [`hand_back_cache_after_trim`] where it is about to wait: the runtime's workers when they
//! park (the binaries install it as `on_thread_park`, see [`runtime_builder`]), the consumer
//! loop on each turn. The watcher purges once more on the tick after a trim, when the caches
//! handed back have emptied their pages.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus::IntGauge;
use tokio_util::sync::CancellationToken;

/// How often the live-session count is looked at.
const CHECK_EVERY: Duration = Duration::from_secs(1);
/// A drop smaller than this many sessions is not worth a trim (~2 KB each).
const MIN_DROP: i64 = 1_000;

/// When to trim, from the live-session count alone.
#[derive(Debug, Default)]
pub struct TrimPolicy {
    /// Highest live-session count since the last trim.
    high: i64,
    /// Highest live-session count since the count was last zero.
    burst: i64,
}

impl TrimPolicy {
    /// Notes the current count; true when the memory of the sessions reaped since the last trim
    /// should be given back now: the count has halved (by at least `MIN_DROP`), or the last
    /// session of a burst of at least `MIN_DROP` is gone (what the halvings left behind is free
    /// too, and would otherwise wait for the allocator's decay).
    pub fn observe(&mut self, live: i64) -> bool {
        self.high = self.high.max(live);
        self.burst = self.burst.max(live);
        let dropped = self.high - live;
        let halved = dropped >= MIN_DROP && live <= self.high / 2;
        let emptied = live == 0 && dropped > 0 && self.burst >= MIN_DROP;
        if live == 0 {
            self.burst = 0;
        }
        if halved || emptied {
            self.high = live;
            true
        } else {
            false
        }
    }
}

/// How many trims have run; a thread hands its cache back when this has moved since it last
/// looked ([`hand_back_cache_after_trim`]).
static TRIMS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// The value of [`TRIMS`] when this thread last handed its cache back.
    static TRIMS_SEEN: Cell<u64> = const { Cell::new(0) };
}

/// Hands this thread's allocator cache back to the heap if a trim has run since it last did:
/// one atomic load otherwise, cheap enough for every park of a runtime worker and every turn
/// of the consumer loop.
pub fn hand_back_cache_after_trim() {
    let trims = TRIMS.load(Ordering::Relaxed);
    if TRIMS_SEEN.with(|seen| seen.replace(trims)) != trims {
        flush_thread_cache();
    }
}

/// Asks every thread that calls [`hand_back_cache_after_trim`] to flush its cache once more.
fn ask_for_thread_caches() {
    TRIMS.fetch_add(1, Ordering::Relaxed);
}

/// A multi-thread tokio runtime builder whose workers hand their allocator caches back after a
/// trim, when they park (the worker and the bench build their runtimes from it).
pub fn runtime_builder() -> tokio::runtime::Builder {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder
        .enable_all()
        .on_thread_park(hand_back_cache_after_trim);
    builder
}

/// Watches `live_sessions` until `stop`, trimming the heap when [`TrimPolicy`] says so, and
/// purging once more on the next tick, once the threads have handed their caches back.
pub async fn trim_after_reaps(live_sessions: IntGauge, stop: CancellationToken) {
    let mut policy = TrimPolicy::default();
    let mut tick = tokio::time::interval(CHECK_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut purge_again = false;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        if policy.observe(live_sessions.get()) {
            ask_for_thread_caches();
            // Walks every arena: off the async workers.
            let _ = tokio::task::spawn_blocking(trim).await;
            purge_again = true;
        } else if std::mem::take(&mut purge_again) {
            let _ = tokio::task::spawn_blocking(trim).await;
        }
    }
}

/// The lib's own test binary runs on jemalloc, as the worker does, so that the tests of the
/// statistics, the purge and `malloc_conf` read a heap jemalloc serves.
#[cfg(all(test, feature = "jemalloc"))]
#[global_allocator]
static TEST_ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// Whether jemalloc serves this process's allocations: the binary's `#[global_allocator]`, or
/// (linked unprefixed) the `malloc` under Rust's system allocator. Probed once: an allocation of
/// a MiB through the global allocator must show in jemalloc's count of this thread's bytes.
/// False without the feature `jemalloc`.
pub fn jemalloc_in_use() -> bool {
    #[cfg(feature = "jemalloc")]
    {
        static IN_USE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *IN_USE.get_or_init(|| {
            const PROBE: usize = 1 << 20;
            let Some(before) = mallctl::<u64>(c"thread.allocated", None) else {
                return false;
            };
            let block = std::hint::black_box(Vec::<u8>::with_capacity(PROBE));
            let after = mallctl::<u64>(c"thread.allocated", None);
            drop(block);
            after.is_some_and(|after| after.wrapping_sub(before) >= PROBE as u64)
        })
    }
    #[cfg(not(feature = "jemalloc"))]
    false
}

/// jemalloc's options, read once at its start (`MALLOC_CONF` in the environment overrides
/// them). `muzzy_decay_ms:0`: a purged page is returned at once (MADV_DONTNEED), not only marked
/// free (MADV_FREE), which the kernel reclaims under pressure but keeps counting in the RSS;
/// `background_thread`: dirty pages decay back to the kernel while the worker is idle too,
/// not only when it next allocates. `tcache_gc_incr_bytes:1048576`: a thread's cache is swept
/// for unused objects after every MiB it allocates, not every 64 KiB; at the default the sweeps
/// cost ~350 instructions per record on the consumer loop, which allocates every record
/// (BENCHMARKS.md, *Headers read once, caches swept less often*). `slab_sizes:1-4096:4`: the
/// size classes up to 4 KiB are carved from slabs of four pages (one and two for the 8- and
/// 16-byte classes, whose slabs hold at most 512 blocks), where jemalloc's own are one to seven
/// pages by class: a burst of a million sessions is mostly such blocks, and after their reap P5's RSS stood at
/// 1.157–1.172 × its resting baseline against 1.185–1.210 × with jemalloc's slabs (six runs
/// each; two-page slabs read like the default, eight-page ones like four). Fewer, larger slabs
/// leave fewer descriptors and fewer partly used pages behind (BENCHMARKS.md, the ninth round).
#[cfg(feature = "jemalloc")]
#[allow(non_upper_case_globals)]
#[unsafe(export_name = "malloc_conf")]
pub static malloc_conf: Option<&'static std::ffi::c_char> =
    // SAFETY: a pointer to the first byte of a static, NUL-terminated string.
    Some(unsafe {
        &*c"background_thread:true,muzzy_decay_ms:0,tcache_gc_incr_bytes:1048576,slab_sizes:1-4096:4"
            .as_ptr()
    });

/// Hands the heap's free pages back to the kernel: jemalloc's arenas when it is the allocator
/// (they serve the C libraries too), glibc's heap otherwise.
fn trim() {
    #[cfg(feature = "jemalloc")]
    if jemalloc_in_use() {
        purge_jemalloc();
        return;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only hands free pages of the heap back to the kernel.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Hands this thread's cached free blocks back to the heap (jemalloc's tcache; glibc's cache
/// is small and has no such call).
fn flush_thread_cache() {
    #[cfg(feature = "jemalloc")]
    if jemalloc_in_use() {
        mallctl_command(c"thread.tcache.flush");
    }
}

#[cfg(feature = "jemalloc")]
fn purge_jemalloc() {
    // 4096 is MALLCTL_ARENAS_ALL: the command applies to every arena.
    mallctl_command(c"arena.4096.purge");
}

/// Runs jemalloc's command `name` (a control that reads and writes no value); a refusal is
/// only logged: the memory stays as it was.
#[cfg(feature = "jemalloc")]
fn mallctl_command(name: &std::ffi::CStr) {
    // SAFETY: a command reads and writes nothing through the (null) pointers.
    let rc = unsafe {
        tikv_jemalloc_sys::mallctl(
            name.as_ptr(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            0,
        )
    };
    if rc != 0 {
        tracing::debug!(rc, command = ?name, "jemalloc refused a command");
    }
}

/// Bytes allocated and not yet freed, as the allocator counts them (a diagnostic: RSS above
/// this is pages the allocator keeps mapped). `None` when the allocator does not say.
pub fn allocated_bytes() -> Option<u64> {
    #[cfg(feature = "jemalloc")]
    if jemalloc_in_use() {
        return jemalloc_stat(c"stats.allocated");
    }
    system_allocated()
}

/// Bytes the allocator spends on its own books and never gives back (jemalloc's extent
/// descriptors and its radix tree of pages grow with the heap's peak and stay there): a
/// diagnostic of what a burst leaves behind after every session is gone. `None` when the
/// allocator does not say (any but jemalloc).
pub fn metadata_bytes() -> Option<u64> {
    #[cfg(feature = "jemalloc")]
    if jemalloc_in_use() {
        return jemalloc_stat(c"stats.metadata");
    }
    None
}

/// One of jemalloc's statistics, fresh: they are a snapshot taken when the epoch is advanced.
#[cfg(feature = "jemalloc")]
fn jemalloc_stat(name: &std::ffi::CStr) -> Option<u64> {
    mallctl::<u64>(c"epoch", Some(1))?;
    mallctl::<usize>(name, None).map(|bytes| bytes as u64)
}

/// Reads jemalloc's control `name` as a `T`, writing `new` to it first when given. `None` when
/// jemalloc refuses (an unknown name, or a `T` of another size than the control's).
#[cfg(feature = "jemalloc")]
fn mallctl<T: Copy + Default>(name: &std::ffi::CStr, new: Option<T>) -> Option<T> {
    use std::ffi::c_void;
    use std::mem::size_of;
    let mut old = T::default();
    let mut old_len = size_of::<T>();
    let mut new = new;
    let (new_ptr, new_len) = match new.as_mut() {
        Some(value) => ((value as *mut T).cast::<c_void>(), size_of::<T>()),
        None => (std::ptr::null_mut(), 0),
    };
    // SAFETY: both pointers point at a live `T` whose size is passed beside it; jemalloc checks
    // the sizes against the control's type and refuses a mismatch without writing.
    let rc = unsafe {
        tikv_jemalloc_sys::mallctl(
            name.as_ptr(),
            (&raw mut old).cast::<c_void>(),
            &mut old_len,
            new_ptr,
            new_len,
        )
    };
    (rc == 0 && old_len == size_of::<T>()).then_some(old)
}

/// glibc's count of the bytes its heap has handed out.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn system_allocated() -> Option<u64> {
    // SAFETY: mallinfo2 only reads the allocator's statistics.
    let info = unsafe { libc::mallinfo2() };
    Some((info.uordblks + info.hblkhd) as u64)
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn system_allocated() -> Option<u64> {
    None
}

/// Held by the tests that read the process's heap counters, one at a time: `cargo test` runs
/// tests on threads of one process, and another such test's heap would count in.
#[cfg(test)]
pub(crate) static HEAP_MEASURED: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_large_reap_trims_and_a_steady_load_does_not() {
        let mut p = TrimPolicy::default();
        assert!(!p.observe(300_000));
        assert!(!p.observe(290_000), "a tenth gone is not half");
        assert!(p.observe(150_000));
        assert!(!p.observe(150_000));
        assert!(p.observe(10_000));
        assert!(p.observe(0));
        assert!(!p.observe(0));
    }

    /// Resident pages of this process (nextest runs each test in a process of its own).
    fn resident_bytes() -> u64 {
        let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
        let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
        pages * 4_096
    }

    #[test]
    fn a_trim_gives_freed_memory_back_and_the_allocator_counts_what_is_live() {
        let _alone = HEAP_MEASURED.blocking_lock();
        let before = allocated_bytes().expect("the allocator reports its statistics");
        let block = vec![7u8; 64 << 20];
        let during = allocated_bytes().unwrap();
        assert!(during >= before + (63 << 20), "{before} -> {during}");
        let resident = resident_bytes();
        drop(block);
        trim();
        assert!(allocated_bytes().unwrap() < during - (60 << 20));
        let after = resident_bytes();
        assert!(
            after + (48 << 20) < resident,
            "RSS {resident} -> {after}: the freed pages stayed mapped"
        );
    }

    /// A thread's cache is flushed once per trim, when the thread next looks: blocks freed on a
    /// thread stay counted as allocated (jemalloc keeps them in the thread's cache) until then.
    #[cfg(feature = "jemalloc")]
    #[test]
    fn a_thread_hands_its_cache_back_once_after_each_trim() {
        let _alone = HEAP_MEASURED.blocking_lock();
        std::thread::spawn(|| {
            let cache_some_blocks = || {
                let blocks: Vec<Box<[u8; 48]>> = (0..150).map(|_| Box::new([1; 48])).collect();
                drop(std::hint::black_box(blocks));
            };
            hand_back_cache_after_trim();
            cache_some_blocks();
            let cached = allocated_bytes().unwrap();
            hand_back_cache_after_trim();
            assert_eq!(
                allocated_bytes().unwrap(),
                cached,
                "no trim asked: the cache stays"
            );
            ask_for_thread_caches();
            hand_back_cache_after_trim();
            let flushed = allocated_bytes().unwrap();
            assert!(
                flushed + 48 * 50 <= cached,
                "{cached} -> {flushed}: the cache stayed"
            );
            cache_some_blocks();
            let cached_again = allocated_bytes().unwrap();
            hand_back_cache_after_trim();
            assert_eq!(
                allocated_bytes().unwrap(),
                cached_again,
                "flushed once per trim"
            );
        })
        .join()
        .unwrap();
    }

    /// The probe finds the test binary's allocator.
    #[cfg(feature = "jemalloc")]
    #[test]
    fn jemalloc_is_found_to_be_the_allocator() {
        assert!(jemalloc_in_use());
    }

    /// librdkafka's buffers come from the same heap as Rust's: `malloc` is jemalloc's.
    #[cfg(feature = "jemalloc")]
    #[test]
    fn the_c_libraries_allocate_from_jemalloc_too() {
        const SIZE: usize = 32 << 20;
        let _alone = HEAP_MEASURED.blocking_lock();
        let before = allocated_bytes().unwrap();
        // SAFETY: a plain allocation, freed below.
        let block = unsafe { libc::malloc(SIZE) };
        assert!(!block.is_null());
        let during = allocated_bytes().unwrap();
        // SAFETY: allocated above by the same malloc.
        unsafe { libc::free(block) };
        // Within a MiB: the allocation can set off a sweep of this thread's cache, which hands
        // a few small cached blocks back (and out of the count) meanwhile.
        assert!(
            during + (1 << 20) >= before + SIZE as u64,
            "{before} -> {during}: C's malloc is not jemalloc's"
        );
    }

    /// The options in `malloc_conf` are the ones jemalloc runs with (a misspelt option is
    /// only warned about on stderr, and the symbol's name must be the one jemalloc reads).
    #[cfg(feature = "jemalloc")]
    #[test]
    fn jemalloc_runs_with_the_engines_options() {
        assert_eq!(mallctl::<bool>(c"opt.background_thread", None), Some(true));
        assert_eq!(mallctl::<isize>(c"opt.muzzy_decay_ms", None), Some(0));
        assert_eq!(
            mallctl::<usize>(c"opt.tcache_gc_incr_bytes", None),
            Some(1 << 20)
        );
        // `slab_sizes` has no `opt.` control: read a class's slab (128-byte blocks, one page
        // by default, and a 1,280-byte class, five pages by default, whose four-page slab
        // wastes a block's worth: the setting caps as well as raises).
        let page = mallctl::<usize>(c"arenas.page", None).unwrap();
        let slab_of = |size: usize| {
            let bins = mallctl::<u32>(c"arenas.nbins", None).unwrap();
            (0..bins)
                .find(|i| {
                    let name = std::ffi::CString::new(format!("arenas.bin.{i}.size")).unwrap();
                    mallctl::<usize>(&name, None) == Some(size)
                })
                .map(|i| {
                    let name = std::ffi::CString::new(format!("arenas.bin.{i}.slab_size")).unwrap();
                    mallctl::<usize>(&name, None).unwrap()
                })
        };
        assert_eq!(slab_of(128), Some(4 * page));
        assert_eq!(slab_of(1_280), Some(4 * page));
    }

    #[cfg(feature = "jemalloc")]
    #[test]
    fn the_allocators_own_books_are_counted_and_grow_with_the_heap() {
        let _alone = HEAP_MEASURED.blocking_lock();
        let before = metadata_bytes().expect("jemalloc reports its metadata");
        assert!(before > 0);
        // Many blocks of a class the other tests hardly use (their slabs, freed, would be
        // reused without new books): a slab, and its descriptor, per few of them.
        let blocks: Vec<Box<[u8; 1_536]>> = (0..40_000).map(|_| Box::new([1; 1_536])).collect();
        let during = metadata_bytes().unwrap();
        assert!(during > before, "{before} -> {during}");
        drop(blocks);
    }

    #[test]
    fn small_drops_are_not_worth_a_trim() {
        let mut p = TrimPolicy::default();
        assert!(!p.observe(900));
        assert!(!p.observe(0));
        assert!(!p.observe(1));
        assert!(!p.observe(0), "a trickle of sessions never trims");
    }

    /// The halvings of a large reap stop short of zero (the last one left ~1,300 here); the
    /// fall to zero gives the rest back.
    #[test]
    fn the_end_of_a_burst_trims_what_the_halvings_left() {
        let mut p = TrimPolicy::default();
        assert!(!p.observe(5_000));
        assert!(p.observe(1_300));
        assert!(!p.observe(700), "not a halving by MIN_DROP");
        assert!(p.observe(0));
        assert!(!p.observe(0));
    }

    proptest! {
        /// Every trim follows a fall to at most half of the highest count since the previous
        /// trim, by at least `MIN_DROP` sessions, or the fall to zero of a burst that reached
        /// `MIN_DROP`; and every such fall to zero trims.
        #[test]
        fn trims_follow_halvings_and_ends_of_bursts(
            counts in proptest::collection::vec(
                prop_oneof![Just(0i64), 0i64..3_000, 0i64..1_000_000], 1..200)
        ) {
            let mut p = TrimPolicy::default();
            let (mut high, mut burst) = (0i64, 0i64);
            for live in counts {
                high = high.max(live);
                burst = burst.max(live);
                let end_of_burst = live == 0 && high > 0 && burst >= MIN_DROP;
                let trimmed = p.observe(live);
                if trimmed {
                    let halving = high - live >= MIN_DROP && live <= high / 2;
                    prop_assert!(halving || end_of_burst);
                    high = live;
                }
                if end_of_burst {
                    prop_assert!(trimmed, "a burst of {} ended untrimmed", burst);
                }
                if live == 0 {
                    burst = 0;
                }
            }
        }
    }
}
