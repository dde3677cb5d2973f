//! Loading the local config file and reloading it when it changes.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{ProxyState, StateHandle};
use crate::proxy::config::{ConfigError, parse_local_config};

/// Reads, parses and validates the local config file at `path`.
///
/// # Errors
/// [`ConfigError::Read`] if the file cannot be read (or is not UTF-8), otherwise the errors of
/// [`parse_local_config`] and [`ProxyState::from_config`].
pub fn load_config_file(path: &Path) -> Result<ProxyState, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    ProxyState::from_config(&parse_local_config(&text)?)
}

/// Polls `path` every `poll` and stores a new snapshot in `handle` whenever the file's content
/// changes into a valid config that differs from the current state. A missing, unreadable or
/// invalid file keeps the last good state and logs why (`tracing::warn`, once per distinct
/// content). Runs until the task is dropped or aborted.
pub async fn watch_config_file(path: PathBuf, handle: StateHandle, poll: Duration) {
    let mut interval = tokio::time::interval(poll);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The content last acted on; `None` until the first successful read.
    let mut last: Option<Vec<u8>> = None;
    let mut read_failing = false;
    loop {
        interval.tick().await;
        let bytes = match tokio::fs::read(&path).await {
            Ok(b) => {
                read_failing = false;
                b
            }
            Err(source) => {
                if !read_failing {
                    let e = ConfigError::Read {
                        path: path.clone(),
                        source,
                    };
                    tracing::warn!(error = %e, "keeping the last good local config");
                    read_failing = true;
                }
                continue;
            }
        };
        if last.as_deref() == Some(bytes.as_slice()) {
            continue;
        }
        match reload(&path, &bytes) {
            Ok(state) => {
                if *handle.load() != state {
                    handle.store(state);
                    tracing::info!(path = %path.display(), version = handle.version(), "local config reloaded");
                }
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "invalid local config; keeping the last good state");
            }
        }
        last = Some(bytes);
    }
}

fn reload(path: &Path, bytes: &[u8]) -> Result<ProxyState, ConfigError> {
    let text = std::str::from_utf8(bytes).map_err(|e| ConfigError::Read {
        path: path.to_owned(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
    })?;
    ProxyState::from_config(&parse_local_config(text)?)
}
