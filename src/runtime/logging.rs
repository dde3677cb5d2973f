//! Logging as ztunnel logs (its `src/telemetry.rs`; spec §7): one line per event on stderr, in
//! ztunnel's plain or JSON shape, through a target filter that the admin endpoint `/logging`
//! changes at run time.
//!
//! - Plain (default): `<RFC 3339 time>\t<level>\t<scope>[:span{fields}]\t<message>\t<k=v k=v>`,
//!   level lower case, scope = the event's target without the `ztnode::` prefix, values in their
//!   `Debug` form (strings quoted).
//! - JSON (`LOG_FORMAT=json`): one object per line, keys `level` (lower case), `time`, `scope`
//!   (the full target), `message`, then the event's fields flat, then one object per enclosing
//!   span named after it.
//! - Filter: `RUST_LOG` in the target-directive syntax (`info`, `ztnode::proxy=debug,warn`),
//!   default `info`, always after [`QUIET_CRATES`], so a noisy dependency stays at `warn` unless
//!   the directives name it again.

use std::fmt;
use std::str::FromStr;
use std::sync::OnceLock;

use serde::ser::{SerializeMap, Serializer as _};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_log::NormalizeEvent;
use tracing_subscriber::filter::{ParseError, Targets};
use tracing_subscriber::fmt::format::{JsonFields, Writer};
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{Registry, reload};

/// Directives put ahead of `RUST_LOG` (and of every `/logging` change made with `reset`): the
/// dependencies that log per connection or per request at `info` and below.
pub const QUIET_CRATES: &str = "h2=warn,hyper=warn,hyper_util=warn,rustls=warn,tower=warn,\
tonic=warn,kube=warn,kube_client=warn,kube_runtime=warn,hickory_proto=warn,mio=warn,\
netlink_proto=warn,netlink_packet_route=error";

/// The level when `RUST_LOG` is unset or empty.
pub const DEFAULT_LEVEL: &str = "info";

/// The env variable of the filter directives.
pub const RUST_LOG_ENV: &str = "RUST_LOG";

/// The env switch of the JSON format (ztunnel's).
pub const LOG_FORMAT_ENV: &str = "LOG_FORMAT";

