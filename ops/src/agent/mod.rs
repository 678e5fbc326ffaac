//! The MR-token agent (DESIGN.md section 7). This version holds its wire
//! codec; the agent task and the `Rdma` connection build on it.

pub mod wire;
