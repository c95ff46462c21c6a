//! One log format for every role, through the `log` facade:
//! `[gradhub <who>] <message>` (warnings and errors say so), on stderr,
//! filtered by `GRADHUB_LOG=error|warn|info|debug|trace` (default info).
//! `<who>` is the record's target, which every call sets to the role
//! speaking ("scheduler", "server 1", "server 1/t0", "worker 3").

use std::io::Write;

/// Install the logger once per process (later calls do nothing), so a
/// process hosting several roles (torchrun mode) logs them all alike.
pub fn init() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let raw = crate::settings::log_level();
        let (level, bad) = match raw.trim().to_ascii_lowercase().as_str() {
            "" | "info" => (log::LevelFilter::Info, false),
            "error" => (log::LevelFilter::Error, false),
            "warn" | "warning" => (log::LevelFilter::Warn, false),
            "debug" => (log::LevelFilter::Debug, false),
            "trace" => (log::LevelFilter::Trace, false),
            "off" => (log::LevelFilter::Off, false),
            _ => (log::LevelFilter::Info, true),
        };
        let _ = env_logger::Builder::new()
            .filter_level(level)
            .target(env_logger::Target::Stderr)
            .format(|buf, rec| {
                let mark = match rec.level() {
                    log::Level::Error => "error: ",
                    log::Level::Warn => "warning: ",
                    log::Level::Info => "",
                    log::Level::Debug => "debug: ",
                    log::Level::Trace => "trace: ",
                };
                writeln!(buf, "[gradhub {}] {mark}{}", rec.target(), rec.args())
            })
            .try_init();
        if bad {
            log::warn!(target: "log", "GRADHUB_LOG={raw:?} is not one of error, warn, info, debug, trace, off; using info");
        }
    });
}

/// `s` as a JSON string literal (no serde for a few small reports).
pub fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = std::fmt::Write::write_fmt(&mut out, format_args!("\\u{:04x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}
