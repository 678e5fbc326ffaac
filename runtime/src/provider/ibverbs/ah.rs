//! Address handles (`ibv_ah`): the route to a remote port.

use crate::provider::{AhAttr, AhHandle, ProviderError, Result};

use super::Pd;

/// An address handle; destroyed when the last clone drops.
#[derive(Clone, Debug)]
pub struct Ah {
    raw: AhHandle,
}

impl Ah {
    /// `ibv_create_ah` for `attr`.
    pub(crate) fn create(_pd: &Pd, _attr: &AhAttr) -> Result<Ah> {
        Err(ProviderError::Unsupported {
            provider: "ibverbs",
            what: "address handles",
        })
    }

    /// The handle UD work requests carry.
    pub fn raw(&self) -> AhHandle {
        self.raw
    }
}
