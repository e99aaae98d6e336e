//! A topic's name as every record carries it: interned once, then copied as a pointer.
//!
//! Every record names the topic it came from. As an `Arc<str>`, each record cloned it on the
//! consumer loop's thread and dropped it on a runtime worker's: two atomic writes per record to
//! one reference count that the two cores took from each other, a million times a second in a
//! backlog. A worker reads one input topic for its whole life, so the name is interned instead:
//! it is kept for the process's lifetime, once per distinct name, and a record holds a
//! `&'static str` that costs nothing to copy or drop.
//!
//! The set of names only grows, by names a process chose to read (its configured input, and in
//! tests one per test), never by anything a record carries.

use std::collections::HashSet;
use std::fmt;
use std::ops::Deref;
use std::sync::{LazyLock, Mutex};

/// An interned topic name. `From<&str>` interns (a lock and a lookup: made once per topic,
/// not per record); copying one is copying a pointer.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TopicName(&'static str);

static NAMES: LazyLock<Mutex<HashSet<&'static str>>> = LazyLock::new(Default::default);

impl TopicName {
    /// The name, interned: the same name gives the same pointer, whoever asked first.
    pub fn new(name: &str) -> Self {
        let mut names = NAMES
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(known) = names.get(name) {
            return Self(known);
        }
        let leaked: &'static str = Box::leak(name.into());
        names.insert(leaked);
        Self(leaked)
    }

    pub fn as_str(&self) -> &'static str {
        self.0
    }
}

impl From<&str> for TopicName {
    fn from(name: &str) -> Self {
        Self::new(name)
    }
}

impl Deref for TopicName {
    type Target = str;

    fn deref(&self) -> &str {
        self.0
    }
}

impl PartialEq<&str> for TopicName {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

impl fmt::Display for TopicName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

impl fmt::Debug for TopicName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.0, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_is_kept_once_and_every_copy_points_at_it() {
        let name = format!("topic-name-test-{}", std::process::id());
        let first = TopicName::new(&name);
        let again = TopicName::from(name.as_str());
        assert_eq!(first, again);
        assert!(
            std::ptr::eq(first.as_str(), again.as_str()),
            "the second asking reuses the first name's memory"
        );
        assert_eq!(first, name.as_str());
        assert_eq!(first.to_string(), name);
        let other = TopicName::new("topic-name-test-other");
        assert_ne!(first, other);
    }

    #[test]
    fn a_record_holds_a_name_that_needs_no_drop() {
        // What the module is for: copying or dropping a record's topic writes no shared memory.
        assert!(!std::mem::needs_drop::<TopicName>());
        assert_eq!(
            std::mem::size_of::<TopicName>(),
            std::mem::size_of::<&str>()
        );
    }
}