/// Errors reading or changing the log filter.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// A clause is neither a level nor `target=level`.
    #[error("level {0:?} is invalid: use error|warn|info|debug|trace|off or <target>=<level>")]
    InvalidLevel(String),
    /// The directives do not parse.
    #[error("invalid log directives: {0}")]
    Parse(#[from] ParseError),
    /// The filter could not be swapped (the subscriber is gone).
    #[error("reloading the log filter: {0}")]
    Reload(#[from] reload::Error),
    /// [`init`] did not run in this process.
    #[error("logging is not initialised")]
    Uninitialized,
}

type FilterHandle = reload::Handle<Targets, Registry>;

static FILTER: OnceLock<FilterHandle> = OnceLock::new();

/// The filter for `rust_log` (the value of `RUST_LOG`): [`QUIET_CRATES`], then the directives,
/// or [`DEFAULT_LEVEL`] when there are none. Errors: the directives do not parse.
pub fn filter_for(rust_log: Option<&str>) -> Result<Targets, ParseError> {
    let user = rust_log
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .unwrap_or(DEFAULT_LEVEL);
    Targets::from_str(&format!("{QUIET_CRATES},{user}"))
}

fn fallback_filter() -> Targets {
    filter_for(None).unwrap_or_else(|_| Targets::new().with_default(Level::INFO))
}

/// Installs the process's subscriber (once; later calls do nothing): the format from
/// `LOG_FORMAT`, the filter from `RUST_LOG` (a `RUST_LOG` that does not parse is reported and
/// replaced by the default), records of the `log` crate turned into events.
pub fn init() {
    let rust_log = std::env::var(RUST_LOG_ENV).ok();
    let (filter, bad) = match filter_for(rust_log.as_deref()) {
        Ok(f) => (f, None),
        Err(e) => (fallback_filter(), Some(e)),
    };
    let json = std::env::var(LOG_FORMAT_ENV).is_ok_and(|v| v == "json");
    let (filter, handle) = reload::Layer::new(filter);
    let plain_layer = (!json).then(|| {
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .event_format(PlainFormat)
            .fmt_fields(PlainFormat)
    });
    let json_layer = json.then(|| {
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .event_format(JsonFormat)
            .fmt_fields(JsonFields::new())
    });
    let installed = tracing_subscriber::registry()
        .with(filter)
        .with(plain_layer)
        .with(json_layer)
        .try_init()
        .is_ok();
    if installed {
        let _ = FILTER.set(handle);
    }
    if let Some(e) = bad {
        tracing::warn!(
            rust_log = rust_log.unwrap_or_default(),
            error = %e,
            "RUST_LOG does not parse; logging at the default level"
        );
    }
}

/// The filter in force, as directives (e.g. `h2=warn,...,info`).
pub fn current_level() -> Result<String, LogError> {
    let handle = FILTER.get().ok_or(LogError::Uninitialized)?;
    Ok(handle.with_current(|f| f.to_string())?)
}

/// Checks `/logging`'s `level` as ztunnel does: comma-separated clauses, each a level
/// (`error|warn|info|debug|trace|off`) or `target=level`.
pub fn validate_level(level: &str) -> Result<(), LogError> {
    for clause in level.split(',') {
        match clause {
            "off" | "error" | "warn" | "info" | "debug" | "trace" => {}
            c if c.contains('=') => {
                Targets::from_str(c)?;
            }
            c => return Err(LogError::InvalidLevel(c.to_owned())),
        }
    }
    Ok(())
}

/// The directives after a `/logging` change: with `reset`, the start-up default (without
/// `RUST_LOG`) followed by `level`; else the `current` directives followed by `level` (a later
/// directive for the same target wins). Pure.
pub fn next_directives(current: &str, reset: bool, level: &str) -> String {
    let base = if reset {
        fallback_filter().to_string()
    } else {
        current.to_owned()
    };
    match (base.is_empty(), level.is_empty()) {
        (_, true) => base,
        (true, false) => level.to_owned(),
        (false, false) => format!("{base},{level}"),
    }
}

/// Applies a `/logging` change ([`validate_level`], [`next_directives`]) without a restart and
/// returns the new filter's directives. Errors: an invalid level, or logging not initialised.
pub fn set_level(reset: bool, level: &str) -> Result<String, LogError> {
    if !level.is_empty() {
        validate_level(level)?;
    }
    let handle = FILTER.get().ok_or(LogError::Uninitialized)?;
    let current = handle.with_current(|f| f.to_string())?;
    let next = Targets::from_str(&next_directives(&current, reset, level))?;
    let shown = next.to_string();
    handle.reload(next)?;
    tracing::info!(filter = %shown, "new log filter");
    Ok(shown)
}

/// ztunnel's plain line (see the module docs); also formats span fields (`k=v`, space
/// separated).
#[derive(Debug, Clone, Copy, Default)]
pub struct PlainFormat;

/// ztunnel's JSON line (see the module docs).
#[derive(Debug, Clone, Copy, Default)]
pub struct JsonFormat;

/// Writes fields as ztunnel's plain format does: the message then a tab, the rest `k=v`
/// separated by spaces; the `log.*` fields of converted `log` records are skipped.
struct PlainVisitor<'w> {
    writer: Writer<'w>,
    first: bool,
    res: fmt::Result,
}

impl Visit for PlainVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.record_debug(field, &value)
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if self.res.is_err() {
            return;
        }
        self.res = match field.name() {
            n if n.starts_with("log.") => Ok(()),
            "message" => write!(self.writer, "{value:?}\t"),
            n => {
                let pad = if std::mem::take(&mut self.first) {
                    ""
                } else {
                    " "
                };
                write!(self.writer, "{pad}{n}={value:?}")
            }
        };
    }
}

impl<'w> FormatFields<'w> for PlainFormat {
    fn format_fields<R: tracing_subscriber::field::RecordFields>(
        &self,
        writer: Writer<'w>,
        fields: R,
    ) -> fmt::Result {
        let mut v = PlainVisitor {
            writer,
            first: true,
            res: Ok(()),
        };
        fields.record(&mut v);
        v.res
    }
}

