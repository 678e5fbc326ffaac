//! Unreliable-datagram queue pairs: a [`QueuePair`] whose provider QP is UD
//! ([`Device::create_ud_qp`](crate::Device::create_ud_qp)). It shares
//! everything with RC (entries, ops, doorbell batching, inline sends,
//! [`RecvRing`](super::RecvRing)); what differs is here: its address
//! handles, the peers its sends name ([`UdPeer`]), and the WR that retires
//! unsignaled inline sends (RC's zero-length RDMA WRITE does not exist on
//! UD: a zero-length datagram to itself with a Q_Key it refuses does).

use std::cell::RefCell;
use std::collections::HashMap;

use super::QueuePair;
use crate::op::SubmitError;
use crate::provider::{AddressHandle, AhAttr, Endpoint, Pd, ProviderError, QpType, SendOp, UdDest};

/// What a peer needs to send datagrams to a UD queue pair; exchanged out of
/// band (or in the application's own control packets).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UdEndpoint {
    /// The QP's address: QP number, GID, LID, and on the soft device its
    /// engine's address. (`psn` and `mtu` are informational on UD.)
    pub endpoint: Endpoint,
    /// The Q_Key datagrams to the QP must carry.
    pub qkey: u32,
}

/// A destination of datagrams: a remote UD QP and the address handle of its
/// port. Cheap to clone. The address handle stays alive while a clone of
/// this lives and while its queue pair does (the QP caches its handles).
#[derive(Clone, Debug)]
pub struct UdPeer {
    dest: UdDest,
    remote: UdEndpoint,
    _ah: AddressHandle,
}

impl UdPeer {
    /// The destination work requests name.
    #[inline]
    pub fn dest(&self) -> UdDest {
        self.dest
    }

    /// The remote QP number.
    pub fn qpn(&self) -> u32 {
        self.dest.remote_qpn
    }

    /// The endpoint this peer was made from.
    pub fn endpoint(&self) -> &UdEndpoint {
        &self.remote
    }
}

/// A UD queue pair's own state.
pub(crate) struct UdState {
    /// Where address handles are made (`None` on the test-only fake).
    pd: Option<Pd>,
    qkey: u32,
    /// The local GID index address handles send from.
    sgid_index: u8,
    /// The port's active MTU: the largest datagram payload.
    pub(super) mtu: u32,
    /// Address handles by destination, kept while the QP lives (so that a
    /// WR in flight never names a destroyed one).
    ahs: RefCell<HashMap<AhAttr, AddressHandle>>,
}

impl UdState {
    pub(crate) fn new(pd: Option<Pd>, qkey: u32, sgid_index: u8, mtu: u32) -> UdState {
        UdState {
            pd,
            qkey,
            sgid_index,
            mtu,
            ahs: RefCell::new(HashMap::new()),
        }
    }

    fn address_handle(&self, attr: &AhAttr) -> Result<AddressHandle, ProviderError> {
        if let Some(ah) = self.ahs.borrow().get(attr) {
            return Ok(ah.clone());
        }
        let pd = self.pd.as_ref().ok_or(ProviderError::Unsupported {
            provider: "fake",
            what: "address handles",
        })?;
        let ah = pd.create_ah(attr)?;
        self.ahs.borrow_mut().insert(*attr, ah.clone());
        Ok(ah)
    }
}

/// A Q_Key different from `qkey` whose high bit is clear (a set high bit
/// would make the device send the QP's own Q_Key instead).
fn refused_qkey(qkey: u32) -> u32 {
    (qkey ^ 1) & 0x7fff_ffff
}

impl QueuePair {
    /// RC or UD.
    pub fn qp_type(&self) -> QpType {
        self.inner.core.qp.qp_type()
    }

    pub(super) fn ud_state(&self) -> Result<&UdState, ProviderError> {
        self.inner
            .ud
            .as_ref()
            .ok_or_else(|| ProviderError::InvalidArgument {
                call: "ud_peer",
                what: format!("QP {} is not a UD queue pair", self.qp_num()),
            })
    }

    /// UD: the largest datagram payload, the port's active MTU (`None` on
    /// RC). Devices differ on a larger one (rxe completes it successfully
    /// without sending it), so the runtime refuses it before posting:
    /// [`send_to`](crate::qp) forms and inline sends to a peer fail with
    /// [`SubmitError::Invalid`](crate::SubmitError::Invalid).
    pub fn ud_mtu(&self) -> Option<u32> {
        self.inner.ud.as_ref().map(|u| u.mtu)
    }

    /// Refuses a datagram payload larger than the MTU (nothing on RC).
    pub fn check_datagram_len(&self, len: usize) -> Result<(), SubmitError> {
        match &self.inner.ud {
            Some(ud) if len > ud.mtu as usize => Err(SubmitError::Invalid {
                what: format!(
                    "a datagram of {len} bytes on UD QP {}: the MTU is {}",
                    self.qp_num(),
                    ud.mtu
                ),
            }),
            _ => Ok(()),
        }
    }

    /// This UD QP's address, for peers (its GID from `gid_index`).
    pub fn ud_endpoint(&self, gid_index: u8) -> Result<UdEndpoint, ProviderError> {
        let ud = self.ud_state()?;
        Ok(UdEndpoint {
            endpoint: self.endpoint(gid_index)?,
            qkey: ud.qkey,
        })
    }

    /// A destination for datagrams from this UD QP: creates an address
    /// handle for `remote`'s port, or reuses the one this QP made before.
    pub fn ud_peer(&self, remote: &UdEndpoint) -> Result<UdPeer, ProviderError> {
        let ud = self.ud_state()?;
        let attr = AhAttr::to_endpoint(&remote.endpoint, ud.sgid_index);
        let ah = ud.address_handle(&attr)?;
        Ok(UdPeer {
            dest: UdDest {
                ah: ah.raw(),
                remote_qpn: remote.endpoint.qpn,
                remote_qkey: remote.qkey,
            },
            remote: *remote,
            _ah: ah,
        })
    }

    /// Makes the QP able to retire its unsignaled sends: the retiring WR
    /// is a zero-length datagram to this QP itself with a Q_Key it refuses,
    /// dropped on arrival without taking a receive. Called once it is in
    /// RTS.
    pub(crate) fn prepare_ud_retire(&self) -> Result<(), ProviderError> {
        let ud = self.ud_state()?;
        let me = self.ud_endpoint(ud.sgid_index)?;
        let peer = self.ud_peer(&me)?;
        let dest = UdDest {
            remote_qkey: refused_qkey(ud.qkey),
            ..peer.dest
        };
        self.inner
            .core
            .retire_op
            .set(Some(SendOp::SendTo { dest, imm: None }));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::refused_qkey;

    #[test]
    fn the_retiring_qkey_differs_and_has_its_high_bit_clear() {
        for q in [0, 1, 0x1111_1111, 0x8000_0000, 0x8000_0001, u32::MAX] {
            let r = refused_qkey(q);
            assert_ne!(r, q);
            assert_eq!(r & 0x8000_0000, 0);
        }
    }
}
