//! What the runtime's examples share: their log subscriber.

/// Logs to stderr at `info` unless `RUST_LOG` says otherwise; in colour
/// only when stderr is a terminal (a log file or a pipe gets plain text).
pub fn init_tracing() {
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}
