//! [`ErrorChain`]: an error and its causes in one line, for logs and reports.
//!
//! verbio's errors keep their source out of their own `Display` (the source
//! is reachable through `Error::source`), so a report that walks the chain
//! shows each message once.

/// Displays an error and every error in its `source()` chain, joined by
/// `": "` (`top: cause: root cause`).
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
