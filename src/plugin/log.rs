//! Minimal leveled logging to the plugin's stderr (the CNI protocol reserves stdout for results).
//!
//! One line per event: `ztnode-cni <level>: <message>`. libcni copies a plugin's stderr into the
//! runtime's log, so the default level is `warn` to keep that log quiet; `plugin_log_level` raises it.

use std::fmt;
use std::io::Write;

/// Log level, quietest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Nothing is logged.
    Off,
    /// Failures.
    Error,
    /// Problems the plugin worked around (e.g. DEL could not reach the agent).
    Warn,
    /// One line per handled request.
    Info,
    /// Request details.
    Debug,
}

impl Level {
    /// Level used until the config says otherwise.
    pub const DEFAULT: Level = Level::Warn;

    /// Parses `plugin_log_level` (case-insensitive `debug`, `info`, `warn`/`warning`, `error`,
    /// `none`/`off`).
    pub fn parse(s: &str) -> Option<Level> {
        match s.to_ascii_lowercase().as_str() {
            "debug" => Some(Level::Debug),
            "info" => Some(Level::Info),
            "warn" | "warning" => Some(Level::Warn),
            "error" => Some(Level::Error),
            "none" | "off" => Some(Level::Off),
            _ => None,
        }
    }

    fn label(self) -> &'static str {
        match self {
            Level::Off => "off",
            Level::Error => "error",
            Level::Warn => "warn",
            Level::Info => "info",
            Level::Debug => "debug",
        }
    }
}

/// A logger writing to a borrowed stderr. Write errors are ignored (there is nowhere to report them).
pub struct Log<'a> {
    out: &'a mut dyn Write,
    level: Level,
}

impl<'a> Log<'a> {
    /// Logs to `out` at [`Level::DEFAULT`].
    pub fn new(out: &'a mut dyn Write) -> Log<'a> {
        Log {
            out,
            level: Level::DEFAULT,
        }
    }

    /// Changes the threshold.
    pub fn set_level(&mut self, level: Level) {
        self.level = level;
    }

    /// Writes one line if `level` passes the threshold.
    pub fn log(&mut self, level: Level, args: fmt::Arguments<'_>) {
        if level != Level::Off && level <= self.level {
            let _ = writeln!(self.out, "ztnode-cni {}: {}", level.label(), args);
        }
    }

    /// Writes unconditionally (the about text).
    pub fn raw(&mut self, text: &str) {
        let _ = self.out.write_all(text.as_bytes());
    }

    /// Logs at [`Level::Error`].
    pub fn error(&mut self, args: fmt::Arguments<'_>) {
        self.log(Level::Error, args);
    }

    /// Logs at [`Level::Warn`].
    pub fn warn(&mut self, args: fmt::Arguments<'_>) {
        self.log(Level::Warn, args);
    }

    /// Logs at [`Level::Info`].
    pub fn info(&mut self, args: fmt::Arguments<'_>) {
        self.log(Level::Info, args);
    }

    /// Logs at [`Level::Debug`].
    pub fn debug(&mut self, args: fmt::Arguments<'_>) {
        self.log(Level::Debug, args);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threshold_filters_lines() {
        let mut buf = Vec::new();
        let mut log = Log::new(&mut buf);
        log.info(format_args!("hidden"));
        log.warn(format_args!("shown {}", 1));
        log.set_level(Level::Debug);
        log.debug(format_args!("now shown"));
        log.set_level(Level::Off);
        log.error(format_args!("silenced"));
        let text = String::from_utf8(buf).expect("utf8");
        assert_eq!(
            text,
            "ztnode-cni warn: shown 1\nztnode-cni debug: now shown\n"
        );
    }

    #[test]
    fn parses_levels() {
        assert_eq!(Level::parse("WARNING"), Some(Level::Warn));
        assert_eq!(Level::parse("none"), Some(Level::Off));
        assert_eq!(Level::parse("trace"), None);
    }
}
