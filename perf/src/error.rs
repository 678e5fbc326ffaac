//! The tool's error: what failed, with the cause kept as its source.

use std::error::Error as StdError;

/// A failure, with the step it happened in.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `what` failed because of `source`.
    #[error("{what}")]
    Ctx {
        /// The step that failed.
        what: String,
        /// Why.
        #[source]
        source: Box<dyn StdError + 'static>,
    },
    /// A failure with no underlying error (a peer's bad answer, a refused
    /// setting).
    #[error("{0}")]
    Msg(String),
}

/// Results of the tool.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Adds the step to an error.
pub trait Context<T> {
    /// Wraps the error as the cause of `what`.
    fn ctx(self, what: impl Into<String>) -> Result<T>;
    /// [`ctx`](Self::ctx) with `what` made only on an error (for loops:
    /// no formatting per iteration).
    fn ctx_with(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T, E: StdError + 'static> Context<T> for std::result::Result<T, E> {
    fn ctx(self, what: impl Into<String>) -> Result<T> {
        self.map_err(|e| Error::Ctx {
            what: what.into(),
            source: Box::new(e),
        })
    }
    fn ctx_with(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| Error::Ctx {
            what: what(),
            source: Box::new(e),
        })
    }
}

/// An [`Error::Msg`].
pub fn msg(s: impl Into<String>) -> Error {
    Error::Msg(s.into())
}

/// The error and its causes on one line: `a: b: c` (verbio's
/// [`ErrorChain`](verbio::ErrorChain)).
pub fn chain(e: &(dyn StdError + 'static)) -> String {
    verbio::ErrorChain(e).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_prints_each_cause_once() {
        let io = std::io::Error::other("refused");
        let e = Err::<(), _>(io).ctx("connecting").expect_err("fails");
        assert_eq!(chain(&e), "connecting: refused");
    }
}
