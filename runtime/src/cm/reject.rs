//! Reject reasons, numbered as the InfiniBand CM numbers them (the `status`
//! of [`CmError::Rejected`](super::CmError::Rejected), and of librdmacm's
//! `RDMA_CM_EVENT_REJECTED`). The software device's listener answers a
//! request it cannot take with the closest of these.

/// The listener has no room: its queue of requests (the backlog) is full,
/// too many connections from the requester's address are pending, or no
/// queue pair could be made for the connection.
pub const REJECT_NO_RESOURCES: u16 = 3;
/// A malformed or unsupported request: a field out of range (a QPN or PSN
/// of 2^24 or more), a truncated or oversized frame, extra bytes, a frame
/// of another type than a request ("unsupported request").
pub const REJECT_UNSUPPORTED: u16 = 5;
/// Nobody listens at that address and port ("invalid service ID").
pub const REJECT_NO_LISTENER: u16 = 8;
/// The requester's address cannot be used: none given (address family 0),
/// an unknown family, port 0 or the unspecified address (the software
/// device's engine address stands where InfiniBand has the GID: "invalid
/// GID").
pub const REJECT_INVALID_ADDRESS: u16 = 12;
/// The requester's MTU code is not one of the verbs MTUs ("invalid MTU").
pub const REJECT_INVALID_MTU: u16 = 26;
/// The application refused the request ([`CmRequest::reject`](super::CmRequest::reject);
/// "consumer reject").
pub const REJECT_CONSUMER: u16 = 28;
