//! [`ErrorChain`]: an error and its causes in one line, for logs and reports.
//!
//! verbio's errors keep their source out of their own `Display` (the source
//! is reachable through `Error::source`), so a report that walks the chain
//! shows each message once.

/// Displays an error and every error in its `source()` chain, joined by
/// `": "` (`top: cause: root cause`): how to print or log a verbio error
/// (its own `Display` is only the top line).
///
/// ```
/// # mod verbio { pub use verbio_runtime::ErrorChain; }
/// use verbio::ErrorChain;
///
/// #[derive(Debug)]
/// struct Bind(std::io::Error); // an error that keeps its cause as source()
/// impl std::fmt::Display for Bind {
///     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
///         f.write_str("binding the listener")
///     }
/// }
/// impl std::error::Error for Bind {
///     fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
///         Some(&self.0)
///     }
/// }
///
/// let e = Bind(std::io::Error::from(std::io::ErrorKind::AddrInUse));
/// assert_eq!(e.to_string(), "binding the listener");
/// assert_eq!(ErrorChain(&e).to_string(), "binding the listener: address in use");
/// // In logs: tracing::warn!(error = %ErrorChain(&e), "...");
/// // Through Box<dyn Error>: ErrorChain(&*boxed).
/// ```
#[derive(Debug, Clone, Copy)]
pub struct ErrorChain<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut next = self.0.source();
        while let Some(e) = next {
            write!(f, ": {e}")?;
            next = e.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::ErrorChain;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn each_message_once_in_order() {
        let e = Outer(std::io::Error::other("inner"));
        assert_eq!(ErrorChain(&e).to_string(), "outer: inner");
    }
}
