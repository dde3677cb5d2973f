//! The plugin's view of its environment variables (`CNI_COMMAND`, `CNI_ARGS`, ...), behind a
//! trait so tests pass a map instead of mutating the process env.

use std::collections::HashMap;

/// Read access to environment variables, so tests pass a map instead of mutating the process env.
pub trait Env {
    /// The value of `key`, or `None` if unset (non-UTF-8 values are converted lossily).
    fn get(&self, key: &str) -> Option<String>;
}

/// The real process environment.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessEnv;

/// A fixed environment for tests and embedding.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MapEnv(HashMap<String, String>);

// === impl ProcessEnv ===

impl Env for ProcessEnv {
    fn get(&self, key: &str) -> Option<String> {
        std::env::var_os(key).map(|v| v.to_string_lossy().into_owned())
    }
}

// === impl MapEnv ===

impl MapEnv {
    /// Builds an environment from `(key, value)` pairs.
    pub fn from_pairs<K: Into<String>, V: Into<String>>(
        pairs: impl IntoIterator<Item = (K, V)>,
    ) -> MapEnv {
        MapEnv(
            pairs
                .into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
        )
    }

    /// Sets `key` to `value`.
    pub fn set(&mut self, key: impl Into<String>, value: impl Into<String>) {
        self.0.insert(key.into(), value.into());
    }

    /// Removes `key`.
    pub fn remove(&mut self, key: &str) {
        self.0.remove(key);
    }
}

impl Env for MapEnv {
    fn get(&self, key: &str) -> Option<String> {
        self.0.get(key).cloned()
    }
}
