//! Logs to stderr: human-readable text (colour codes only on a terminal, never in a file or a
//! collector) or one JSON object per line for log pipelines, chosen with `CONFED_LOG_FORMAT`.

use thiserror::Error;

/// The environment variable every confed process reads its log format from.
pub const LOG_FORMAT_ENV: &str = "CONFED_LOG_FORMAT";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Error)]
pub enum LogsError {
    #[error("{LOG_FORMAT_ENV}={0:?} is not a log format: use text (the default) or json")]
    UnknownFormat(String),
}

impl LogFormat {
    /// `CONFED_LOG_FORMAT`: `text` (or unset) or `json`.
    pub fn from_env() -> Result<Self, LogsError> {
        match std::env::var(LOG_FORMAT_ENV) {
            Err(_) => Ok(Self::Text),
            Ok(value) => Self::parse(&value),
        }
    }

    pub fn parse(value: &str) -> Result<Self, LogsError> {
        match value.trim().to_ascii_lowercase().as_str() {
            "" | "text" => Ok(Self::Text),
            "json" => Ok(Self::Json),
            _ => Err(LogsError::UnknownFormat(value.to_string())),
        }
    }
}

/// Installs the process's log subscriber: the `RUST_LOG` filter (else `default_filter`), in the
/// format `CONFED_LOG_FORMAT` names. Call once, first thing in `main`.
pub fn init_logs(default_filter: &str) -> Result<LogFormat, LogsError> {
    let format = LogFormat::from_env()?;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| default_filter.into());
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter);
    match format {
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
        // One object a line: timestamp, level, target, the message and the event's fields.
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_ansi(false)
            .with_current_span(false)
            .init(),
    }
    Ok(format)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_parse_case_insensitively_and_anything_else_is_refused_with_the_choices() {
        assert_eq!(LogFormat::parse("JSON").unwrap(), LogFormat::Json);
        assert_eq!(LogFormat::parse("text").unwrap(), LogFormat::Text);
        assert_eq!(LogFormat::parse("").unwrap(), LogFormat::Text);
        let error = LogFormat::parse("logfmt").unwrap_err().to_string();
        assert_eq!(
            error,
            "CONFED_LOG_FORMAT=\"logfmt\" is not a log format: use text (the default) or json"
        );
    }
}