impl<S, N> FormatEvent<S, N> for PlainFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let normalized = event.normalized_metadata();
        let meta = normalized.as_ref().unwrap_or_else(|| event.metadata());
        SystemTime.format_time(&mut writer)?;
        write!(writer, "\t{}\t", level_str(meta.level()))?;
        let target = meta.target();
        write!(
            writer,
            "{}",
            target.strip_prefix("ztnode::").unwrap_or(target)
        )?;
        if let Some(scope) = ctx.event_scope() {
            for span in scope.from_root() {
                write!(writer, ":{}", span.metadata().name())?;
                let ext = span.extensions();
                if let Some(fields) = ext.get::<FormattedFields<N>>()
                    && !fields.is_empty()
                {
                    write!(writer, "{{{fields}}}")?;
                }
            }
        }
        if event.fields().next().is_some() {
            write!(writer, "\t")?;
        }
        ctx.format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}

fn level_str(level: &Level) -> &'static str {
    match *level {
        Level::ERROR => "error",
        Level::WARN => "warn",
        Level::INFO => "info",
        Level::DEBUG => "debug",
        Level::TRACE => "trace",
    }
}

/// Adapts a `fmt::Write` to the `io::Write` serde_json writes to.
struct FmtToIo<'a, 'w>(&'a mut Writer<'w>);

impl std::io::Write for FmtToIo<'_, '_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let s = std::str::from_utf8(buf)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        fmt::Write::write_str(self.0, s).map_err(std::io::Error::other)?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Serialises each field as one entry of the line's object, numbers and booleans as such.
struct JsonVisitor<M: SerializeMap> {
    map: M,
    res: Result<(), M::Error>,
}

impl<M: SerializeMap> JsonVisitor<M> {
    fn entry<T: serde::Serialize + ?Sized>(&mut self, field: &Field, value: &T) {
        if self.res.is_ok() && !field.name().starts_with("log.") {
            self.res = self.map.serialize_entry(field.name(), value);
        }
    }
}

impl<M: SerializeMap> Visit for JsonVisitor<M> {
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.entry(field, &value)
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.entry(field, &value)
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.entry(field, &value)
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.entry(field, &value)
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.entry(field, value)
    }
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.entry(field, &format_args!("{value:?}"))
    }
}

