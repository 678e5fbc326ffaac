//! Address handles of the software device: the route to a remote port.

use crate::provider::{AhAttr, AhHandle, ProviderError, Result};

/// An address handle of the software device.
#[derive(Clone, Debug)]
pub struct Ah {
    raw: AhHandle,
}

impl Ah {
    /// Creates an address handle for `attr`.
    pub(crate) fn create(_attr: &AhAttr) -> Result<Ah> {
        Err(ProviderError::Unsupported {
            provider: "soft",
            what: "address handles",
        })
    }

    /// The handle UD work requests carry.
    pub fn raw(&self) -> AhHandle {
        self.raw
    }
}