impl<S, N> FormatEvent<S, N> for JsonFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let normalized = event.normalized_metadata();
        let meta = normalized.as_ref().unwrap_or_else(|| event.metadata());
        let mut time = String::with_capacity(32);
        SystemTime.format_time(&mut Writer::new(&mut time))?;
        let write = |writer: &mut Writer<'_>| -> Result<(), serde_json::Error> {
            let mut ser = serde_json::Serializer::new(FmtToIo(writer));
            let mut map = ser.serialize_map(None)?;
            map.serialize_entry("level", level_str(meta.level()))?;
            map.serialize_entry("time", &time)?;
            map.serialize_entry("scope", meta.target())?;
            let mut v = JsonVisitor { map, res: Ok(()) };
            event.record(&mut v);
            v.res?;
            let mut map = v.map;
            if let Some(scope) = ctx.event_scope() {
                for span in scope.from_root() {
                    let ext = span.extensions();
                    if let Some(fields) = ext.get::<FormattedFields<N>>() {
                        let value: serde_json::Value = serde_json::from_str(fields)
                            .unwrap_or_else(|_| serde_json::Value::String(fields.to_string()));
                        map.serialize_entry(span.metadata().name(), &value)?;
                    }
                }
            }
            map.end()
        };
        write(&mut writer).map_err(|_| fmt::Error)?;
        writeln!(writer)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("buf").extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Buf {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().expect("buf").clone()).expect("utf8")
        }
    }

    fn capture(json: bool, emit: impl FnOnce()) -> String {
        let buf = Buf::default();
        let w = buf.clone();
        let make = move || w.clone();
        let sub = tracing_subscriber::registry()
            .with(filter_for(Some("trace")).expect("filter"))
            .with((!json).then(|| {
                tracing_subscriber::fmt::layer()
                    .with_writer(make.clone())
                    .event_format(PlainFormat)
                    .fmt_fields(PlainFormat)
            }))
            .with(json.then(|| {
                tracing_subscriber::fmt::layer()
                    .with_writer(make)
                    .event_format(JsonFormat)
                    .fmt_fields(JsonFields::new())
            }));
        tracing::subscriber::with_default(sub, emit);
        buf.text()
    }

    #[test]
    fn json_lines_have_ztunnels_top_level_keys_with_fields_flat() {
        let out = capture(true, || {
            tracing::info!(target: "ztnode::proxy", bytes_sent = 12u64, "src.addr" = %"10.0.0.1:4000", ok = true, "connection complete");
        });
        let line: serde_json::Value = serde_json::from_str(out.trim_end()).expect("json line");
        let keys: Vec<&str> = line
            .as_object()
            .expect("object")
            .keys()
            .map(String::as_str)
            .collect();
        assert_eq!(keys[..3], ["level", "time", "scope"]);
        let mut rest = keys[3..].to_vec();
        rest.sort_unstable();
        assert_eq!(rest, ["bytes_sent", "message", "ok", "src.addr"]);
        assert_eq!(line["level"], "info");
        assert_eq!(line["scope"], "ztnode::proxy");
        assert_eq!(line["message"], "connection complete");
        assert_eq!(line["src.addr"], "10.0.0.1:4000");
        assert_eq!(line["bytes_sent"], 12);
        assert_eq!(line["ok"], true);
        let time = line["time"].as_str().expect("time");
        assert!(
            time.len() >= 20 && time.ends_with('Z') && time.as_bytes()[10] == b'T',
            "{time}"
        );
    }

    #[test]
    fn json_span_fields_are_an_object_named_after_the_span() {
        let out = capture(true, || {
            let span = tracing::info_span!("pod", uid = "u1");
            let _e = span.enter();
            tracing::warn!(target: "ztnode::agent", "x");
        });
        let line: serde_json::Value = serde_json::from_str(out.trim_end()).expect("json");
        assert_eq!(line["level"], "warn");
        assert_eq!(line["pod"]["uid"], "u1");
    }

    #[test]
    fn plain_lines_are_tab_separated_as_ztunnels() {
        let out = capture(false, || {
            tracing::info!(target: "ztnode::proxy::outbound", direction = "outbound", bytes = 3u64, "connection complete");
            tracing::debug!(target: "other", "bare");
        });
        let lines: Vec<&str> = out.lines().collect();
        let cols: Vec<&str> = lines[0].split('\t').collect();
        assert_eq!(cols.len(), 5, "{:?}", lines[0]);
        assert!(
            cols[0].ends_with('Z') && cols[0].contains('T'),
            "{}",
            cols[0]
        );
        assert_eq!(
            &cols[1..],
            [
                "info",
                "proxy::outbound",
                "connection complete",
                "direction=\"outbound\" bytes=3"
            ]
        );
        let cols: Vec<&str> = lines[1].split('\t').collect();
        assert_eq!(&cols[1..], ["debug", "other", "bare", ""]);
    }

    #[test]
    fn noisy_crates_stay_quiet_unless_named() {
        let f = filter_for(Some("debug")).expect("filter");
        assert!(f.would_enable("ztnode::proxy", &Level::DEBUG));
        assert!(!f.would_enable("h2::codec", &Level::INFO));
        assert!(f.would_enable("h2::codec", &Level::WARN));
        assert!(!f.would_enable("kube_runtime::watcher", &Level::INFO));
        let f = filter_for(Some("info,h2=debug")).expect("filter");
        assert!(f.would_enable("h2::codec", &Level::DEBUG));
        assert!(!f.would_enable("hyper::proto", &Level::INFO));
        let f = filter_for(None).expect("default");
        assert!(f.would_enable("ztnode::node", &Level::INFO));
        assert!(!f.would_enable("ztnode::node", &Level::DEBUG));
        assert!(filter_for(Some("[span]=x")).is_err());
    }

    #[test]
    fn logging_levels_are_validated_and_appended_as_ztunnel_does() {
        for ok in ["debug", "off", "ztnode::proxy=debug,info", "access=trace"] {
            assert!(validate_level(ok).is_ok(), "{ok}");
        }
        for bad in ["loud", "debug,nope", ""] {
            assert!(validate_level(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            next_directives("h2=warn,info", false, "debug"),
            "h2=warn,info,debug"
        );
        assert_eq!(next_directives("h2=warn,info", false, ""), "h2=warn,info");
        let reset = next_directives("whatever", true, "access=debug");
        assert!(
            reset.ends_with(",access=debug") && reset.contains("h2=warn"),
            "{reset}"
        );
        let applied =
            Targets::from_str(&next_directives("h2=warn,info", false, "debug")).expect("parses");
        assert!(applied.would_enable("ztnode::x", &Level::DEBUG));
        assert!(!applied.would_enable("h2", &Level::INFO));
    }
}
